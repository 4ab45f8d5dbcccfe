"""doctor(): which op makes the loss inf/NaN, how far each op is from FP32, and what to put on which list.

The model is captured once and run node by node in FP32 and rewritten by the lists, on the same inputs
(probe.py measures); the fixes and list candidates come from suggestions.py. The report prints as a table
of the worst offenders, and writes report.json, report.html and, on request, a lists folder.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from graphamp.policy.config import check_entry_arguments
from graphamp.diagnosis.doctor_page import render_doctor_page
from graphamp.inspection.html_page import format_number
from graphamp.diagnosis.list_writer import write_lists
from graphamp.policy.dtypes import dtype_name
from graphamp.errors import ArgumentError
from graphamp.policy.lists import AutoMixedPrecisionLists
from graphamp.diagnosis.numerics import floating_leaves, ranked, relative_error, worst
from graphamp.diagnosis.probe import NodeNumerics, Probe
from graphamp.frontends.export_program import warn_of_bodies_without_module_paths
from graphamp.diagnosis.suggestions import (
    BLACK_MODULE, WHITE_OP, Suggestion, accuracy_and_speed, fixes_for_nonfinite, lists_with, measured_on_the_loss,
)

__all__ = ["DoctorReport", "doctor", "format_report"]


@dataclass
class ParameterGradient:
    name: str
    grad_error: float | None
    grad_max_abs: float | None
    grad_nonfinite: bool


@dataclass
class DoctorReport:
    """What doctor() measured (the worst over its steps) and what it suggests."""

    model: str
    amp_lists: AutoMixedPrecisionLists
    level: str
    steps: int
    nodes: list[NodeNumerics]
    parameters: list[ParameterGradient]
    first_nonfinite: NodeNumerics | None
    first_nonfinite_grad: NodeNumerics | None
    output_error: float | None
    loss: dict | None  # {"fp32", "amp", "relative_error"} of the first step, when the model returns a loss
    backward: bool
    suggestions: list[Suggestion] = field(default_factory=list)
    failure: str | None = None  # the node where the rewritten graph raised, and the error
    fp32_nonfinite: str | None = None  # "loss" or "outputs" when already inf/NaN in FP32: no list can fix it

    @property
    def dtype(self) -> torch.dtype:
        return self.amp_lists.dtype

    @property
    def finite(self) -> bool:
        """Whether every run measured was finite: an FP32 run already inf/NaN counts, though no list is to blame."""
        problems = (self.first_nonfinite, self.first_nonfinite_grad, self.failure, self.fp32_nonfinite)
        return all(problem is None for problem in problems)

    def top_offenders(self, count: int = 10) -> list[NodeNumerics]:
        """The nodes that hurt most: inf/NaN first, then overflow in the low dtype, then their own error."""
        low = dtype_name(self.dtype)

        def harm(record):
            return (
                record.nonfinite or record.grad_nonfinite,
                record.overflow if record.runs_in == low else 0.0,
                ranked(record.local_error),
                ranked(record.error),
            )

        measured = [r for r in self.nodes if r.error is not None or r.nonfinite]
        return sorted(measured, key=harm, reverse=True)[:count]

    def suggested_lists(self, speedups: bool = False) -> AutoMixedPrecisionLists:
        """The lists with the suggestions applied (the white candidates too with speedups=True)."""
        return lists_with(self.amp_lists, self._chosen(speedups))

    def apply(self, folder, speedups: bool = False, overwrite: bool = False) -> Path:
        """Write a lists folder holding the lists with the suggestions applied; never over the shipped lists."""
        chosen = self._chosen(speedups)
        changes = {s.target: ("white" if s.kind == WHITE_OP else "black", s.reason) for s in chosen if s.kind != BLACK_MODULE}
        modules = [(s.target, s.reason) for s in chosen if s.kind == BLACK_MODULE]
        return write_lists(folder, self.amp_lists, changes, modules, overwrite=overwrite)

    def _chosen(self, speedups: bool) -> list[Suggestion]:
        return [s for s in self.suggestions if speedups or s.kind != WHITE_OP]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "dtype": dtype_name(self.dtype),
            "level": self.level,
            "steps": self.steps,
            "dtype_max": torch.finfo(self.dtype).max,
            "output_error": self.output_error,
            "loss": self.loss,
            "backward": self.backward,
            "failure": self.failure,
            "fp32_nonfinite": self.fp32_nonfinite,
            "first_nonfinite": _culprit(self.first_nonfinite),
            "first_nonfinite_grad": _culprit(self.first_nonfinite_grad),
            "suggestions": [s.as_dict() for s in self.suggestions],
            "top_offenders": [asdict(r) for r in self.top_offenders()],
            "nodes": [asdict(r) for r in self.nodes],
            "parameters": [asdict(p) for p in self.parameters],
        }

    def write(self, out_dir) -> Path:
        """report.json and report.html in `out_dir` (created if missing)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        # JSON has no inf/NaN: strict parsers reject them, so they are written as strings.
        (out / "report.json").write_text(json.dumps(_json_safe(data), indent=1) + "\n", encoding="utf-8")
        (out / "report.html").write_text(render_doctor_page(data), encoding="utf-8")
        return out

    def __str__(self) -> str:
        return format_report(self)


def doctor(
    model: nn.Module, example_args=(), example_kwargs=None, amp_lists: AutoMixedPrecisionLists | None = None,
    steps: int = 1, level: str = "O1", loss_fn=None, loss_scaling: float = 1.0, dynamic: bool = False,
) -> DoctorReport:
    """Run `model` forward and backward in FP32 and rewritten by `amp_lists`, node by node on the same inputs.

    The model's parameters, gradients, buffers and RNG state are left as they were.

    Args:
        model: the FP32 nn.Module to diagnose.
        example_args, example_kwargs: one call of the model.
        amp_lists: the lists to diagnose (default: the shipped lists, float16).
        steps: runs to measure, each with its own random numbers (dropout), the same for both precisions;
            the report keeps the worst figure of each node over them.
        level: "O1" or "O2", as for `rewrite`.
        loss_fn: `loss_fn(outputs) -> scalar` for a model that returns no loss (default: its first scalar
            output; forward only when there is none).
        loss_scaling: the loss is multiplied by it before backward (and gradients divided after), as a loss
            scaler would: pass `optimizer.get_loss_scaling()` to see float16 gradients as training has them.
        dynamic: diagnose the graph captured with symbolic sizes (export_program(dynamic=True), or what
            torch.compile runs once sizes have varied), rather than the static graph of the example's sizes.

    Returns:
        A DoctorReport: the first inf/NaN forward and backward, every node's figures, the suggestions
        (`suggested_lists()`, `apply(folder)`), and `write(folder)` for report.json and report.html.
    """
    example_args, example_kwargs, config = check_entry_arguments(
        "doctor", model, example_args, example_kwargs, amp_lists, level
    )
    amp_lists = config.lists
    if not isinstance(steps, int) or steps < 1:
        raise ArgumentError(f"steps={steps!r}: pass a positive number of runs to measure.")
    if not (isinstance(loss_scaling, (int, float)) and math.isfinite(loss_scaling) and loss_scaling > 0):
        raise ArgumentError(f"loss_scaling={loss_scaling!r}: pass a positive finite number, e.g. 1024.0.")
    probe = Probe(model, example_args, example_kwargs, level, loss_fn, loss_scaling, dynamic,
                  promote_ops=amp_lists.promote_ops)
    warn_of_bodies_without_module_paths(probe.graph_module, amp_lists, "doctor")
    report = None
    for step in range(steps):
        reference = probe.reference(seed=step)
        comparison = probe.compare(amp_lists, reference)
        if report is None:
            report = _report(model, amp_lists, level, steps, reference, comparison)
            first_reference, first_comparison = reference, comparison
        else:
            _merge(report, comparison, reference)
        if report.failure or report.fp32_nonfinite:
            return report  # nothing to compare against, so nothing to suggest
    fixes = fixes_for_nonfinite(probe, amp_lists, first_reference, first_comparison)
    candidates = accuracy_and_speed(report.nodes, amp_lists.dtype, {s.target for s in fixes})
    if all(s.verified for s in fixes):  # on a run that is finite, each candidate's effect on the loss is measured
        candidates = measured_on_the_loss(probe, amp_lists, first_reference, fixes, candidates)
    report.suggestions = fixes + candidates
    return report


def _report(model, amp_lists, level, steps, reference, comparison) -> DoctorReport:
    loss = None
    if reference.loss is not None and comparison.loss is not None:
        error = relative_error(comparison.loss, reference.loss)
        loss = {"fp32": reference.loss.item(), "amp": comparison.loss.item(), "relative_error": error}
    return DoctorReport(
        model=type(model).__name__, amp_lists=amp_lists, level=level, steps=steps, nodes=comparison.nodes,
        parameters=_parameters(comparison.parameter_grads, reference.parameter_grads),
        first_nonfinite=comparison.first_nonfinite, first_nonfinite_grad=comparison.first_nonfinite_grad,
        output_error=comparison.output_error, loss=loss, backward=bool(reference.parameter_grads),
        failure=comparison.failure, fp32_nonfinite=_nonfinite_in_fp32(reference),
    )


def _nonfinite_in_fp32(reference) -> str | None:
    """'loss' or 'outputs' when the FP32 run itself is inf/NaN there: the model's problem, not the lists'."""
    if reference.loss is not None:
        return None if bool(torch.isfinite(reference.loss)) else "loss"
    finite = all(bool(t.isfinite().all()) for t in floating_leaves(reference.outputs))
    return None if finite else "outputs"


def _merge(report: DoctorReport, comparison, reference) -> None:
    """Fold a later step into the report: the worst figure per node, the first inf/NaN of the earliest step."""
    report.failure = report.failure or comparison.failure
    report.fp32_nonfinite = report.fp32_nonfinite or _nonfinite_in_fp32(reference)
    for mine, theirs in zip(report.nodes, comparison.nodes):
        mine.merge(theirs)
    by_name = {r.name: r for r in report.nodes}
    for first in ("first_nonfinite", "first_nonfinite_grad"):  # the report's own record of the node, by name
        if getattr(report, first) is None and getattr(comparison, first) is not None:
            setattr(report, first, by_name.get(getattr(comparison, first).name))
    report.output_error = worst(report.output_error, comparison.output_error)
    later = {p.name: p for p in _parameters(comparison.parameter_grads, reference.parameter_grads)}
    for mine in report.parameters:  # by name: each step ranks them worst first, and the ranking can change
        theirs = later.get(mine.name)
        if theirs is None:
            continue
        mine.grad_error = worst(mine.grad_error, theirs.grad_error)
        mine.grad_max_abs = worst(mine.grad_max_abs, theirs.grad_max_abs)
        mine.grad_nonfinite |= theirs.grad_nonfinite
    report.parameters.sort(key=lambda p: ranked(p.grad_error), reverse=True)


def _parameters(grads: dict, expected: dict) -> list[ParameterGradient]:
    found = []
    for name, grad in grads.items():
        if grad is None:
            continue
        finite = grad[grad.isfinite()]
        found.append(ParameterGradient(
            name=name,
            grad_error=relative_error(grad, expected[name]),
            grad_max_abs=float(finite.abs().max()) if finite.numel() else None,
            grad_nonfinite=finite.numel() != grad.numel(),
        ))
    return sorted(found, key=lambda p: ranked(p.grad_error), reverse=True)


def _culprit(record: NodeNumerics | None) -> dict | None:
    if record is None:
        return None
    return {"node": record.name, "op": record.op, "module": record.module, "max_abs_fp32": record.max_abs}


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# -- the table the CLI prints --------------------------------------------------------------------------------

def format_report(report: DoctorReport, count: int = 10) -> str:
    low = dtype_name(report.dtype)
    lines = [f"graphamp doctor: {report.model}, {low}, {report.level}, {report.steps} step(s)"]
    if report.fp32_nonfinite is not None:
        lines.append(f"  the {report.fp32_nonfinite} is already inf/NaN in FP32: no list can fix that; fix the model "
                     f"or its inputs first (no list suggestions)")
    if report.failure is not None:
        lines.append(f"  the rewritten graph cannot run: {report.failure}")
    if report.first_nonfinite is not None:
        r = report.first_nonfinite
        lines.append(f"  first inf/NaN (forward): {r.name} = {r.op} in {r.module or '(top level)'}, "
                     f"FP32 max |x| {format_number(r.max_abs)} vs {low} max {format_number(torch.finfo(report.dtype).max)}")
    if report.first_nonfinite_grad is not None:
        r = report.first_nonfinite_grad
        lines.append(f"  first inf/NaN (backward): gradient of {r.name} = {r.op} in {r.module or '(top level)'}")
    if report.finite:
        lines.append("  no inf/NaN: the rewritten run is finite forward and backward")
    if report.loss is not None:
        lines.append(f"  loss: FP32 {format_number(report.loss['fp32'])}, {low} {format_number(report.loss['amp'])} "
                     f"(relative error {format_number(report.loss['relative_error'])})")
    lines.append(f"  outputs: relative error {format_number(report.output_error)}")
    header = ("node", "op", "module", "decision", "runs in", "max |x|", "overflow", "underflow", "error",
              "own error", "grad error")
    rows = [header] + [
        (r.name, r.op, r.module or "-", r.decision, r.runs_in or "-", format_number(r.max_abs), f"{r.overflow:.1%}",
         f"{r.underflow:.1%}", format_number(r.error), format_number(r.local_error), format_number(r.grad_error))
        for r in report.top_offenders(count)
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["", f"top {len(rows) - 1} offenders:"]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines += ["", "suggestions:" if report.suggestions else "suggestions: none"]
    for s in report.suggestions:
        lines.append(f"  - {s.text}" + ("  [verified by a rerun]" if s.verified else ""))
    return "\n".join(lines)
