"""Dynamic dims for export_program(dynamic=True): which input dims torch.export keeps symbolic, sizes from 1 up.

Dynamo's `maybe_mark_dynamic` markers, traced size-oblivious; why a batch of 1 still gets eager's result:
docs/shapes_and_generation.md, "Shapes in export_program(dynamic=True)".
"""

from __future__ import annotations

import contextlib

import torch
from torch.fx.experimental.symbolic_shapes import constrain_range

from graphamp.torch_private import DYNAMIC_DIM_MARKERS, mark_dim_dynamic, pytree, size_oblivious_tracing

__all__ = ["automatic_dynamic_dims", "sizes_from_one"]


@contextlib.contextmanager
def automatic_dynamic_dims(tree):
    """Mark every dim of size 2 or more of every tensor in `tree` dynamic for the capture made inside the block.

    The block traces size-oblivious, so a symbolic size is not specialized when the model's graph meets a 1;
    call `sizes_from_one` on the captured graph to keep its symbolic sizes from 1 up. The markers are taken off
    the caller's tensors afterwards.
    """
    tensors = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() > 0]
    saved = [{name: t.__dict__[name] for name in DYNAMIC_DIM_MARKERS if name in t.__dict__} for t in tensors]
    for tensor in tensors:
        for dim, size in enumerate(tensor.shape):
            # A dim of 0 or 1 stays static: traced size-oblivious, a 1 would not broadcast, and a 0 tells nothing.
            if size > 1:
                mark_dim_dynamic(tensor, dim)
    try:
        with size_oblivious_tracing():
            yield
    finally:
        for tensor, markers in zip(tensors, saved):
            for name in DYNAMIC_DIM_MARKERS:  # left on a tensor, they fail compiled guards
                tensor.__dict__.pop(name, None)
            tensor.__dict__.update(markers)


def sizes_from_one(graph_module: torch.fx.GraphModule) -> None:
    """Narrow the symbolic sizes of the captured graph's inputs to 1 and up in their shape environment
    (size-oblivious tracing left them from 0)."""
    for node in graph_module.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for size in value.shape:
            if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
                constrain_range(size, min=1)
