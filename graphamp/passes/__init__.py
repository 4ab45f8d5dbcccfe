"""The passes both front ends run on a pre-autograd ATen graph, in order, from one visible list.

Every pass edits the graph in place and keeps these true (inductor's fx_passes keep the like):
- `node.meta["val"]` (shapes and dtypes after the casts) of every node, and `node.meta["graphamp"]`, each op's
  OpMark (decision, source, module; read with marks.mark_of);
- the placeholders, and the number and order of the outputs; each output's traced dtype, except where the front
  end asks for low outputs (insert_casts' outputs_stay_low: it presents them as float32 itself);
- aliasing: no pass makes inputs or outputs alias that did not in the trace, and outputs that aliased each other or
  an input in the trace still do (AOTAutograd regenerates such views: the graph must say them);
- a pass removes only nodes it made dead, never a node with side effects another construct needs (vmap's nesting).
The cast pass comes first: the passes after it see the dtypes it chose. `rewrite()`/`graphamp.backend()` run them
on each graph dynamo captures, `export_program()` on the whole program; the doctor's probe runs the cast pass alone
on its copy (it compares each traced node's value, which the later passes would replace).
"""

from __future__ import annotations

import logging
import time

from torch.fx import GraphModule
from torch.fx.passes.graph_transform_observer import GraphTransformObserver

from graphamp.passes.cast_pass import RewriteReport, insert_casts
from graphamp.passes.grouped_query_attention import attend_grouped_queries
from graphamp.policy.config import AmpConfig

__all__ = ["PASSES_AFTER_CASTS", "run_passes"]

# `logging.getLogger("graphamp.passes").setLevel(logging.DEBUG)` (or basicConfig at DEBUG) logs each pass by name.
log = logging.getLogger(__name__)

# (name, pass) after the cast pass: each takes the graph module and edits it in place.
PASSES_AFTER_CASTS = (("grouped_query_attention", attend_grouped_queries),)


def run_passes(
    graph_module: GraphModule, config: AmpConfig, parameters: frozenset[str] = frozenset(), timings: dict | None = None,
    outputs_stay_low: bool = False,
) -> RewriteReport:
    """The cast pass ("cast"), then PASSES_AFTER_CASTS, on `graph_module` in place; returns the cast pass's report.

    Each runs under torch.fx's GraphTransformObserver by its name, as inductor's passes do; how to watch or switch
    them off (never the cast pass): docs/how_it_works.md, "Watching them".

    Args:
        graph_module: the pre-autograd ATen graph, as traced in FP32.
        config: the lists and level.
        parameters: the placeholder names that are the model's parameters (the O2 rule reads them).
        timings: where to add each pass's seconds, as "pass <name>".
        outputs_stay_low: the cast pass leaves outputs it computed low as they are (see insert_casts).
    """
    started = time.perf_counter()
    # The cast pass is the policy, not an optimization: observed, but never skipped by inductor's disabled_passes
    # (a substring test: "REMOVE_BROADCAST" names "CAST") or its bisector, which would leave the graph FP32 silently.
    with GraphTransformObserver(graph_module, "cast", subsystem="graphamp"):
        report = insert_casts(graph_module, config, parameters, outputs_stay_low)
    _done(graph_module, "cast", started, timings, ran=True)
    for name, apply in PASSES_AFTER_CASTS:
        started = time.perf_counter()
        observer = GraphTransformObserver(graph_module, name, subsystem="graphamp")
        ran = observer.apply_gm_pass(lambda gm: apply(gm) or True)  # None: the observer skipped the pass
        _done(graph_module, name, started, timings, ran=bool(ran))
    return report


def _done(graph_module: GraphModule, name: str, started: float, timings: dict | None, ran: bool) -> None:
    seconds = time.perf_counter() - started
    if timings is not None:
        timings[f"pass {name}"] = seconds
    if ran:
        log.debug("graphamp pass %s: %.1f ms, %d nodes after it", name, 1e3 * seconds, len(graph_module.graph.nodes))
    else:
        log.debug("graphamp pass %s: disabled (TORCHINDUCTOR_DISABLED_PASSES or the bisector)", name)
