"""What to put on which list, from what the probe measured: fixes for the first inf/NaN (each verified by a
rerun), FP32 candidates for ops badly conditioned in the low dtype (kept where a rerun at least halves the loss
error), and white candidates among the black ops whose values fit it. docs/doctor.md ("What it suggests") gives
the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from graphamp.policy.dtypes import dtype_name
from graphamp.policy.lists import BLACK, WHITE, AutoMixedPrecisionLists
from graphamp.diagnosis.numerics import unit_roundoff
from graphamp.diagnosis.probe import Comparison, NodeNumerics, Probe, Reference, by_list_entry

__all__ = [
    "MAX_FIX_ROUNDS", "ROUNDINGS_ALLOWED", "Suggestion", "UNDERFLOW_ALLOWED", "accuracy_and_speed",
    "fixes_for_nonfinite", "lists_with", "measured_on_the_loss",
]

BLACK_OP, BLACK_MODULE, WHITE_OP = "black_op", "black_module", "white_op"
MAX_FIX_ROUNDS = 8
# A low-precision op whose own error exceeds this many unit roundoffs of its dtype is badly conditioned there.
ROUNDINGS_ALLOWED = 8
# Values that flush to zero in the low dtype: a black op with more than this share stays black.
UNDERFLOW_ALLOWED = 1e-3


@dataclass(frozen=True)
class Suggestion:
    kind: str  # black_op, black_module or white_op
    target: str  # the list entry ('mul', 'mul.Tensor') or the module path
    text: str  # what to do, with the measurement that says why
    reason: str  # the measurement alone, for a list file's comment
    verified: bool = False  # rerun with it applied: the inf/NaN is gone

    def as_dict(self) -> dict:
        return {"kind": self.kind, "target": self.target, "text": self.text, "verified": self.verified}


def lists_with(amp_lists: AutoMixedPrecisionLists, suggestions) -> AutoMixedPrecisionLists:
    """`amp_lists` with the suggestions applied as custom lists."""
    by_kind = {kind: [s.target for s in suggestions if s.kind == kind] for kind in (BLACK_OP, BLACK_MODULE, WHITE_OP)}
    return amp_lists.with_changes(white=by_kind[WHITE_OP], black=by_kind[BLACK_OP], black_modules=by_kind[BLACK_MODULE])


def fixes_for_nonfinite(
    probe: Probe, amp_lists: AutoMixedPrecisionLists, reference: Reference, comparison: Comparison
) -> list[Suggestion]:
    """Fixes that make the rewritten run finite, forward and backward, each found on the run before it."""
    found: list[Suggestion] = []
    for _ in range(MAX_FIX_ROUNDS):
        culprit = comparison.first_nonfinite or comparison.first_nonfinite_grad
        if culprit is None:
            return [replace(s, verified=True) for s in found]
        fix = _fix_for(culprit, comparison, amp_lists.dtype, forward=comparison.first_nonfinite is not None)
        if fix is None or any(s.kind == fix.kind and s.target == fix.target for s in found):
            break  # no new fix to try: what was found is reported, unverified
        found.append(fix)
        comparison = probe.compare(lists_with(amp_lists, found), reference)
    return found


def accuracy_and_speed(nodes: list[NodeNumerics], dtype: torch.dtype, taken: set[str]) -> list[Suggestion]:
    """FP32 candidates for ops badly conditioned in `dtype`; white candidates among the black ops that fit it."""
    limit = ROUNDINGS_ALLOWED * unit_roundoff(dtype)
    low = dtype_name(dtype)
    suggestions = []
    for entry, records in sorted(by_list_entry(nodes).items()):
        if entry in taken:
            continue
        running_low = [r for r in records if r.runs_in == low and r.local_error is not None]
        worst = max(running_low, key=lambda r: r.local_error, default=None)
        if worst is not None and worst.local_error > limit:
            why = f"its own error in {low} is {worst.local_error:.3g} > {limit:.3g} at {_where(worst)}"
            candidate = _keep_fp32(worst, low, why)
            if candidate.target not in taken:  # two GEMM entries (linear, addmm) may name one module
                taken.add(candidate.target)
                suggestions.append(candidate)
        if all(r.decision == BLACK for r in records) and _fits(records, limit):
            errors = [r.low_error for r in records]
            reason = f"measured error in {low} at most {max(errors):.3g} over {len(records)} node(s), values fit {low}"
            suggestions.append(Suggestion(WHITE_OP, entry, f"move `{entry}` from black to white ({reason})", reason))
    return suggestions


def _fix_for(culprit: NodeNumerics, comparison: Comparison, dtype: torch.dtype, forward: bool) -> Suggestion | None:
    """The list edit that keeps the op behind `culprit`'s inf/NaN in FP32."""
    low = dtype_name(dtype)
    if culprit.runs_in != low:  # an FP32 op fed a value rounded to zero (or to inf) by a low-precision producer
        by_name = {r.name: r for r in comparison.nodes}
        producers = [by_name[n] for n in culprit.inputs if n in by_name and by_name[n].runs_in == low]
        if not producers:
            return None
        culprit = max(producers, key=lambda r: (r.underflow, r.overflow, r.error or 0.0))
    limit = torch.finfo(dtype).max
    if not forward:
        why = f"its gradient overflows {low} at {_where(culprit)}"
    elif culprit.max_abs is not None and culprit.max_abs > limit:
        why = f"max |x| {culprit.max_abs:.3g} > {low} max {limit:.3g} at {_where(culprit)}"
    elif culprit.underflow > 0:
        why = f"{culprit.underflow:.1%} of its values flush to zero in {low} at {_where(culprit)}"
    else:
        why = f"it gives inf/NaN in {low} where FP32 is finite, at {_where(culprit)}"
    return _keep_fp32(culprit, low, why)


def measured_on_the_loss(
    probe: Probe, amp_lists: AutoMixedPrecisionLists, reference: Reference, fixes: list[Suggestion],
    candidates: list[Suggestion],
) -> list[Suggestion]:
    """Each candidate rerun on top of the fixes, its text saying the loss error before → after; a candidate
    for FP32 is kept, verified, only where that error at least halves."""
    before = probe.output_error(lists_with(amp_lists, fixes), reference)
    what = "loss error" if reference.loss is not None else "output error"
    measured = []
    for candidate in candidates:
        after = probe.output_error(lists_with(amp_lists, [*fixes, candidate]), reference)
        text = f"{candidate.text}; {what} {before:.3g} → {after:.3g}"
        if candidate.kind == WHITE_OP:
            measured.append(replace(candidate, text=text))
        elif after < before / 2:
            measured.append(replace(candidate, text=text, verified=True))
    return measured


def _keep_fp32(record: NodeNumerics, low: str, why: str) -> Suggestion:
    """A white op (a GEMM) keeps its module FP32: listing the op black would slow every GEMM of the model."""
    if record.decision == WHITE and record.module:
        return Suggestion(BLACK_MODULE, record.module, f"module `{record.module}` → custom_black_modules ({why})", why)
    return Suggestion(BLACK_OP, record.entry, f"add `{record.entry}` to black.txt under [{low}] ({why})", why)


def _fits(records: list[NodeNumerics], limit: float) -> bool:
    return all(
        r.low_error is not None and r.low_error <= limit and r.overflow == 0 and r.underflow <= UNDERFLOW_ALLOWED
        and not r.nonfinite
        for r in records
    )


def _where(record: NodeNumerics) -> str:
    return f"{record.module} ({record.name})" if record.module else record.name
