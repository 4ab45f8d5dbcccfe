"""A rewritten graph handed to torch.compile (inductor), its compiles reported and timed.

Inductor compiles the forward graph on the first call (and again if a guard fails, say grad mode changes) and
the backward graph lazily, on the first backward. Both start inside torch, so they are seen through dynamo's
compile callbacks: a DYNAMO compile that starts while this graph is being called is ours, and so is a
LAZY_BACKWARD compile with one of our compile ids.

What is compiled is the graph less its casts of outputs up to float32 (fp32_outputs), which run after it
(`casts_up_outside`), and less the loss that reads outputs, compiled apart (`loss_apart`).
"""

from __future__ import annotations

import copy
import functools
import operator
import threading
import weakref

import torch
from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler
from torch._ops import OpOverload
from torch.fx.passes.split_module import split_module

from graphamp.aten_ops import aliased_inputs
from graphamp.lists import Decision
from graphamp.runtime.deferred_upcast import deferred_upcast
from graphamp.runtime.progress import Progress
from graphamp.runtime.recycled_outputs import RecycledOutputs

__all__ = [
    "BACKWARD_PHASE", "DEFERRED_CAST_MIN_BYTES", "FORWARD_PHASE", "CompiledGraph", "casts_up_outside", "loss_apart"
]

FORWARD_PHASE = "compiling the forward graph with inductor"
BACKWARD_PHASE = "compiling the backward graph with inductor"

# Below this the cast costs less than deferring it (a wrapper, then a swap on the first read) and saves no memory
# worth it; the logits of a language model are tens of MiB.
DEFERRED_CAST_MIN_BYTES = 2**20

_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that record CUDA graphs

_calling = threading.local()  # .graph: the CompiledGraph whose call is running on this thread
_graph_of_compile_id: weakref.WeakValueDictionary[str, CompiledGraph] = weakref.WeakValueDictionary()
_running_phases: dict[str, object] = {}
_callbacks_installed = False


class CompiledGraph:
    """Calls `torch.compile(graph_module, mode=mode)`; `timings` accumulates the seconds of each compile phase.

    mode "reduce-overhead" records CUDA graphs on a GPU (inductor falls back to plain kernels on a CPU).
    """

    def __init__(
        self, graph_module: torch.fx.GraphModule, progress: Progress, timings: dict, dynamic: bool = False,
        mode: str | None = None, recycled: RecycledOutputs | None = None, defer_casts_up: bool = False,
    ):
        _install_callbacks()
        # defer_casts_up: the outputs go to the caller as they are (not to another graph), so a large one may be
        # cast when first read (graphamp.runtime.deferred_upcast), provided nothing can write its low value first:
        # not under CUDA graphs, whose next replay writes over the outputs of the last one.
        deferring = defer_casts_up and mode not in _CUDA_GRAPH_MODES
        self.deferrable = _fresh_outputs(graph_module) if deferring else set()
        graph_module, self.cast_up = casts_up_outside(graph_module)
        # Shared by an AmpModule's captures, so that each output's float32 storage is kept once, not per capture.
        self.recycled = recycled if recycled is not None else RecycledOutputs()
        pieces = loss_apart(graph_module)
        # A graph with symbolic sizes compiles once for all of them; a static one is specialized to its shapes.
        if pieces is None:
            self.compiled = torch.compile(graph_module, dynamic=dynamic, mode=mode)
        else:  # the split graph's own code only passes values between its two compiled pieces
            for name, piece in list(pieces.named_children()):
                setattr(pieces, name, torch.compile(piece, dynamic=dynamic, mode=mode))
            self.compiled = pieces
        self.progress = progress
        self.timings = timings

    def __call__(self, *args):
        outer = getattr(_calling, "graph", None)
        _calling.graph = self
        try:
            outputs = self.compiled(*args)
        finally:
            _calling.graph = outer
        if not self.cast_up:
            return outputs
        outputs = list(outputs)
        for i, dtype in self.cast_up:
            if self._defers(i, outputs[i], dtype):
                outputs[i] = deferred_upcast(outputs[i], dtype, functools.partial(self.recycled.cast, i, dtype=dtype))
            else:
                outputs[i] = self.recycled.cast(i, outputs[i], dtype)
        return outputs

    def _defers(self, index: int, value: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether the cast of this output waits for a read: a training call's output of 1 MiB or more."""
        return (
            index in self.deferrable and value.requires_grad and torch.is_grad_enabled()
            and not torch.is_inference_mode_enabled() and value.numel() * dtype.itemsize >= DEFERRED_CAST_MIN_BYTES
        )


def casts_up_outside(graph_module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list]:
    """A copy of `graph_module` returning the low-precision values its outputs were cast up from, and
    [(output index, dtype), ...] to cast them after the call; `graph_module` itself when it casts none up.

    Inside one compiled graph, an FP32 output also read by the loss (HF's logits) costs a float32 buffer saved for
    backward, and a float32 gradient of zeros that autograd makes for it when nothing uses it (the graph's outputs
    are one autograd node): batch x sequence x vocabulary float32 tensors that torch.autocast never makes. Cast
    outside, the loss still reads the in-graph cast (fused into its kernel), the graph saves the bfloat16 value,
    and an unused output's cast is never differentiated.
    """
    up = {i: _cast_up_dtype(node) for i, node in enumerate(_output_values(graph_module.graph))}
    up = {i: dtype for i, dtype in up.items() if dtype is not None}
    if not up:
        return graph_module, []
    graph_module = copy.deepcopy(graph_module)
    output = _output_of(graph_module.graph)
    flat = list(output.args[0])
    casts = {flat[i] for i in up}
    for i in up:
        flat[i] = flat[i].args[0]
    output.args = (type(output.args[0])(flat),)
    for cast in casts:
        if not cast.users:  # read by nothing else in the graph
            graph_module.graph.erase_node(cast)
    graph_module.graph.lint()
    graph_module.recompile()
    return graph_module, sorted(up.items())


def loss_apart(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """`graph_module` as two graphs called in turn, the second being the loss that reads some outputs' values (HF's
    loss reading the logits); None where no output is read by ops that could move (no matmul, no side effect).

    One compiled graph has one autograd node: an output nothing differentiates (the logits beside the loss) still
    gets a gradient of zeros as big as itself, added into the loss's gradient in the backward. Apart, the values
    are an input of the loss's graph, and their gradient is the loss's (torch.compile under autocast gets the same
    cut from a graph break at HF's loss).
    """
    graph = graph_module.graph
    flat = _output_values(graph)
    loss: set[torch.fx.Node] = set()
    for value in {node for node in flat if isinstance(node, torch.fx.Node) and node.op == "call_function"}:
        readers: set[torch.fx.Node] = set()
        for node in graph.nodes:  # in order: what reads the value, and what reads those
            if node.op != "output" and any(n is value or n in readers for n in node.all_input_nodes):
                readers.add(node)
        if readers and all(_movable_into_loss(node) for node in readers):
            loss |= readers
    if not loss:
        return None
    return split_module(graph_module, graph_module, lambda node: int(node in loss), keep_original_order=True)


def _movable_into_loss(node: torch.fx.Node) -> bool:
    """An op the loss's graph can run: no matmul or convolution (the low-precision ops), no side effect, no
    submodule (a checkpointed region)."""
    decision = (node.meta.get("graphamp") or {}).get("decision")
    return (
        node.op == "call_function" and (isinstance(node.target, OpOverload) or node.target is operator.getitem)
        and decision != Decision.WHITE and not node.is_impure()
    )


def _fresh_outputs(graph_module: torch.fx.GraphModule) -> set[int]:
    """The output positions cast up from a value the graph computes into storage of its own: not an input, a
    constant, or a view of one, which the caller could write into before a deferred cast reads it."""
    return {
        i for i, node in enumerate(_output_values(graph_module.graph))
        if _cast_up_dtype(node) is not None and _owns_storage(node.args[0])
    }


def _owns_storage(node: torch.fx.Node) -> bool:
    """Whether `node`'s value is storage the graph allocates, following views back to the value they view."""
    while True:
        if node.op == "call_function" and node.target is operator.getitem:
            node = node.args[0]  # an element of a multi-output op's result: as fresh as that op's outputs
        elif node.op == "call_function" and isinstance(node.target, OpOverload):
            aliased = aliased_inputs(node)
            if not aliased:
                return True
            if len(aliased) > 1:
                return False
            (node,) = aliased
        else:  # a placeholder, a constant, a checkpointed region's call
            return False


def _cast_up_dtype(node) -> torch.dtype | None:
    """The dtype of a plain cast (`_to_copy`, `to.dtype`) to a wider floating dtype (bfloat16 -> float32), else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target is torch.ops.aten._to_copy.default and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        dtype = node.kwargs["dtype"]
    elif node.target is torch.ops.aten.to.dtype and not node.kwargs and len(node.args) == 2:
        dtype = node.args[1]
    else:
        return None
    value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    wider = (
        isinstance(value, torch.Tensor) and value.dtype.is_floating_point and isinstance(dtype, torch.dtype)
        and dtype.is_floating_point and dtype.itemsize > value.dtype.itemsize
    )
    return dtype if wider else None


def _install_callbacks() -> None:
    global _callbacks_installed
    if not _callbacks_installed:
        callback_handler.register_start_callback(_on_compile_start)
        callback_handler.register_end_callback(_on_compile_end)
        _callbacks_installed = True


def _on_compile_start(args: CallbackArgs) -> None:
    if args.callback_trigger == CallbackTrigger.DYNAMO:
        graph = getattr(_calling, "graph", None)
        if graph is None:
            return  # someone else's torch.compile
        _graph_of_compile_id[args.compile_id] = graph
        what = FORWARD_PHASE
    elif args.callback_trigger == CallbackTrigger.LAZY_BACKWARD:
        graph = _graph_of_compile_id.get(args.compile_id)
        if graph is None:
            return
        what = BACKWARD_PHASE
    else:
        return
    _running_phases[args.compile_id] = (graph, what, graph.progress.start(what))


def _on_compile_end(args: CallbackArgs) -> None:
    running = _running_phases.pop(args.compile_id, None)
    if running is not None:
        graph, what, phase = running
        graph.timings[what] = graph.timings.get(what, 0.0) + phase.end()


def _output_values(graph: torch.fx.Graph) -> tuple | list:
    """The values the graph returns, in order; empty if it returns a single value not in a list."""
    output = _output_of(graph)
    return output.args[0] if isinstance(output.args[0], (list, tuple)) else ()


def _output_of(graph: torch.fx.Graph) -> torch.fx.Node:
    return next(iter(graph.find_nodes(op="output")))  # Graph.output_node() is marked not backward compatible
