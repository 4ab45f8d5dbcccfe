"""report.html: one self-contained page (no network) on what the cast pass did to one graph.

The picture, the casts graphamp executes next to torch.autocast's, the ops on no list, and a table of every
op by dtype, decision and source.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from graphamp.inspection.graph_picture import CAST_FILL, FILL, OTHER_FILL, runs_in
from graphamp.inspection.html_page import escape, render_page, section
from graphamp.policy.lists import Decision

__all__ = ["CastCounts", "render_report"]

_DECISION_ORDER = {decision: order for order, decision in enumerate(Decision)}


@dataclass
class CastCounts:
    """dtype conversions executed on the capture's inputs: through graphamp and under torch.autocast."""

    graphamp: int
    autocast: int | None  # None when torch.autocast could not run the model
    forward_only: str  # why the backward was not counted ("" when it was)
    autocast_error: str = ""  # why autocast was not measured


def render_report(summary: dict, svg: str, casts: CastCounts, title: str) -> str:
    """report.html's text."""
    sections = [_casts_section(summary, casts), _picture_section(svg), _unlisted_section(summary), _ops_section(summary)]
    return render_page(f"graphamp: {title}", sections)


def _casts_section(summary: dict, casts: CastCounts) -> str:
    passes = f"forward only ({escape(casts.forward_only)})" if casts.forward_only else "forward and backward"
    autocast = casts.autocast if casts.autocast is not None else f"not measured: {escape(casts.autocast_error)}"
    return (
        "<h2>Casts</h2>\n"
        f"<p>The cast pass inserted <b>{summary['casts']}</b> cast nodes into the graph "
        f"({summary['dtype']}, level {summary['level']}).</p>\n"
        "<table>\n<tr><th>run on the inputs the graph was captured on</th><th>dtype conversions executed</th></tr>\n"
        f"<tr><td>graphamp (the rewritten graph)</td><td class=n>{casts.graphamp}</td></tr>\n"
        f"<tr><td>torch.autocast on the original model</td><td class=n>{autocast}</td></tr>\n</table>\n"
        f"<p>Counted: {passes}, both runs in the same train/eval mode and grad mode; a conversion is an "
        f"executed <code>aten::_to_copy</code> that changes the dtype. graphamp's count includes the casts of floating "
        f"outputs back to the dtype the FP32 model gives them.</p>"
    )


def _picture_section(svg: str) -> str:
    # The SVG goes inline: the page must stand alone. Its XML prologue is not allowed inside HTML.
    inline = re.sub(r"^.*?(?=<svg)", "", svg, count=1, flags=re.S)
    legend = " ".join(
        f'<span class=swatch style="background:{colour}"></span> {escape(what)}'
        for colour, what in [
            (FILL["bfloat16"], "runs in float16/bfloat16"), (FILL["float32"], "runs in float32"),
            (OTHER_FILL, "integer / bool"), (CAST_FILL, "inserted cast (hexagon)"),
        ]
    )
    return (
        "<h2>Graph</h2>\n"
        f"<p>{legend}. Boxes around ops are the modules they ran in; a dashed node stands for blocks identical to "
        f"the one drawn in full. Hover over an op for its decision and source.</p>\n"
        f'<div class="picture">{inline}</div>'
    )


def _unlisted_section(summary: dict) -> str:
    unlisted = summary["unlisted_ops"]
    rows = "\n".join(
        f"<tr><td><code>{escape(op)}</code></td><td class=n>{count}</td></tr>" for op, count in unlisted.items()
    )
    return section("Unlisted ops", (
        "<p>These ops are on no list, so they followed their inputs like gray ops. To decide them, add the op a line "
        "to <code>white.txt</code>, <code>black.txt</code> or <code>gray.txt</code> in your lists folder, or pass "
        "<code>AutoMixedPrecisionLists(custom_gray_list=[...])</code> (or white/black).</p>\n"
        f"<table>\n<tr><th>op</th><th>count</th></tr>\n{rows}\n</table>"
    ) if unlisted else "", "every op of this graph is on a list.")


def _ops_section(summary: dict) -> str:
    groups = Counter()
    for record in summary["nodes"]:
        # Each inserted cast names the op it feeds; grouped by target dtype they read better.
        source = "the cast pass" if record["decision"] == Decision.INSERTED_CAST else record["source"]
        groups[record["op"], runs_in(record) or record["out_dtype"] or "-", record["decision"], source] += 1
    ordered = sorted(groups.items(), key=lambda item: (_DECISION_ORDER.get(item[0][2], 9), -item[1], item[0][0]))
    rows = "\n".join(
        f"<tr><td><code>{escape(op)}</code></td><td class=n>{count}</td><td>{escape(dtype)}</td><td>{escape(decision)}</td>"
        f"<td>{escape(source)}</td></tr>"
        for (op, dtype, decision, source), count in ordered
    )
    return (
        "<h2>Ops</h2>\n<table>\n<tr><th>op</th><th>count</th><th>runs in</th><th>decision</th><th>source</th></tr>\n"
        f"{rows}\n</table>"
    )
