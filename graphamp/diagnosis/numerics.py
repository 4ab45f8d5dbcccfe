"""How far a low-precision value is from its FP32 reference, and how its range fits a low dtype.

Every figure is computed in float64 over the floating tensors of a value (a tensor, or a tuple of them for
multi-output ops), and only where the FP32 reference is finite: masks filled with -inf are the model's own.
"""

from __future__ import annotations

import math

import torch

from graphamp.torch_private import pytree

__all__ = ["floating_leaves", "nonfinite_where_finite", "range_in", "ranked", "relative_error", "unit_roundoff"]


def floating_leaves(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def relative_error(value, reference) -> float | None:
    """||value - reference|| / ||reference|| over the reference's finite entries; inf where value is not finite.

    None when the two have no floating tensors of the same shapes to compare.
    """
    pairs = [(a, b) for a, b in zip(floating_leaves(value), floating_leaves(reference)) if a.shape == b.shape]
    if not pairs:
        return None
    difference = norm = 0.0
    for a, b in pairs:
        a, b = a.detach().double(), b.detach().double()
        finite = b.isfinite()
        if not bool(finite.all()):
            a, b = a[finite], b[finite]
        if not bool(a.isfinite().all()):
            return math.inf
        difference += float((a - b).square().sum())
        norm += float(b.square().sum())
    if norm == 0.0:
        return 0.0 if difference == 0.0 else math.inf
    return math.sqrt(difference / norm)


def nonfinite_where_finite(value, reference) -> bool:
    """Whether `value` holds inf/NaN where the FP32 `reference` is finite: an overflow of the low precision."""
    return any(
        bool((~a.isfinite() & b.isfinite()).any())
        for a, b in zip(floating_leaves(value), floating_leaves(reference))
        if a.shape == b.shape
    )


def range_in(reference, dtype: torch.dtype) -> tuple[float | None, float, float]:
    """(max |x| over finite entries, fraction that overflows in `dtype`, fraction that flushes to zero in it)."""
    leaves = [t.detach() for t in floating_leaves(reference)]
    count = sum(t.numel() for t in leaves)
    if count == 0:
        return None, 0.0, 0.0
    max_abs, overflow, underflow = 0.0, 0, 0
    for t in leaves:
        finite = t.isfinite()
        if bool(finite.any()):
            max_abs = max(max_abs, float(t[finite].abs().max()))
        low = t.to(dtype)
        overflow += int((finite & low.isinf()).sum())
        underflow += int(((t != 0) & (low == 0)).sum())
    return max_abs, overflow / count, underflow / count


def worst(a: float | None, b: float | None) -> float | None:
    """The worse of two figures of one measure: NaN above any number, None (not measured) below."""
    if a is None or b is None:
        return b if a is None else a
    return a if math.isnan(a) else b if math.isnan(b) else max(a, b)


def ranked(value: float | None) -> float:
    """A figure for ranking the worst first: None (not measured) as -1 and NaN as inf."""
    if value is None:
        return -1.0
    return math.inf if math.isnan(value) else value


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number: 2**-11 for float16, 2**-8 for bfloat16."""
    return torch.finfo(dtype).eps / 2
