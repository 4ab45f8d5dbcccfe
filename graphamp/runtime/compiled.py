"""A rewritten graph handed to torch.compile (inductor), its compiles reported and timed.

Inductor compiles the forward graph on the first call (and again if a guard fails, say grad mode changes) and
the backward graph lazily, on the first backward. Both start inside torch, so they are seen through dynamo's
compile callbacks: a DYNAMO compile that starts while this graph is being called is ours, and so is a
LAZY_BACKWARD compile with one of our compile ids.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler

from graphamp.runtime.progress import Progress

__all__ = ["BACKWARD_PHASE", "FORWARD_PHASE", "CompiledGraph"]

FORWARD_PHASE = "compiling the forward graph with inductor"
BACKWARD_PHASE = "compiling the backward graph with inductor"

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
        mode: str | None = None,
    ):
        _install_callbacks()
        # A graph with symbolic sizes compiles once for all of them; a static one is specialized to its shapes.
        self.compiled = torch.compile(graph_module, dynamic=dynamic, mode=mode)
        self.progress = progress
        self.timings = timings

    def __call__(self, *args):
        outer = getattr(_calling, "graph", None)
        _calling.graph = self
        try:
            return self.compiled(*args)
        finally:
            _calling.graph = outer


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
