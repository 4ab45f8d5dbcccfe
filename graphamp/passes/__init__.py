"""The passes both front ends run on a pre-autograd ATen graph, in order, from one visible list.

Every pass edits the graph in place and keeps what the next one reads true: `node.meta["val"]` (shapes and
dtypes after the casts), `node.meta["graphamp"]` (each op's decision and its source), the placeholders and the
number and order of the outputs. The cast pass comes first: the passes after it see the dtypes it chose.
`rewrite()`/`graphamp.backend()` run them on each graph dynamo captures, `export_program()` on the whole
program, the doctor's probe on its copy.
"""

from __future__ import annotations

from torch.fx import GraphModule

from graphamp.passes.cast_pass import RewriteReport, insert_casts
from graphamp.passes.grouped_query_attention import attend_grouped_queries
from graphamp.policy.config import AmpConfig

__all__ = ["PASSES_AFTER_CASTS", "run_passes"]

# (name, pass): each takes the graph module and edits it in place.
PASSES_AFTER_CASTS = (("grouped_query_attention", attend_grouped_queries),)


def run_passes(graph_module: GraphModule, config: AmpConfig, parameters: frozenset[str] = frozenset()) -> RewriteReport:
    """The cast pass, then PASSES_AFTER_CASTS, on `graph_module` in place; returns the cast pass's report.

    Args:
        graph_module: the pre-autograd ATen graph, as traced in FP32.
        config: the lists and level.
        parameters: the placeholder names that are the model's parameters (the O2 rule reads them).
    """
    report = insert_casts(graph_module, config, parameters)
    for _name, apply in PASSES_AFTER_CASTS:
        apply(graph_module)
    return report
