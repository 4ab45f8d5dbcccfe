"""A TorchDispatchMode that records the dtypes each ATen kernel actually executes with.

Used by the tests (do decisions match what runs?), by export's report (casts vs torch.autocast) and by the
benchmarks (casts executed per step). Recording runs every kernel through Python: measure speed without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphamp.torch_private import TorchDispatchMode, op_schema, pytree

from graphamp.frontends.low_storage import upcasts_of

__all__ = ["DtypeRecorder", "KernelCall", "floating", "recording_inside"]


@dataclass
class KernelCall:
    op: str  # packet name, e.g. "addmm", "native_layer_norm", "_to_copy"
    in_dtypes: tuple
    out_dtypes: tuple


class DtypeRecorder(TorchDispatchMode):
    """`with DtypeRecorder() as rec: model(x).backward()` then ask `rec.calls_of("addmm")`."""

    def __init__(self):
        super().__init__()
        self.calls: list[KernelCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for stored in upcasts_of(func, args, kwargs or {}):  # a LowStorageTensor read: its upcast runs below here
            self.calls.append(KernelCall("_to_copy", (stored,), (torch.float32,)))
        out = func(*args, **(kwargs or {}))
        self.calls.append(KernelCall(
            op_schema(func).name.removeprefix("aten::"),
            tuple(t.dtype for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
            tuple(t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)),
        ))
        return out

    def calls_of(self, *ops: str) -> list[KernelCall]:
        return [c for c in self.calls if c.op in ops]

    @property
    def casts(self) -> int:
        """Dtype conversions executed: autocast's and graphamp's `_to_copy`, and copies between dtypes (`copy_`,
        `_foreach_copy_`: a destination and a source of different dtypes)."""
        return sum(_conversions(c) for c in self.calls)


def _conversions(call: KernelCall) -> int:
    if call.op == "_to_copy":
        return int(call.in_dtypes[:1] != call.out_dtypes[:1])
    if call.op in ("copy_", "_foreach_copy_"):  # (destinations..., sources...), as many of each
        half = len(call.in_dtypes) // 2
        return sum(d != s for d, s in zip(call.in_dtypes[:half], call.in_dtypes[half:2 * half]))
    return 0


def recording_inside(compiler_fn, recorder: DtypeRecorder):
    """A torch.compile backend that runs `compiler_fn`'s graphs under `recorder`.

    Dynamo runs a frame eagerly while a dispatch mode is active around the call, so to see what a compiled
    model's graphs execute, the recorder must go inside each graph's run. Use it with a backend that runs fx
    code (graphamp.backend(..., inductor=False)): inductor's kernels do not dispatch.
    """
    def compiler(gm, example_inputs):
        run = compiler_fn(gm, example_inputs)

        def recorded(*args):
            with recorder:
                return run(*args)
        return recorded
    return compiler


@torch.ops.higher_order.cond.py_impl(DtypeRecorder)
def _cond_under_recorder(mode, pred, true_fn, false_fn, operands):
    """torch.cond under the recorder: run the taken branch eagerly, so its kernels are recorded too."""
    with mode:
        return (true_fn if bool(pred) else false_fn)(*operands)


def floating(dtypes) -> set:
    return {d for d in dtypes if d.is_floating_point}
