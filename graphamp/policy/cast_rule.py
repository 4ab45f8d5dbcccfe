"""The lists' rule, written once: which dtype an op's floating inputs are cast to, given its decision.

The cast pass applies it to graph nodes, the eager policy (graphamp.auto_cast) to torch calls as they run.
"""

from __future__ import annotations

import torch

from graphamp.policy.lists import BLACK, GRAY, WHITE, Decision

__all__ = ["cannot_run_fix", "cast_target", "decides_dtype"]

_FOLLOWS_INPUTS = (GRAY, Decision.UNLISTED)


def cast_target(decision: str, level: str, low: torch.dtype, deciding: list[torch.dtype]) -> torch.dtype | None:
    """The dtype the op's floating inputs are cast to, or None when they are left as they are.

    Args:
        decision: the op's Decision (white, black, gray, unlisted; any other leaves the inputs alone).
        level: "O1" or "O2" (O2 runs gray and unlisted ops low too).
        low: the lists' low-precision dtype.
        deciding: the dtypes of the floating inputs that decide a gray op (those `decides_dtype` accepts, unless
            it has no other).
    """
    if decision == WHITE or (level == "O2" and decision in _FOLLOWS_INPUTS):
        return low
    if decision == BLACK:
        return torch.float32
    if decision in _FOLLOWS_INPUTS and deciding:
        # Paddle's gray rule: low when every floating input is low, else float32.
        return low if deciding.count(low) == len(deciding) else torch.float32
    return None


def decides_dtype(value: torch.Tensor) -> bool:
    """Whether a floating input has a say in its gray op's dtype: not a 0-dim tensor (as in torch's type promotion),
    nor one with no elements, which holds no values to keep in FP32. HF's KV cache starts as
    `torch.tensor([], dtype=keys.dtype)`: an FP32 trace freezes that dtype as float32, and its `cat` with the low
    keys would promote the whole cache."""
    if value.dim() == 0:
        return False
    numel = value.numel()  # asked only past the 0-dim test: auto_cast asks this of every gray op's inputs
    return not (isinstance(numel, int) and numel == 0)  # a symbolic size may be anything


def cannot_run_fix(entry: str, decision: str | None, source: str) -> str:
    """The fix for an op whose kernel refuses the low dtype its inputs got: keep it FP32, on the black list. A white op
    runs low by its own entry (`source`); a gray or unlisted one because its inputs came low."""
    if source.startswith("custom_"):
        also = f"and take it out of {source}"  # an op in two custom lists is an error
    elif decision == WHITE:
        also = f"or take it off {source or 'white.txt'}"
    else:
        also = f"or move it from {source} to black.txt" if decision == GRAY and source else "or add it to black.txt"
    return f"keep it FP32 with custom_black_list=['{entry}'] ({also})"
