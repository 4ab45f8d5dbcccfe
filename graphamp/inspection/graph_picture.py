"""graph.svg: the rewritten graph as a picture, laid out by Graphviz's dot (the graphviz-pure package).

What it draws (colours, casts, clusters, a repeated block drawn once): docs/inspect.md. Parameters are not drawn:
their casts name them.
"""

from __future__ import annotations

import operator
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections import defaultdict
from pathlib import Path

from torch.fx import GraphModule, Node

from graphamp.errors import ExportError
from graphamp.policy.lists import Decision

__all__ = [
    "CAST_FILL", "CAST_STYLE", "FILL", "OTHER_FILL", "SHORT", "collapsed_blocks", "dot_source", "find_dot",
    "render_svg", "runs_in",
]

FILL = {"float16": "#b9e4a8", "bfloat16": "#b9e4a8", "float32": "#aecbf2", "float64": "#d5bdf2"}
OTHER_FILL = "#e4e4e4"  # integer and bool ops, and ops without a tensor output
CAST_FILL = "#ffb74d"
CAST_STYLE = {"shape": "hexagon", "fill": CAST_FILL, "extra": 'color="#c2410c" penwidth=2'}
SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
_NUMBERED_BLOCK = re.compile(r"^(?:(.*?)\.)?(\d+)(?=\.|$)")  # family 'transformer.h', index 3


def runs_in(record: dict) -> str | None:
    """The dtype an op computes in: its floating output's, else its floating inputs' (comparisons)."""
    return next((dtype for dtype in (record["out_dtype"], *record["in_dtypes"]) if dtype in FILL), None)


def render_svg(graphs, records, lifted: list[Node], parameter_names: dict, title: str) -> str:
    """graph.svg's text: the DOT description of the graphs, laid out and drawn by dot."""
    source = dot_source(graphs, records, lifted, parameter_names, title)
    dot = find_dot()
    result = subprocess.run([dot, "-Tsvg"], input=source.encode(), capture_output=True, timeout=300)
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip().splitlines()
        raise ExportError(
            f"{dot} could not lay out graph.svg (exit {result.returncode}): {message[0] if message else 'no message'}."
            f" Fix: update graphviz-pure (pip install -U graphviz-pure), or report the graph to graphamp."
        )
    return result.stdout.decode()


def dot_source(graphs, records, lifted, parameter_names, title) -> str:
    by_name = {r["name"]: r for r in records}
    _, root = graphs[0]
    collapsed = collapsed_blocks([r for r in records if "." not in r["name"]])
    picture = _Picture(by_name, collapsed, parameter_names)
    picture.add_graph(root, "", skip=set(lifted))  # parameters and buffers: their casts name them
    body_of = {  # sub-graph path -> the higher-order op it is a body of ('cond')
        path + (node.target,): user.target.__name__
        for path, graph_module in graphs
        for node in graph_module.graph.find_nodes(op="get_attr")
        for user in node.users
    }
    for path, body in graphs[1:]:
        cluster = f"{'/'.join(path)}: body of {body_of.get(path, 'a higher-order op')}"
        picture.add_graph(body, "".join(f"{p}." for p in path), cluster=cluster)
    return picture.source(title)


def collapsed_blocks(records: list[dict]) -> dict[str, tuple[str, str]]:
    """{block path: (summary node id, label)} for each block identical to the one before it in its family.

    A run of identical blocks is drawn as its first block in full and one summary node for the rest.
    """
    blocks = defaultdict(list)
    for record in records:
        if match := _NUMBERED_BLOCK.match(record["module"]):
            blocks[(match[1] or "", int(match[2]))].append(record)

    def block_path(family, index):
        return f"{family}.{index}" if family else str(index)

    def signature(family, index):
        start = block_path(family, index)
        return [(r["op"], r["decision"], runs_in(r), r["module"].removeprefix(start)) for r in blocks[family, index]]

    runs = []  # (family, index drawn in full, [indices same as it])
    for family, index in sorted(blocks):
        if runs and runs[-1][0] == family and signature(family, index) == signature(family, runs[-1][1]):
            runs[-1][2].append(index)
        else:
            runs.append((family, index, []))
    collapsed = {}
    for family, reference, same in runs:
        if not same:
            continue
        short = family.rpartition(".")[2]
        first, last = (f"{short}.{i}" if short else str(i) for i in (same[0], same[-1]))
        casts = sum(r["decision"] == Decision.INSERTED_CAST for r in blocks[family, reference])
        span = first if len(same) == 1 else f"{first}–{last}"
        label = f"{span}: same as {short + '.' if short else ''}{reference}\\n({casts} casts each)"
        for index in same:
            collapsed[block_path(family, index)] = (f"same:{block_path(family, same[0])}", label)
    return collapsed


class _Picture:
    """Collects nodes (by module cluster) and edges, then writes them as one DOT digraph."""

    def __init__(self, records, collapsed, parameter_names):
        self.records = records
        self.collapsed = collapsed
        self.parameter_names = parameter_names
        self.clusters = defaultdict(list)  # module path (or sub-graph name) -> node lines
        self.edges = {}  # (tail, head) -> None, in insertion order
        self.summaries = set()  # summary nodes drawn so far

    def add_graph(self, graph_module: GraphModule, prefix: str, skip=frozenset(), cluster: str | None = None):
        ids = {}  # fx node -> drawn id (getitem draws as the node it reads from)
        for node in graph_module.graph.nodes:
            record = self.records.get(prefix + node.name)
            if record is not None:
                ids[node] = self._add_op(node, record, cluster)
            elif node.op == "placeholder" and node.users and node not in skip and node.name not in self.parameter_names:
                ids[node] = prefix + node.name
                self.clusters[cluster or ""].append(_node(ids[node], node.name, shape="ellipse", fill="white"))
            elif node.op == "output":
                ids[node] = prefix + "output"
                self.clusters[cluster or ""].append(_node(ids[node], "output", shape="ellipse", fill="white"))
            elif node.target is operator.getitem and node.args[0] in ids:
                ids[node] = ids[node.args[0]]
            else:
                continue
            for value in node.all_input_nodes:
                if value in ids and ids[value] != ids[node]:
                    self.edges[ids[value], ids[node]] = None

    def _add_op(self, node: Node, record: dict, cluster: str | None) -> str:
        module = record["module"]
        block = _NUMBERED_BLOCK.match(module)
        block_path = block[0] if block else None
        if cluster is None and block_path in self.collapsed:
            summary, label = self.collapsed[block_path]
            family = block_path.rpartition(".")[0]
            if summary not in self.summaries:
                self.summaries.add(summary)
                self.clusters[family].append(_node(summary, label, fill="#f4f4f4", style="filled,dashed"))
            return summary
        name = record["name"]
        dtype = runs_in(record)
        tooltip = f"{name}: {record['decision']}" + (f" ({record['source']})" if record["source"] else "")
        tooltip += f" in {module or 'the top level'}"
        where = cluster if cluster is not None else module
        if record["decision"] == Decision.INSERTED_CAST:
            value = node.args[0]
            parameter = self.parameter_names.get(value.name)
            of = ".".join(parameter.split(".")[-2:]) if parameter else value.name  # 'c_attn.weight'
            label = f"cast → {SHORT.get(record['out_dtype'], record['out_dtype'])}\\n{of}"
            self.clusters[where].append(_node(name, label, tooltip=tooltip, **CAST_STYLE))
        else:
            op = record["op"].removesuffix(".default")
            label = f"{op}\\n{SHORT.get(dtype) or record['out_dtype'] or '-'} · {record['decision']}"
            self.clusters[where].append(_node(name, label, fill=FILL.get(dtype, OTHER_FILL), tooltip=tooltip))
        return name

    def source(self, title: str) -> str:
        lines = [
            "digraph graphamp {",
            f'  graph [rankdir=TB, newrank=true, nodesep=0.15, ranksep=0.25, fontname="Helvetica", fontsize=12, '
            f'label="{_escape(title)}", labelloc=t];',
            '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=9, height=0.3, '
            'margin="0.06,0.03"];',
            '  edge [arrowsize=0.5, color="#808080"];',
            *_legend(),
        ]
        lines += self._clusters("", 1)
        lines += [f'  "{_escape(tail)}" -> "{_escape(head)}";' for tail, head in self.edges]
        lines.append("}")
        return "\n".join(lines) + "\n"

    def _clusters(self, path: str, depth: int) -> list[str]:
        """The nodes of `path`, then one nested cluster per child module path."""
        indent = "  " * depth
        lines = [indent + line for line in self.clusters.get(path, [])]
        for child in sorted({_child(path, other) for other in self.clusters} - {None}, key=_natural):
            parts = child.split(".")
            label = ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]
            lines.append(f'{indent}subgraph "cluster_{_escape(child)}" {{')
            lines.append(
                f'{indent}  graph [label="{_escape(label)}", tooltip="{_escape(child)}", style=rounded, '
                f'color="#b0b0b0", fontcolor="#606060", fontsize=10];'
            )
            lines += self._clusters(child, depth + 1)
            lines.append(indent + "}")
        return lines


def _child(path: str, other: str) -> str | None:
    """The direct child of module `path` on the way to `other` ('' is the top level), or None."""
    if path and not other.startswith(path + "."):
        return None
    rest = other[len(path) + 1:] if path else other
    if not rest:
        return None
    return (f"{path}." if path else "") + rest.split(".")[0]


def _natural(path: str):
    """h.2 before h.10."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.split(".")]


def _node(node_id, label, shape="box", fill=OTHER_FILL, style=None, extra="", tooltip=None) -> str:
    attributes = [f'label="{_escape(label)}"', f"shape={shape}", f'fillcolor="{fill}"']
    if style:
        attributes.append(f'style="{style}"')
    if tooltip:
        attributes.append(f'tooltip="{_escape(tooltip)}"')
    if extra:
        attributes.append(extra)
    return f'"{_escape(node_id)}" [{", ".join(attributes)}];'


def _escape(text: str) -> str:
    """A DOT string's contents; '\\n' in labels stays a line break."""
    return text.replace('"', '\\"')


def _legend() -> list[str]:
    return [
        '  subgraph "cluster_legend" {',
        '    graph [label="legend", style=rounded, color="#b0b0b0", fontsize=10];',
        "    " + _node("legend: low", "runs in float16 / bfloat16", fill=FILL["bfloat16"]),
        "    " + _node("legend: fp32", "runs in float32", fill=FILL["float32"]),
        "    " + _node("legend: other", "integer / bool", fill=OTHER_FILL),
        "    " + _node("legend: cast", "inserted cast", **CAST_STYLE),
        "  }",
    ]


# -- running dot ------------------------------------------------------------------------------------------------

def find_dot() -> str:
    """graphviz-pure's program (installed next to Python, a --user or --target install), else Graphviz's dot."""
    folders = list(dict.fromkeys([
        sysconfig.get_path("scripts"),
        str(Path(sys.executable).parent),  # a venv used without activating it
        sysconfig.get_path("scripts", f"{os.name}_user"),
        # pip install --target DIR puts scripts in DIR/bin, and this file in DIR/graphamp/inspection/
        str(Path(__file__).resolve().parents[__name__.count(".")] / "bin"),
    ]))
    candidates = [shutil.which("graphviz-pure"), *(str(Path(f) / "graphviz-pure") for f in folders)]
    for candidate in [*candidates, shutil.which("dot")]:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise ExportError(
        "graph.svg needs Graphviz's dot and none was found (looked for graphviz-pure on PATH and in "
        f"{', '.join(folders)}, then dot on PATH). Fix: pip install graphviz-pure."
    )
