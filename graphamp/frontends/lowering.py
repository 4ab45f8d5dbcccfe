"""Dynamo's torch-level graph lowered to pre-autograd ATen, the IR the cast pass reads (torch.export's training IR).

`make_fx(pre_dispatch=True)` in dynamo's fake mode; what make_fx alone would lose (custom autograd Functions,
functorch transforms, autocast regions, checkpoints) is kept: docs/how_it_works.md, "Lowering".
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.fx.traceback as fx_traceback
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from graphamp.errors import CaptureError
from graphamp.frontends.device_moves import move_without_a_dtype
from graphamp.frontends.low_storage import LowStorageTensor, example_of_storage
from graphamp.passes.cast_pass import INPUT_UPCAST
from graphamp.torch_private import (
    DATA_ATTR, ENTER_AUTOCAST, FakeTensor, FakeTensorMode, default_checkpoint_context_fn, detect_fake_mode, pytree,
    recording_functorch_transforms, register_sub_graph, trace_inside_make_fx, tracing_context, wrap_autocast_regions,
)

__all__ = ["to_aten"]

_AUTOGRAD_FUNCTION = torch.ops.higher_order.autograd_function_apply


def to_aten(gm: GraphModule, example_inputs: list, index: int = 0) -> tuple[GraphModule, list]:
    """Dynamo's graph `gm` as a pre-autograd ATen graph with the same flat inputs and outputs, and the fake inputs
    it was traced on. An input that is a LowStorageTensor (another graph's low output) becomes its low storage,
    upcast where the graph starts (the cast pass takes that upcast for one of its own casts)."""
    fake_mode, fake_inputs = _fake_inputs(gm, example_inputs)
    _give_checkpoints_their_policy(gm)
    low = [i for i, value in enumerate(example_inputs) if isinstance(value, LowStorageTensor)]

    def run(*args):
        args = list(args)
        for i in low:
            args[i] = torch.ops.aten._to_copy.default(args[i], dtype=torch.float32)
        with fx_traceback.preserve_node_meta():  # each new node takes the meta of the dynamo node it came from
            return _Lowering(gm).run(*args)

    allowed = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True  # tensors the graph holds as attributes (get_attr) become constants
    try:
        recording = recording_functorch_transforms() if _transforms_functions(gm) else contextlib.nullcontext()
        with fake_mode, recording:
            aten_graph = make_fx(run, pre_dispatch=True)(*fake_inputs)
    except Exception as error:
        raise CaptureError(
            f"graphamp could not lower graph #{index} that dynamo captured to ATen ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}). Fix: run that part outside "
            f"torch.compile (torch.compiler.disable), or graphamp.export_program() the model to see the construct."
        ) from error
    finally:
        fake_mode.allow_non_fake_inputs = allowed
    placeholders = aten_graph.graph.find_nodes(op="placeholder")
    for i in low:
        upcast = next(u for u in placeholders[i].users if u.target is torch.ops.aten._to_copy.default)
        upcast.meta[INPUT_UPCAST] = True
    return _autocast_regions_as_higher_order_ops(aten_graph), fake_inputs


class _Lowering(torch.fx.Interpreter):
    """Runs dynamo's graph node by node under make_fx; a custom autograd.Function is traced as one node, and a
    `.to()` that names no dtype as a move that keeps its dtype open (device_moves.py)."""

    def call_function(self, target, args, kwargs):
        if target is _AUTOGRAD_FUNCTION:
            return _trace_autograd_function(*args, **kwargs)
        if target is DATA_ATTR:
            return _trace_data_attr(*args)
        return super().call_function(target, args, kwargs)

    def call_method(self, target, args, kwargs):
        if target in ("to", "cpu", "cuda") and (moved := move_without_a_dtype(target, args, kwargs)) is not None:
            return moved
        return super().call_method(target, args, kwargs)


def _trace_autograd_function(forward: GraphModule, backward: GraphModule, *args, **kwargs):
    """`autograd_function_apply(forward, backward, *args)` recorded as that one node, its bodies lowered to ATen.

    make_fx would run the Function's forward (traced by dynamo under no_grad) op by op and its outputs would
    carry no gradient back: every parameter before it would get none.
    """
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, track_tensor_tree

    mode = get_proxy_mode()
    forward_aten = trace_inside_make_fx(_interpreted(forward))(*args)
    with disable_proxy_modes_tracing():
        outputs, saved = _interpreted(forward_aten)(*args)
        gradients = pytree.tree_map_only(torch.Tensor, torch.empty_like, outputs)
    backward_aten = trace_inside_make_fx(_interpreted(backward))(*pytree.tree_leaves(gradients), *saved)
    register_sub_graph(mode, "autograd_function_forward", forward_aten)
    register_sub_graph(mode, "autograd_function_backward", backward_aten)
    proxy_args = pytree.tree_map(mode.tracer.unwrap_proxy, (forward_aten, backward_aten, *args))
    proxy_kwargs = pytree.tree_map(mode.tracer.unwrap_proxy, kwargs)
    proxy = mode.tracer.create_proxy("call_function", _AUTOGRAD_FUNCTION, proxy_args, proxy_kwargs)
    with disable_proxy_modes_tracing():
        result = _AUTOGRAD_FUNCTION(forward_aten, backward_aten, *args, **kwargs)
    return track_tensor_tree(result, proxy, constant=None, tracer=mode.tracer)


def _trace_data_attr(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor.data` recorded as such: make_fx would make it a constant, and a write into it (a weight clipped, a
    buffer counted through `.data`) would change that copy, never the model's tensor."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, track_tensor_tree

    mode = get_proxy_mode()
    proxy = mode.tracer.create_proxy("call_function", DATA_ATTR, (mode.tracer.unwrap_proxy(tensor),), {})
    with disable_proxy_modes_tracing():
        result = DATA_ATTR(tensor)
    return track_tensor_tree(result, proxy, constant=None, tracer=mode.tracer)


def _transforms_functions(gm: GraphModule) -> bool:
    """Whether the graph calls functorch's transforms (a vmap): only then is the process-wide exporting flag raised,
    which every other thread sees while it is up."""
    return any(
        node.op == "call_function" and (getattr(node.target, "__module__", None) or "").startswith("torch._functorch")
        for module in gm.modules() if isinstance(module, GraphModule)
        for node in module.graph.nodes
    )


def _interpreted(graph_module: GraphModule):
    return lambda *args: torch.fx.Interpreter(graph_module).run(*args)


def _autocast_regions_as_higher_order_ops(aten_graph: GraphModule) -> GraphModule:
    """`with torch.autocast(..., enabled=False)` in the model traces as enter/exit calls; torch.export's own pass
    wraps each region in the wrap_with_autocast op, whose body the cast pass keeps as the model wrote it."""
    if not aten_graph.graph.find_nodes(op="call_function", target=ENTER_AUTOCAST):
        return aten_graph
    return wrap_autocast_regions(aten_graph)


def _give_checkpoints_their_policy(gm: GraphModule) -> None:
    """Tracing a checkpointed region (dynamo's tag_activation_checkpoint) to pre-autograd ATen reads the body's
    `_checkpoint_context_fn`, which dynamo sets only when the user passed a context_fn (torch 2.13): give plain
    checkpoints the policy torch itself gives them, recompute everything. Nested checkpoints too: a region's body
    holds the inner ones."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    checkpoint_op = torch.ops.higher_order.tag_activation_checkpoint
    for module in gm.modules():
        if not isinstance(module, GraphModule):
            continue
        for node in module.graph.find_nodes(op="call_function", target=checkpoint_op):
            body = getattr(module, node.args[0].target)
            default_checkpoint_context_fn(body, functools.partial(create_selective_checkpoint_contexts, _recompute_all))


def _recompute_all(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def _fake_inputs(gm: GraphModule, example_inputs: list):
    context = tracing_context()
    placeholders = gm.graph.find_nodes(op="placeholder")
    fake_mode = getattr(context, "fake_mode", None)
    if fake_mode is None:  # called outside dynamo (a test calling the backend on a GraphModule itself)
        fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(shape_env=ShapeEnv())
    symbolic = getattr(context, "tensor_to_context", {})

    def fake(value, node):
        if isinstance(value, FakeTensor):
            return value if value.fake_mode is fake_mode else fake_mode.from_tensor(value)
        if isinstance(value, torch.Tensor):
            # The symbolic context dynamo made for this very tensor: its dynamic dims map to the same symbols.
            symbolic_context = symbolic.get(value) if symbolic else None
            source = getattr(symbolic_context, "tensor_source", None)
            # A LowStorageTensor is faked whole (its storage's sizes are its own), then traced as that storage.
            return example_of_storage(fake_mode.from_tensor(value, symbolic_context=symbolic_context, source=source))
        traced = node.meta.get("example_value") if node is not None else None
        return traced if isinstance(value, int) and isinstance(traced, torch.SymInt) else value

    nodes = placeholders + [None] * (len(example_inputs) - len(placeholders))
    return fake_mode, [fake(value, node) for value, node in zip(example_inputs, nodes)]
