"""Attention over repeated key/value heads, rewritten as SDPA's own grouped-query attention (`enable_gqa=True`).

Under torch.export transformers repeats each key/value head for its group of query heads (`repeat_kv`: a copy)
before SDPA; eager HF passes the unrepeated heads with `enable_gqa=True`, the same values. Only where a fused
kernel groups them and it pays (docs/performance.md, "Grouped-query attention stays grouped"); elsewhere the repeat
stays.
"""

from __future__ import annotations

import sys

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphamp.policy.aten_ops import RESHAPE_OPS

__all__ = ["attend_grouped_queries"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_CASTS = (torch.ops.aten._to_copy.default,)


def attend_grouped_queries(graph_module: torch.fx.GraphModule) -> None:
    """Edit `graph_module` in place: its SDPA calls on repeated key/value heads group them instead."""
    graph = graph_module.graph
    replaced = []
    for node in list(graph.nodes):
        grouped = _grouped_inputs(node)
        if grouped is None:
            continue
        key, value = (_unrepeated(graph, node, repeated) for repeated in grouped)
        node.args = (node.args[0], key, value, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        replaced.extend(reshape for _, _, reshape, _ in grouped)
    if replaced:
        _erase_unused(graph, replaced)
        graph.lint()
        graph_module.recompile()


def _erase_unused(graph: torch.fx.Graph, replaced: list[torch.fx.Node]) -> None:
    """Erase the replaced repeats that nothing reads now, and then what only they read. Not a whole-graph
    dead-code elimination: that would also take calls without users that must stay (vmap's
    `_vmap_increment_nesting`, `_vmap_decrement_nesting`), which this pass did not make dead."""
    pending, erased = list(replaced), set()
    while pending:
        node = pending.pop()
        if node in erased or node.op != "call_function" or node.users or node.is_impure():
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        pending.extend(inputs)


def _grouped_inputs(node: torch.fx.Node):
    """(key, value) repeat chains of an SDPA call that can group instead; None if it cannot."""
    if node.target is not _SDPA or node.kwargs.get("enable_gqa", False) or not 3 <= len(node.args) <= 7:
        return None
    query = node.args[0].meta.get("val")
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        return None
    on_cpu = query.device.type == "cpu"
    differentiated = getattr(node.meta.get("tensor_meta"), "requires_grad", True)  # make_fx's record; unknown: yes
    if (on_cpu and differentiated) or (mask is not None and not on_cpu):
        return None
    chains = [_repeat_chain(node.args[i]) for i in (1, 2)]
    if any(chain is None for chain in chains) or len({chain[3] for chain in chains}) != 1:
        return None
    source, _, _, group = chains[0]
    if not _equal(query.shape[1], source.meta["val"].shape[1] * group):
        return None
    return chains


def _equal(a, b) -> bool:
    """Sizes equal for every value their symbols can take (a generation graph's sequence length): no guard added."""
    return statically_known_true(a == b)


def _repeat_chain(node):
    """(source, cast or None, reshape, group) for `reshape([cast](expand(unsqueeze(source, 2))))`, as repeat_kv
    makes (batch, heads, sequence, head dim) of (batch, kv heads, sequence, head dim); None otherwise."""
    if not isinstance(node, torch.fx.Node) or node.target not in RESHAPE_OPS:
        return None
    reshape, inner = node, node.args[0]
    cast = None
    if isinstance(inner, torch.fx.Node) and inner.target in _CASTS and set(inner.kwargs) == {"dtype"}:
        cast, inner = inner, inner.args[0]
    if not isinstance(inner, torch.fx.Node) or inner.target is not torch.ops.aten.expand.default:
        return None
    unsqueeze = _through_whole_slices(inner.args[0])
    if not (
        isinstance(unsqueeze, torch.fx.Node) and unsqueeze.target is torch.ops.aten.unsqueeze.default
        and unsqueeze.args[1] == 2
    ):
        return None
    source = _through_whole_slices(unsqueeze.args[0])
    shapes = [n.meta.get("val") for n in (source, inner, reshape)]
    if not all(isinstance(s, torch.Tensor) for s in shapes):
        return None
    unrepeated, expanded, repeated = (tuple(s.shape) for s in shapes)
    if len(unrepeated) != 4 or len(expanded) != 5 or len(repeated) != 4 or not isinstance(expanded[2], int):
        return None
    batch, heads, sequence, head_dim = unrepeated
    group = expanded[2]
    matches = [
        *zip(expanded, (batch, heads, group, sequence, head_dim)),
        *zip(repeated, (batch, heads * group, sequence, head_dim)),
    ]
    if not all(_equal(size, wanted) for size, wanted in matches):
        return None
    return source, cast, reshape, group


def _through_whole_slices(node):
    """The tensor under `x[:, :, None]`'s slices that keep a whole dim (`slice(x, dim, 0, sys.maxsize)`), which a
    graph with symbolic sizes keeps; `node` itself if it is no such slice."""
    while (
        isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.slice.Tensor
        and tuple(node.args[2:]) in ((), (0,), (0, sys.maxsize), (0, sys.maxsize, 1)) and not node.kwargs
    ):
        node = node.args[0]
    return node


def _unrepeated(graph: torch.fx.Graph, attention: torch.fx.Node, chain) -> torch.fx.Node:
    """The unrepeated heads, cast as the repeated ones were."""
    source, cast, _, _ = chain
    if cast is None:
        return source
    with graph.inserting_before(attention):
        unrepeated = graph.call_function(cast.target, (source,), dict(cast.kwargs))
    unrepeated.meta = dict(cast.meta)
    unrepeated.meta["val"] = source.meta["val"].to(cast.kwargs["dtype"])
    return unrepeated
