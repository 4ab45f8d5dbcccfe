"""Values a captured graph computes from no input at all, computed once when the graph is made.

Under torch.export transformers takes its traceable paths: a decoder builds its causal mask from `arange`s and
comparisons on every call (about 45 ops in a Llama), where eager HF sees an unpadded batch and passes SDPA
`is_causal=True` instead. In a static graph such a value depends on nothing that can change between calls (no
input, parameter or buffer, no random op, no symbolic size), so it is computed here once and the graph reads it
as a constant. On a tiny model a call is its ops' dispatch, and those ops were 4% of a train step.

torch.fx.experimental.const_fold does the splitting, but it counts `get_attr` values as constants, folds lazily on
the first call onto a fixed device, and knows nothing of writes through aliases; the few rules here are the ones
a rewritten training graph needs.
"""

from __future__ import annotations

import torch
from torch._ops import OpOverload

from graphamp.aten_ops import aliased_inputs, draws_random_numbers, written_inputs

__all__ = ["compute_input_free_values"]

# A value kept for the graph's lifetime: a mask or a table of positions, never an activation-sized tensor.
MAX_KEPT_BYTES = 1 << 20


def compute_input_free_values(graph_module: torch.fx.GraphModule) -> None:
    """Edit `graph_module` in place: it reads its input-free values as constants (buffers) it computes now."""
    free = _input_free_nodes(graph_module.graph)
    kept = [node for node in free if _worth_keeping(node, set(free))]
    if not kept:
        return
    values = _evaluate(free)
    graph = graph_module.graph
    for index, node in enumerate(kept):
        name = f"_input_free_{index}"
        graph_module.register_buffer(name, values[node], persistent=False)
        with graph.inserting_before(node):
            constant = graph.get_attr(name)
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
    graph.eliminate_dead_code()
    graph.lint()
    graph_module.recompile()


def _input_free_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """In order: ATen ops with no random or in-place effect whose inputs are all input-free themselves."""
    free: set[torch.fx.Node] = set()
    ordered = []
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        if (
            node.is_impure() or node.target._schema.is_mutable or draws_random_numbers(node)
            or not all(n in free for n in node.all_input_nodes) or not _static_tensor(node.meta.get("val"))
        ):
            continue
        free.add(node)
        ordered.append(node)
    return ordered


def _worth_keeping(node: torch.fx.Node, free: set[torch.fx.Node]) -> bool:
    """A boundary of the input-free part (an op that reads inputs reads it), small, and safe to share between
    calls: nothing writes into it or returns it, directly or through a view."""
    return (
        any(user not in free for user in node.users) and node.meta["val"].untyped_storage().nbytes() <= MAX_KEPT_BYTES
        and not _escapes(node)
    )


def _escapes(value: torch.fx.Node) -> bool:
    """Whether a reader of `value` returns it from the graph, writes into it, is not an ATen op (its effects unknown),
    or makes a view of it that escapes in turn."""
    for reader in value.users:
        if reader.op == "output" or not isinstance(reader.target, OpOverload):
            return True
        if value in written_inputs(reader) or value in aliased_inputs(reader) and _escapes(reader):
            return True
    return False


def _evaluate(free: list[torch.fx.Node]) -> dict[torch.fx.Node, torch.Tensor]:
    """Run the input-free ops once, in order: they read nothing but each other and literals."""
    values: dict[torch.fx.Node, torch.Tensor] = {}
    # Ordinary tensors even when the capture runs under inference_mode: the graph serves training calls too.
    with torch.inference_mode(False), torch.no_grad():
        for node in free:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
            values[node] = node.target(*args, **kwargs)
    return values


def _static_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and not any(
        isinstance(size, torch.SymInt) for size in (*value.shape, *value.stride())
    )
