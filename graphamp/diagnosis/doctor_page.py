"""The doctor's report.html: one self-contained page (no network, no script) showing a `graphamp doctor` report.

The verdict, the suggested list changes, the worst nodes, a plot of per-node error and range, the parameter
gradients and every node, in that order.
"""

from __future__ import annotations

import math

from graphamp.diagnosis.numerics import ranked
from graphamp.inspection.html_page import escape, format_number, render_page, section

__all__ = ["render_doctor_page"]

_STYLE = "tr.bad td { background: #fde0e0; } .ok { color: #2a7a2a; } .unsure { color: #a06000; }\n"
_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 1000, 360, 60, 160, 20, 40  # the right margin holds the legend
_ERROR, _RANGE, _BAD = "#1f77b4", "#ff7f0e", "#d62728"
_HALO = 'stroke="white" stroke-width="3" paint-order="stroke"'  # keeps a label readable over thousands of points
_NOT_MEASURED = "no nodes were measured."
_NUMERIC = {"index", "max_abs", "overflow", "underflow", "error", "local_error", "low_error", "grad_error",
            "grad_max_abs"}
_OFFENDER_COLUMNS = [
    ("node", "name"), ("op", "op"), ("module", "module"), ("decision", "decision"), ("runs in", "runs_in"),
    ("max |x|", "max_abs"), ("overflow %", "overflow"), ("underflow %", "underflow"), ("error", "error"),
    ("local error", "local_error"), ("grad error", "grad_error"),
]
_NODE_COLUMNS = (
    [("#", "index")] + _OFFENDER_COLUMNS[:4] + [("source", "source")] + _OFFENDER_COLUMNS[4:10]
    + [("low error", "low_error")] + _OFFENDER_COLUMNS[10:]
)
_PARAMETER_COLUMNS = [("parameter", "name"), ("grad error", "grad_error"), ("grad max |x|", "grad_max_abs"),
                      ("non-finite", "grad_nonfinite")]


def render_doctor_page(report: dict) -> str:
    """report.html's text."""
    title = f"{report['model']} · {report['dtype']} · {report['level']}"
    sections = [
        _verdict(report),
        _suggestions_section(report.get("suggestions") or []),
        section("Top offenders", _table(report.get("top_offenders") or [], _OFFENDER_COLUMNS), _NOT_MEASURED),
        _plot_section(report),
        _parameters_section(report.get("parameters") or []),
        section("All nodes", _table(report.get("nodes") or [], _NODE_COLUMNS), _NOT_MEASURED),
    ]
    return render_page(f"graphamp doctor: {title}", sections, _STYLE)


def _verdict(report: dict) -> str:
    dtype, first, grad = report["dtype"], report.get("first_nonfinite"), report.get("first_nonfinite_grad")
    if report.get("fp32_nonfinite"):
        return (f'<p class="verdict"><b>Already inf/NaN in FP32.</b> The {escape(report["fp32_nonfinite"])} is not '
                f"finite without mixed precision: no list can fix that. Fix the model or its inputs first.</p>")
    if report.get("failure"):
        return f'<p class="verdict"><b>The rewritten graph cannot run.</b> {escape(report["failure"])}</p>'
    if first:
        said = [
            f"<b>Not finite.</b> The first node whose {escape(dtype)} output is inf/NaN is {_where(first)}: its FP32 "
            f"max |x| is {format_number(first.get('max_abs_fp32'))} against the {escape(dtype)} max {format_number(report.get('dtype_max'))}."
        ]
    else:
        said = [f"<b>Finite.</b> Every node's {escape(dtype)} output is finite."]
    if grad:
        said.append(f"The first node whose output gradient is inf/NaN (backward order) is {_where(grad)}.")
    else:
        said.append("Every gradient compared is finite." if report.get("backward") else "Gradients were not compared.")
    if (loss := report.get("loss")) is not None:
        said.append(f"Loss: FP32 {format_number(loss.get('fp32'))}, {escape(dtype)} {format_number(loss.get('amp'))}, "
                    f"relative error {format_number(loss.get('relative_error'))}.")
    said.append(f"Relative error of the outputs vs FP32: {format_number(report.get('output_error'))} "
                f"(worst of {escape(report.get('steps', 1))} step(s)).")
    return '<p class="verdict">' + " ".join(said) + "</p>"


def _where(record: dict) -> str:
    return (f"<code>{escape(record.get('node'))}</code> (<code>{escape(record.get('op'))}</code> in module "
            f"<code>{escape(record.get('module') or '(top level)')}</code>)")


def _suggestions_section(suggestions: list) -> str:
    marks = {True: '<span class="ok" title="a rerun with it applied is finite, or its loss error at least halves">(verified)</span>',
             False: '<span class="unsure">(not verified)</span>'}
    items = "\n".join(f"<li>{escape(s['text'])} {marks[bool(s.get('verified'))]}</li>" for s in suggestions)
    return section("Suggestions", f"<ul>\n{items}\n</ul>" if suggestions else "", "no list change is suggested.")


def _table(records: list, columns: list) -> str:
    """A table of node (or parameter) records, a row each; rows with an inf/NaN value or gradient are marked bad."""
    if not records:
        return ""
    head = "".join(f"<th>{escape(header)}</th>" for header, _ in columns)
    rows = "\n".join(
        ("<tr class=bad>" if record.get("nonfinite") or record.get("grad_nonfinite") else "<tr>")
        + "".join(_cell(key, record.get(key)) for _, key in columns) + "</tr>"
        for record in records
    )
    return f"<table>\n<tr>{head}</tr>\n{rows}\n</table>"


def _cell(key: str, value) -> str:
    if key in ("overflow", "underflow"):
        return f"<td class=n>{format_number(None if value is None else value * 100)}</td>"
    if key in _NUMERIC:
        return f"<td class=n>{format_number(value)}</td>"
    if key == "grad_nonfinite":
        return f"<td>{'yes' if value else 'no'}</td>"
    text = escape("-" if value is None else value)
    return f"<td><code>{text}</code></td>" if key in ("name", "op") else f"<td>{text}</td>"


def _parameters_section(parameters: list, limit: int = 50) -> str:
    worst_first = sorted(
        parameters, key=lambda p: -math.inf if p.get("grad_nonfinite") else -ranked(p.get("grad_error"))
    )
    more = f"\n<p>… and {len(worst_first) - limit} more, not shown.</p>" if len(worst_first) > limit else ""
    table = _table(worst_first[:limit], _PARAMETER_COLUMNS)
    return section("Parameter gradients", table + more, "no parameter gradients were compared.")


def _plot_section(report: dict) -> str:
    nodes = report.get("nodes") or []
    return section("Per-node error and range", (
        "<p>Relative error vs the FP32 run and max |x| / dtype max of each node, "
        "on one log scale. A red point at the top is non-finite; values above the dashed dtype max line overflow. "
        "Hover over a point for its node.</p>\n" + _plot(nodes, report.get("dtype_max"), report.get("first_nonfinite"))
    ) if nodes else "", _NOT_MEASURED)


def _series(nodes: list, dtype_max) -> tuple[list, list]:
    """(error points, range points) as (node, x, value); value None: non-finite, clamped to the top."""
    errors, ranges = [], []
    for position, node in enumerate(nodes):
        x, error, max_abs = node.get("index", position), node.get("error"), node.get("max_abs")
        if node.get("nonfinite") or (error is not None and not math.isfinite(error)):
            errors.append((node, x, None))
        elif error is not None and error > 0:  # zeros have no place on a log scale
            errors.append((node, x, error))
        if dtype_max and max_abs is not None and (max_abs > 0 or not math.isfinite(max_abs)):
            ranges.append((node, x, max_abs / dtype_max if math.isfinite(max_abs) else None))
    return errors, ranges


def _plot(nodes: list, dtype_max, first_nonfinite) -> str:
    errors, ranges = _series(nodes, dtype_max)
    logs = [math.log10(v) for _, _, v in errors + ranges if v is not None] + ([0.0] if dtype_max else [])
    # Every finite value lies below the top line, so a point clamped there is never mistaken for one.
    low, high = math.floor(min(logs, default=0)), math.floor(max(logs, default=0)) + 1
    x_max = max(max(node.get("index", position) for position, node in enumerate(nodes)), 1)
    width, height, right = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM, _W - _RIGHT

    def at(x, value):
        y = high if value is None else math.log10(value)
        return f"{_LEFT + x / x_max * width:.1f}", f"{_TOP + (high - y) / (high - low) * height:.1f}"

    parts = [f'<rect x="{_LEFT}" y="{_TOP}" width="{width}" height="{height}" fill="none" stroke="#888"/>']
    for k in range(low, high + 1, max(1, math.ceil((high - low) / 10))):
        _, y = at(0, 10.0**k)
        parts.append(f'<line x1="{_LEFT}" y1="{y}" x2="{right}" y2="{y}" stroke="#eee"/><text x="{_LEFT - 6}" '
                     f'y="{y}" text-anchor="end" dominant-baseline="middle">1e{k}</text>')
    step = next(m * 10**k for k in range(12) for m in (1, 2, 5) if x_max / (m * 10**k) <= 10)
    for index in range(0, int(x_max) + 1, step):
        parts.append(f'<text x="{at(index, 1.0)[0]}" y="{_TOP + height + 16}" text-anchor="middle">{index}</text>')
    parts.append(f'<text x="{_LEFT + width / 2}" y="{_H - 6}" text-anchor="middle">node (execution order)</text>')
    if dtype_max:
        _, y = at(0, 1.0)
        parts.append(f'<line x1="{_LEFT}" y1="{y}" x2="{right}" y2="{y}" stroke="#555" stroke-dasharray="6 4"/>'
                     f'<text x="{right - 4}" y="{y}" dy="-4" text-anchor="end" fill="#555" {_HALO}>dtype max</text>')
    points = " ".join(",".join(at(x, v)) for _, x, v in errors)
    parts.append(f'<polyline fill="none" stroke="{_ERROR}" stroke-width="0.8" stroke-opacity="0.6" points="{points}"/>')
    radius = 2.5 if len(nodes) <= 500 else 1.5
    for series, colour, plotted in (("error", _ERROR, errors), ("range", _RANGE, ranges)):
        for node, x, value in plotted:
            (cx, cy), clamped = at(x, value), value is None
            parts.append(f'<circle class="{series}{" clamped" * clamped}" cx="{cx}" cy="{cy}" r="{radius}" '
                         f'fill="{_BAD if clamped else colour}"><title>{_tooltip(node, dtype_max)}</title></circle>')
    first = (first_nonfinite or {}).get("node")
    first_x = next((node.get("index", i) for i, node in enumerate(nodes) if first and node.get("name") == first), None)
    if first_x is not None:  # drawn after the points so that thousands of them do not hide it
        x, _ = at(first_x, 1.0)
        side = 'dx="4"' if first_x < x_max / 2 else 'dx="-4" text-anchor="end"'
        parts.append(f'<g class="first-nonfinite"><line x1="{x}" y1="{_TOP}" x2="{x}" y2="{_TOP + height}" '
                     f'stroke="{_BAD}" stroke-dasharray="3 3"/><text x="{x}" y="{_TOP + 24}" {side} '
                     f'fill="{_BAD}" {_HALO}>first non-finite: {escape(first)}</text></g>')
    parts.append(_legend())
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" width="100%" '
            f'style="max-width:{_W}px" font-family="Helvetica, Arial, sans-serif" font-size="11">\n'
            + "\n".join(parts) + "\n</svg>")


def _tooltip(node: dict, dtype_max) -> str:
    ratio = node["max_abs"] / dtype_max if dtype_max and node.get("max_abs") is not None else None
    return escape(f"#{node.get('index')} {node.get('name')} ({node.get('op')}, {node.get('module') or '(top level)'}): "
              f"error {format_number(node.get('error'))}, local error {format_number(node.get('local_error'))}, max |x| "
              f"{format_number(node.get('max_abs'))} ({format_number(ratio)} of dtype max), grad error {format_number(node.get('grad_error'))}")


def _legend() -> str:
    x, y = _W - _RIGHT + 14, _TOP + 10
    entries = [(_ERROR, "relative error"), (_RANGE, "max |x| / dtype max"), (_BAD, "non-finite (clamped)")]
    marks = [f'<circle cx="{x}" cy="{y + 18 * i}" r="3.5" fill="{colour}"/>'
             f'<text x="{x + 10}" y="{y + 18 * i}" dominant-baseline="middle">{escape(what)}</text>'
             for i, (colour, what) in enumerate(entries)]
    marks.append(f'<line x1="{x - 6}" y1="{y + 54}" x2="{x + 6}" y2="{y + 54}" stroke="#555" stroke-dasharray="4 2"/>'
                 f'<text x="{x + 10}" y="{y + 54}" dominant-baseline="middle">dtype max</text>')
    return '<g class="legend">' + "".join(marks) + "</g>"
