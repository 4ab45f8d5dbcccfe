"""The doctor's report.html: well-formed, says what the report says, and plots exactly the plottable values.

Each test renders a small report built here: one node overflows (inf values), some are unmeasured (None), one
error is NaN.
"""

import html
import math
import re
import xml.etree.ElementTree as ElementTree
from html.parser import HTMLParser

from graphamp.diagnosis.doctor_page import render_doctor_page

SVG = "{http://www.w3.org/2000/svg}"
INF, NAN = float("inf"), float("nan")


def node(index, name, op, error, max_abs, nonfinite=False, **fields):
    record = {
        "index": index, "name": name, "op": op, "module": "block.1.mlp", "decision": "white",
        "source": "lists/white.txt:12", "runs_in": "float16", "max_abs": max_abs, "overflow": 0.0,
        "underflow": 0.0, "error": error, "local_error": 4e-4, "low_error": 4e-4, "grad_error": 2e-3,
        "nonfinite": nonfinite, "grad_nonfinite": False,
    }
    return record | fields


def report(**fields):
    nodes = [
        node(0, "linear", "linear.default", 1.2e-3, 3.2),
        node(1, "mul_3", "mul.Tensor", INF, 7.1e4, nonfinite=True, overflow=0.25, local_error=NAN),
        node(2, "sum_1", "sum.default", None, None, runs_in=None, grad_error=None, module=None),
        node(3, "softmax", "_softmax.default", 0.0, 1.0, decision="black", runs_in="float32"),
        node(4, "div", "div.Tensor", NAN, INF, nonfinite=True, grad_nonfinite=True),
        node(5, "gelu", "gelu.default", 0.5, 0.0, underflow=0.01),
    ]
    base = {
        "model": "Tiny<MLP>", "dtype": "float16", "level": "O1", "steps": 1, "dtype_max": 65504.0,
        "output_error": NAN, "loss": {"fp32": 4.51, "amp": 4.52, "relative_error": 2.2e-3}, "backward": True,
        "first_nonfinite": {"node": "mul_3", "op": "mul.Tensor", "module": "block.1.mlp", "max_abs_fp32": 7.1e4},
        "first_nonfinite_grad": None,
        "nodes": nodes,
        "parameters": [
            {"name": "fc1.weight", "grad_error": 3e-3, "grad_max_abs": 0.2, "grad_nonfinite": False},
            {"name": "fc2.weight", "grad_error": None, "grad_max_abs": INF, "grad_nonfinite": True},
        ],
        "suggestions": [
            {"kind": "black_module", "target": "block.1.mlp", "verified": True,
             "text": "module `block.1.mlp` -> custom_black_modules (max |x| 7.1e4 > float16 max at mul_3)"},
            {"kind": "white_op", "target": "softmax", "verified": False,
             "text": "move `softmax` from black to white: measured error 2.1e-3 at 4 nodes"},
        ],
        "top_offenders": [nodes[1], nodes[4], nodes[0]],
    }
    return base | fields


def svg_of(page):
    return ElementTree.fromstring(re.search(r"<svg.*?</svg>", page, re.S).group(0))


def verdict_of(page):
    return re.search(r'<p class="verdict">(.*?)</p>', page, re.S).group(1)


class BalancedTags(HTMLParser):
    """Fails on an end tag that does not close the innermost open element."""

    VOID = {"meta", "br", "hr", "img", "input", "link"}

    def __init__(self):
        super().__init__()
        self.open = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open.pop() == tag, f"</{tag}> closes nothing open"


def test_page_parses_as_html_with_balanced_tags():
    parser = BalancedTags()
    parser.feed(render_doctor_page(report()))
    parser.close()
    assert parser.open == []


def test_plot_is_well_formed_svg_with_viewbox():
    svg = svg_of(render_doctor_page(report()))
    assert svg.tag == f"{SVG}svg" and svg.get("viewBox") == "0 0 1000 360"


def test_sections_come_in_order():
    page = render_doctor_page(report())
    marks = ["<h1>", 'class="verdict"', "Suggestions", "Top offenders", "<svg", "Parameter gradients", "All nodes"]
    positions = [page.index(mark) for mark in marks]
    assert positions == sorted(positions)


def test_title_and_text_are_escaped():
    page = render_doctor_page(report())
    assert "Tiny&lt;MLP&gt; · float16 · O1" in page and "Tiny<MLP>" not in page


def test_verdict_names_first_nonfinite_node_its_range_loss_and_output_error():
    verdict = verdict_of(render_doctor_page(report()))
    assert "<code>mul_3</code>" in verdict and "mul.Tensor" in verdict and "block.1.mlp" in verdict
    assert "7.10e+04" in verdict and "6.55e+04" in verdict
    assert "4.51" in verdict and "4.52" in verdict and "2.20e-03" in verdict
    assert "outputs vs FP32: nan" in verdict


def test_verdict_says_finite_without_loss_when_there_is_none():
    verdict = verdict_of(render_doctor_page(report(first_nonfinite=None, loss=None, output_error=1.2e-3)))
    assert "Finite." in verdict and "Loss" not in verdict and "1.20e-03" in verdict


def test_plot_marks_first_nonfinite_node():
    marker = svg_of(render_doctor_page(report())).find(f"{SVG}g[@class='first-nonfinite']")
    assert marker is not None and "mul_3" in marker.find(f"{SVG}text").text
    assert marker.find(f"{SVG}line") is not None


def test_every_suggestion_appears_with_its_verification_mark():
    page = render_doctor_page(report())
    items = re.findall(r"<li>(.*?)</li>", page)
    for suggestion, item in zip(report()["suggestions"], items, strict=True):
        assert html.escape(suggestion["text"]) in item
        assert ("(verified)" if suggestion["verified"] else "(not verified)") in item


def test_error_points_are_finite_positive_errors_plus_clamped_nonfinite():
    nodes = report()["nodes"]
    plottable = [n for n in nodes if not n["nonfinite"] and n["error"] is not None and 0 < n["error"] < INF]
    nonfinite = [n for n in nodes if n["nonfinite"]]
    circles = svg_of(render_doctor_page(report())).iter(f"{SVG}circle")
    errors = [c for c in circles if "error" in c.get("class", "").split()]
    assert len(errors) == len(plottable) + len(nonfinite)
    clamped = [c for c in errors if "clamped" in c.get("class").split()]
    assert len(clamped) == len(nonfinite) and {c.get("fill") for c in clamped} == {"#d62728"}


def test_nonfinite_values_are_clamped_above_every_finite_point():
    circles = list(svg_of(render_doctor_page(report())).iter(f"{SVG}circle"))
    clamped = [c for c in circles if "clamped" in c.get("class", "").split()]
    finite = [c for c in circles if c.get("class") in ("error", "range")]
    assert {c.get("class") for c in clamped} == {"error clamped", "range clamped"}  # inf error, inf max |x|
    assert len({c.get("cy") for c in clamped}) == 1
    assert all(float(clamped[0].get("cy")) < float(c.get("cy")) for c in finite)


def test_each_point_has_a_tooltip_naming_its_node():
    circles = [c for c in svg_of(render_doctor_page(report())).iter(f"{SVG}circle") if c.get("class")]
    assert circles and all(c.find(f"{SVG}title") is not None for c in circles)
    assert any("mul_3 (mul.Tensor, block.1.mlp)" in c.find(f"{SVG}title").text for c in circles)


def test_no_nan_or_inf_in_svg_coordinates():
    svg = svg_of(render_doctor_page(report()))
    for element in svg.iter():
        for name, value in element.attrib.items():
            assert "nan" not in value.lower() and "inf" not in value.lower(), (element.tag, name, value)
            if element is not svg and name in {"x", "y", "x1", "y1", "x2", "y2", "cx", "cy", "r", "width", "height"}:
                assert math.isfinite(float(value))
    (line,) = svg.iter(f"{SVG}polyline")
    assert all(math.isfinite(float(v)) for v in re.split(r"[ ,]", line.get("points")))


def test_axis_ticks_are_powers_of_ten():
    labels = [t.text for t in svg_of(render_doctor_page(report())).iter(f"{SVG}text") if t.text.startswith("1e")]
    assert "1e-3" in labels and "1e0" in labels


def test_node_table_renders_inf_nan_and_unmeasured_values():
    nodes_table = render_doctor_page(report()).split("All nodes")[1]
    assert "<td class=n>inf</td>" in nodes_table and "<td class=n>nan</td>" in nodes_table
    assert "<td class=n>-</td>" in nodes_table and "<td class=n>25</td>" in nodes_table  # overflow 0.25 -> 25 %


def test_parameters_are_sorted_worst_first_and_capped_at_50():
    parameters = [{"name": f"p{i}", "grad_error": i * 1e-4, "grad_max_abs": 1.0, "grad_nonfinite": False}
                  for i in range(60)]
    page = render_doctor_page(report(parameters=parameters + report()["parameters"]))
    section = page.split("Parameter gradients")[1].split("All nodes")[0]
    names = re.findall(r"<td><code>(.*?)</code></td>", section)
    assert names[:3] == ["fc2.weight", "p59", "p58"] and len(names) == 50
    assert "12 more" in section


def test_empty_report_still_renders():
    page = render_doctor_page(report(nodes=[], suggestions=[], top_offenders=[], parameters=[], loss=None,
                                     first_nonfinite=None, dtype_max=None))
    BalancedTags().feed(page)
    assert "<svg" not in page and "None: no list change is suggested." in page
