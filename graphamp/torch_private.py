"""The private torch APIs graphamp calls that have no public form, each with why and the torches it was checked on.

New private uses go here, so that the next torch release breaks one file. Each is pinned by a test (named below)
that fails if torch changes what graphamp relies on.
"""

from __future__ import annotations

import torch
import torch.utils._python_dispatch as _python_dispatch
from torch._guards import TracingContext

__all__ = [
    "dispatch_mode_makes_dynamo_run_eagerly", "dynamo_traces_this_thread", "never_a_frame_of_its_own",
    "tracing_on_fake_tensors",
]


def dispatch_mode_makes_dynamo_run_eagerly() -> bool:
    """Whether a TorchDispatchMode is active that makes dynamo run a frame eagerly (FlopCounterMode, a memory
    tracker; not one whose `ignore_compile_internals()` is True), and, after one such call, mark the frame's compiled
    code skipped for good. Checked on torch 2.13 (2.11: not yet run); pinned by tests/test_eager_policy.py
    (test_a_rewritten_model_under_a_dispatch_mode_runs_low_and_keeps_its_graphs)."""
    on_stack = getattr(_python_dispatch, "any_torch_dispatch_mode_on_stack", None)
    if on_stack is not None and getattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile", False):
        return on_stack()  # what dynamo's convert_frame asks on torch 2.13
    return _python_dispatch.is_in_any_mode_without_ignore_compile_internals()


def tracing_on_fake_tensors() -> bool:
    """Whether a FakeTensorMode is active: torch is tracing (torch.cond's branches, make_fx), not running the model;
    graphamp's eager policy leaves traced calls alone. Checked on torch 2.13 (2.11: not yet run); pinned by
    tests/test_eager_policy.py (test_auto_cast_decides_like_the_cast_pass[regions])."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


@torch._dynamo.assume_constant_result
def dynamo_traces_this_thread() -> bool:
    """Whether this thread is tracing (dynamo, torch.export), asked where torch.compiler.is_compiling() says True:
    that flag is process-wide, True in every thread while any one compiles. Dynamo takes the result as a constant,
    so a function that asks it traces to nothing. Checked on torch 2.13 (2.11: not yet run); pinned by
    tests/test_eager_policy.py (test_calls_while_another_thread_compiles_run_low)."""
    return TracingContext.try_get() is not None


def never_a_frame_of_its_own(function):
    """Tell dynamo never to compile `function`'s frame, nor the frames it calls, when it runs eagerly inside a
    compiled call (code between two graphs calls it); dynamo still inlines it where it traces a call to it. The
    eager policy's __torch_function__ runs on every torch call there: compiled, it and its helpers would make a
    graph each (its code's exec strategy: SKIP for it and for what it calls). Checked on torch 2.13 (2.11: not yet
    run); pinned by tests/test_dynamic_shapes.py (test_dynamic_true_serves_every_batch_and_length_from_one_graph)."""
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(function.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return function
