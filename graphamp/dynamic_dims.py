"""Dynamic dims for a capture: which input dims torch.export keeps symbolic.

torch.export reads dynamo's `maybe_mark_dynamic` markers (as it reads `Dim.AUTO`, whose dynamic_shapes spec
cannot name a forward's **kwargs): a dim stays symbolic where the model allows and is specialized where its
code requires a size (a weight's width, a size of 0 or 1); graphamp.runtime.shapes.specialized_dims reports
those.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

__all__ = ["automatic_dynamic_dims"]

# Where torch._dynamo.maybe_mark_dynamic records a tensor's dims (left on a tensor, they fail compiled guards).
_MARKERS = ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking")


@contextlib.contextmanager
def automatic_dynamic_dims(tree):
    """Mark every dim of every tensor in `tree` dynamic for the capture made inside the block.

    The markers are taken off the caller's tensors afterwards.
    """
    tensors = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() > 0]
    saved = [{name: t.__dict__[name] for name in _MARKERS if name in t.__dict__} for t in tensors]
    for tensor in tensors:
        for dim in range(tensor.dim()):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    try:
        yield
    finally:
        for tensor, markers in zip(tensors, saved):
            for name in _MARKERS:
                tensor.__dict__.pop(name, None)
            tensor.__dict__.update(markers)
