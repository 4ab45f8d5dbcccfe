"""auto_mixed_precision(): the most ops that can run low while the loss (or outputs) stays within a tolerance.

A binary search over the list entries, ordered by the doctor's measured cost of running each low, then a greedy
pass that tries each entry kept black low again; docs/doctor.md ("Automatic mode") describes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from graphamp.errors import ArgumentError
from graphamp.policy.config import check_entry_arguments
from graphamp.diagnosis.list_writer import write_lists
from graphamp.policy.dtypes import dtype_name
from graphamp.policy.lists import BLACK, WHITE, AutoMixedPrecisionLists
from graphamp.diagnosis.probe import NodeNumerics, Probe, by_list_entry
from graphamp.frontends.export_program import warn_of_bodies_without_module_paths

__all__ = ["AutoListsResult", "auto_mixed_precision"]


@dataclass
class AutoListsResult:
    """The lists found, what they measure, and how they differ from the lists the search started from."""

    amp_lists: AutoMixedPrecisionLists
    tolerance: float
    error: float  # the loss's (or outputs') relative error with amp_lists
    start_error: float  # ... with the lists the search started from
    moved_to_white: list[str]
    moved_to_black: list[str]
    low_nodes: int  # op nodes that run in the low dtype with amp_lists
    start_low_nodes: int
    op_nodes: int
    evaluations: int
    start_lists: AutoMixedPrecisionLists  # where the search started: write() records the moves against it
    reasons: dict[str, str] = field(default_factory=dict)  # entry -> the measurement behind its move

    def write(self, folder, overwrite: bool = False) -> Path:
        """The lists as a folder to pass as `AutoMixedPrecisionLists(lists_dir=...)`; never the shipped one."""
        changes = {entry: (WHITE, self.reasons[entry]) for entry in self.moved_to_white}
        changes.update({entry: (BLACK, self.reasons[entry]) for entry in self.moved_to_black})
        return write_lists(folder, self.start_lists, changes, overwrite=overwrite)

    def __str__(self) -> str:
        low = dtype_name(self.amp_lists.dtype)
        return "\n".join([
            f"graphamp auto lists ({low}, tolerance {self.tolerance:.3g}, {self.evaluations} runs):",
            f"  error {self.error:.3g} (the lists given: {self.start_error:.3g})",
            f"  op nodes running in {low}: {self.low_nodes} of {self.op_nodes} (the lists given: {self.start_low_nodes})",
            f"  moved to white: {', '.join(self.moved_to_white) or '-'}",
            f"  moved to black: {', '.join(self.moved_to_black) or '-'}",
        ])


def auto_mixed_precision(
    model: nn.Module, example_args=(), example_kwargs=None, tolerance: float = 1e-2,
    amp_lists: AutoMixedPrecisionLists | None = None, level: str = "O1", loss_fn=None,
) -> AutoListsResult:
    """Lists that run as many ops low as the tolerance allows on this model and input.

    Args:
        model: the FP32 nn.Module; it is captured once and left untouched (the runs use copies).
        example_args, example_kwargs: one call of the model, the inputs the search is judged on.
        tolerance: the largest relative error of the loss against FP32 (of the floating outputs when the
            model returns no scalar loss), measured forward on the example inputs.
        amp_lists: where the search starts, and the dtype (default: the shipped lists, float16).
        level: "O1" or "O2", as for `rewrite`.
        loss_fn: `loss_fn(outputs) -> scalar` for a model that returns no loss.

    Returns:
        An AutoListsResult: `amp_lists`, the entries moved each way with their measured reasons, and
        `write(folder)`.
    """
    example_args, example_kwargs, config = check_entry_arguments(
        "auto_mixed_precision", model, example_args, example_kwargs, amp_lists, level
    )
    start = config.lists
    if not (isinstance(tolerance, (int, float)) and tolerance > 0):
        raise ArgumentError(f"tolerance={tolerance!r}: pass a positive relative error, e.g. 1e-2.")
    probe = Probe(model, example_args, example_kwargs, level, loss_fn, promote_ops=start.promote_ops)
    warn_of_bodies_without_module_paths(probe.graph_module, start, "auto_mixed_precision")
    reference = probe.reference(seed=0, backward=False)
    measured = probe.compare(start, reference, backward=False)
    colors = {e.name: e.color for e in start.entries()}
    # Entries that can run low, most costly first; ops with no low-precision kernel keep their list.
    cost = _cost_of_running_low(measured.nodes)
    candidates = sorted(cost, key=lambda entry: (-cost[entry], entry))
    evaluations = 0

    def lists_for(black: set[str]) -> AutoMixedPrecisionLists:
        white = [e for e in candidates if e not in black and colors.get(e) == BLACK]
        return start.with_changes(white=white, black=[e for e in candidates if e in black and colors.get(e) != BLACK])

    def within(black: set[str]) -> bool:
        nonlocal evaluations
        evaluations += 1
        return probe.output_error(lists_for(black), reference) <= tolerance

    # The shortest prefix of the costliest entries that must stay black (all black is FP32: it holds).
    low, high = 0, len(candidates)
    while low < high:
        middle = (low + high) // 2
        if within(set(candidates[:middle])):
            high = middle
        else:
            low = middle + 1
    black = set(candidates[:low])
    for entry in sorted(black, key=lambda e: (cost[e], e)):  # cheapest first: try each low again
        if within(black - {entry}):
            black.discard(entry)

    found = lists_for(black)
    final = probe.compare(found, reference, backward=False)
    low_dtype = dtype_name(start.dtype)
    reasons = {entry: f"auto: low-precision error {cost[entry]:.3g}; loss within {tolerance:.3g}" for entry in cost}
    return AutoListsResult(
        amp_lists=found, tolerance=tolerance, error=probe.output_error(found, reference),
        start_error=probe.output_error(start, reference),
        moved_to_white=sorted(e for e in candidates if e not in black and colors.get(e) == BLACK),
        moved_to_black=sorted(e for e in candidates if e in black and colors.get(e) != BLACK),
        low_nodes=sum(r.runs_in == low_dtype for r in final.nodes),
        start_low_nodes=sum(r.runs_in == low_dtype for r in measured.nodes),
        op_nodes=len(measured.nodes), evaluations=evaluations, reasons=reasons, start_lists=start,
    )


def _cost_of_running_low(nodes: list[NodeNumerics]) -> dict[str, float]:
    """Per list entry, the worst error of its ops run low (inf where values overflow); entries with an op that
    cannot run low (no low_error) are left out."""
    return {
        entry: max([0.0, *(math.inf if r.overflow > 0 or r.nonfinite else r.low_error for r in records)])
        for entry, records in by_list_entry(nodes).items()
        if all(r.low_error is not None for r in records)
    }
