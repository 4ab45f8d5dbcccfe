"""autocast's promote rule at capture: mixed float16/bfloat16/float32 inputs of a promote op meet at the widest.

While capturing, this TorchFunctionMode does autocast's casts in Python, traced as the model's own `_to_copy`
casts, so that models written for autocast (`torch.cat([half, fp32])`) capture: docs/numerics.md, "autocast's
promote rule".
"""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode

from graphamp.torch_private import pytree

__all__ = ["PromoteMixedInputs"]

# Python names that reach an op of promote.txt under another name.
_ALIASES = {"grid_sample": "grid_sampler", "concat": "cat", "concatenate": "cat", "arctan2": "atan2"}


class PromoteMixedInputs(TorchFunctionMode):
    """Casts the floating tensor inputs of the ops named in `promote_ops` (ATen packet names) to the widest of
    their dtypes when they differ; an in-place op casts the others to its own tensor's dtype instead."""

    def __init__(self, promote_ops: frozenset[str]):
        super().__init__()
        self.promote_ops = promote_ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.endswith("__")
        packet = _ALIASES.get(name.rstrip("_"), name.rstrip("_"))
        if packet in self.promote_ops:
            floats = [t for t in pytree.tree_leaves((args, kwargs)) if _is_float_tensor(t)]
            if len({t.dtype for t in floats}) > 1:
                target = args[0].dtype if in_place and _is_float_tensor(args[0]) else _widest(floats)
                cast = lambda t: t.to(target) if _is_float_tensor(t) and t.dtype != target else t  # noqa: E731
                if in_place:
                    args = (args[0], *pytree.tree_map(cast, args[1:]))
                    kwargs = pytree.tree_map(cast, kwargs)
                else:
                    args, kwargs = pytree.tree_map(cast, (args, kwargs))
        return func(*args, **kwargs)


def _is_float_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _widest(tensors) -> torch.dtype:
    return functools.reduce(torch.promote_types, (tensor.dtype for tensor in tensors))
