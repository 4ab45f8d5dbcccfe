"""export(): write what the cast pass did to files, for people and for tools: one folder for the ExportedProgram
export_program() returns, one a graph (graph_0, graph_1, ...) for a model rewrite() converted or a graphamp.backend.
The files (graph.py, graph.json, graph.svg, report.html, diff.txt): docs/inspect.md.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.fx import GraphModule

from graphamp.errors import ArgumentError, ExportError
from graphamp.frontends.compile_backend import AmpBackend
from graphamp.frontends.rewrite import is_rewritten, rewritten_graphs
from graphamp.inspection.graph_picture import render_svg
from graphamp.inspection.recording import DtypeRecorder
from graphamp.inspection.report_page import CastCounts, render_report
from graphamp.passes.cast_pass import CAST_OP, node_dtype
from graphamp.passes.marks import OpMark, mark_of
from graphamp.policy.dtypes import dtype_name
from graphamp.policy.lists import Decision, op_lookup_keys
from graphamp.torch_private import HigherOrderOperator, OpOverload, pytree

__all__ = ["FILES", "export", "made_folders_removed_on_failure"]

FILES = ("graph.py", "graph.json", "graph.svg", "report.html", "diff.txt")


def export(what, out_dir, example_args=None, example_kwargs=None, overwrite: bool = False, model=None) -> Path:
    """Write graph.py, graph.json, graph.svg, report.html and diff.txt for what graphamp rewrote: into `out_dir`
    for an ExportedProgram, into out_dir/graph_0, graph_1, ... for a rewritten model or a backend (docs/inspect.md).

    Args:
        what: the ExportedProgram graphamp.export_program() returned, a model graphamp.rewrite() converted (and
            called at least once), or the graphamp.backend(...) a torch.compile'd model ran.
        out_dir: the folder to write (created if missing).
        example_args, example_kwargs: a call of the program for the reruns (default: the program's
            example_inputs, those it was exported on).
        overwrite: replace the files of an earlier export in `out_dir`; without it they are an ExportError.
        model: the FP32 nn.Module the program was exported from, for torch.autocast's count.

    Returns:
        The folder.
    """
    out = Path(out_dir)
    if isinstance(example_args, list) or not isinstance(example_kwargs, (dict, type(None))) or \
            not isinstance(model, (nn.Module, type(None))):
        raise ArgumentError(
            f"export() got example_args as a {type(example_args).__name__}, example_kwargs as a "
            f"{type(example_kwargs).__name__} and model as a {type(model).__name__}; pass a tuple of positional "
            f"arguments ((x,), or ([x, y],) for one list), a dict of keyword arguments and the FP32 nn.Module."
        )
    if isinstance(what, ExportedProgram):
        with made_folders_removed_on_failure(out):
            return _export_program(what, out, example_args, example_kwargs, overwrite, model)
    if isinstance(what, AmpBackend) or is_rewritten(what):
        graphs = rewritten_graphs(what)
        with made_folders_removed_on_failure(out, *(out / f"graph_{i}" for i in range(len(graphs)))):
            return _export_graphs(what, graphs, out, overwrite)
    raise ArgumentError(
        f"export() takes the ExportedProgram graphamp.export_program() returns, a model graphamp.rewrite() "
        f"converted, or a graphamp.backend; got a {type(what).__name__}. For an FP32 model: "
        f"graphamp.export(graphamp.export_program(model, example_args), out_dir, model=model)."
    )


def _export_program(program: ExportedProgram, out: Path, example_args, example_kwargs, overwrite, model) -> Path:
    graph_module = program.graph_module
    report = graph_module.meta.get("graphamp_report")
    if report is None:
        raise ArgumentError(
            "export() got an ExportedProgram without graphamp's report: make it with graphamp.export_program() "
            "(torch.export.load does not keep the report; export the program before saving it)."
        )
    inputs = program.example_inputs  # export_program() keeps the (args, kwargs) it exported on
    if example_args is not None or example_kwargs is not None:
        args = example_args if isinstance(example_args, tuple) else (() if example_args is None else (example_args,))
        inputs = (args, dict(example_kwargs or {}))
    check_out_dir(out, overwrite)
    signature = program.graph_signature
    state = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    user_inputs = set(signature.user_inputs)
    lifted = [n for n in graph_module.graph.find_nodes(op="placeholder") if n.name not in user_inputs]
    name = type(model).__name__ if model is not None else "exported program"
    _write(out, graph_files(
        name, graph_module, report, graph_module.meta.get("graphamp_original_code", ""), lifted, state,
        lambda: count_executed_casts(program, model, inputs, report.dtype),
    ))
    return out


def _export_graphs(what, graphs, out: Path, overwrite: bool) -> Path:
    """One folder a graph, graph_0, graph_1, ... in the order dynamo compiled them."""
    if not graphs:
        raise ArgumentError(
            f"export() got a {type(what).__name__} with no rewritten graph yet: call the model once (or rewrite it "
            f"with example inputs) before exporting its graphs."
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: is a file, not a folder; pass a folder for the export (created if missing).")
    folders = [out / f"graph_{i}" for i in range(len(graphs))]
    for folder in folders:
        check_out_dir(folder, overwrite)
    for stale in out.glob("graph_*") if overwrite else ():  # an earlier export's extra graphs are no graphs of this
        if stale not in folders and stale.is_dir() and {f.name for f in stale.iterdir()} <= set(FILES):
            shutil.rmtree(stale)
    name = "torch.compile" if isinstance(what, AmpBackend) else type(what).__name__
    for i, (folder, graph) in enumerate(zip(folders, graphs)):
        placeholders = graph.graph_module.graph.find_nodes(op="placeholder")
        lifted = [n for n in placeholders if n.name in graph.parameter_placeholders]
        in_graph = sum(n.target == CAST_OP for n in graph.graph_module.graph.nodes)
        not_rerun = CastCounts(in_graph, None, "a torch.compile graph is not rerun", "a torch.compile graph is "
                               "not rerun; graphamp's count is the cast nodes in the graph")
        _write(folder, graph_files(
            f"{name} graph {i}", graph.graph_module, graph.report, graph.original_code, lifted,
            graph.parameter_placeholders, lambda: not_rerun,
        ))
    return out


def graph_files(model_name, graph_module, report, original_code, lifted, parameter_names, casts) -> dict[str, str]:
    """{file name: text} of one rewritten graph; `casts()` counts the casts for report.html."""
    graphs = sub_graphs(graph_module)
    records = [record for path, sub_graph in graphs for record in node_records(sub_graph, path)]
    summary = {
        "model": model_name,
        "dtype": dtype_name(report.dtype),
        "level": report.level,
        "casts": report.casts_inserted,
        "unlisted_ops": dict(report.unlisted_ops.most_common()),
        "nodes": records,
    }
    svg = render_svg(graphs, records, lifted, parameter_names, _title(summary))
    return {
        "graph.py": _header(summary) + marked_code(graphs),
        "graph.json": json.dumps(summary, indent=1) + "\n",
        "graph.svg": svg,
        "report.html": render_report(summary, svg, casts(), _title(summary)),
        "diff.txt": graph_diff(original_code, graph_module, summary),
    }


def _write(out: Path, texts: dict[str, str]) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (out / name).write_text(text, encoding="utf-8")
    except OSError as error:
        raise ExportError(f"{out}: cannot write the export there ({error}); pass a folder you can write to.") from error


@contextmanager
def made_folders_removed_on_failure(*folders: Path):
    """If the block raises, remove what it made of `folders`: the outermost of each that did not exist before. A
    failed export (or `graphamp` command) leaves no empty or partial folder behind; one that existed is kept."""
    made = []
    for folder in map(Path, folders):
        missing = [path for path in (folder, *folder.parents) if not os.path.lexists(path)]
        if missing:
            made.append(missing[-1])
    try:
        yield
    except BaseException:  # Ctrl-C too
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Create out_dir, or raise ExportError before any work: it is a file, holds an earlier export, or cannot be
    created."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: is a file, not a folder; pass a folder for the export (created if missing).")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ExportError(
            f"{out}: cannot create the folder ({error.strerror}); pass a folder you can write to."
        ) from error
    existing = [name for name in FILES if (out / name).exists()]
    if existing and not overwrite:
        raise ExportError(
            f"{out / existing[0]}: already exists; pass overwrite=True (graphamp export --force) to replace "
            f"the earlier export, or name a new folder."
        )


def sub_graphs(graph_module: GraphModule, path: tuple = ()) -> list[tuple[tuple, GraphModule]]:
    """The graph and the bodies of its higher-order ops (torch.cond branches, ...), by attribute path."""
    found = [(path, graph_module)]
    for node in graph_module.graph.find_nodes(op="get_attr"):
        body = getattr(graph_module, node.target)
        if isinstance(body, GraphModule):
            found += sub_graphs(body, path + (node.target,))
    return found


def node_records(graph_module: GraphModule, path: tuple = ()) -> list[dict]:
    """graph.json's record of every node the cast pass decided on; sub-graph nodes are named `body.node`."""
    prefix = "".join(f"{part}." for part in path)
    records = []
    for node in graph_module.graph.nodes:
        mark = mark_of(node)
        # torch.export shares one meta dict between a no_grad region's last op and the getitem reading it out.
        if mark is None or not isinstance(node.target, (OpOverload, HigherOrderOperator)):
            continue
        outputs = [t for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
        records.append({
            "name": prefix + node.name,
            "op": op_lookup_keys(node.target)[0] if isinstance(node.target, OpOverload) else node.target.__name__,
            "decision": mark.decision,
            "source": mark.source,
            "in_dtypes": [dtype_name(d) for d in map(node_dtype, node.all_input_nodes) if d is not None],
            "out_dtype": dtype_name(outputs[0].dtype) if outputs else None,
            "module": mark.module,
        })
    return records


# -- graph.py and diff.txt -----------------------------------------------------------------------------------

_CLASS_LINE = re.compile(r"^( *)class (\w+)\(torch\.nn\.Module\):")
_ASSIGNMENT = re.compile(r"^ *(\w+)(?:: \"[^\"]*\")? = ")


def marked_code(graphs: list[tuple[tuple, GraphModule]]) -> str:
    """fx's readable code of the graph, each decided op line ending with `# graphamp: ...`."""
    nodes = {path: {n.name: n for n in graph_module.graph.nodes} for path, graph_module in graphs}
    root = graphs[0][1]
    lines, classes = [], []
    for line in root.print_readable(print_output=False).splitlines():
        # Sub-graph bodies print as nested classes named after their attribute; node names repeat across them.
        if match := _CLASS_LINE.match(line):
            classes = classes[: len(match[1]) // 4] + [match[2]]
        elif match := _ASSIGNMENT.match(line):
            node = nodes.get(tuple(classes[1:]), {}).get(match[1])
            mark = mark_of(node) if node is not None else None
            if mark is not None:
                line += f"  # graphamp: {_describe(mark)}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _describe(mark: OpMark) -> str:
    if mark.decision == Decision.INSERTED_CAST:
        return f"inserted cast to {mark.source}"
    return f"{mark.decision} ({mark.source})" if mark.source else str(mark.decision)


def _title(summary: dict) -> str:
    return f"{summary['model']} · {summary['dtype']} · {summary['level']} · {summary['casts']} casts inserted"


def _header(summary: dict) -> str:
    return (
        f"# graphamp: the rewritten graph of {_title(summary)}.\n"
        f"# Each op line ends with its decision and the list line (or argument) it came from; 'inserted cast'\n"
        f"# marks the casts graphamp added. Placeholders p_*/b_*/c_* are the model's parameters, buffers and\n"
        f"# constants, fed on every call; the user's inputs follow them.\n"
        f"import torch\n\n\n"
    )


def graph_diff(original_code: str, graph_module: GraphModule, summary: dict) -> str:
    """A unified diff of the graph's code as captured and as rewritten (comment and blank lines left out)."""
    def code_lines(code):
        return [line + "\n" for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]

    return "".join(difflib.unified_diff(
        code_lines(original_code),
        code_lines(graph_module.print_readable(print_output=False)),
        fromfile="captured (torch.export)",
        tofile=f"rewritten (graphamp {summary['dtype']} {summary['level']})",
        n=1,
    ))


# -- casts executed: graphamp vs torch.autocast ----------------------------------------------------------------

def count_executed_casts(program: ExportedProgram, model, inputs: tuple, dtype: torch.dtype) -> CastCounts:
    """Casts executed by the program's module and, given the FP32 `model`, by torch.autocast on it, on `inputs`
    (args, kwargs): forward, and backward by torch.autograd.grad (no `.grad` touched) when it returns a scalar loss
    and its backward runs."""
    args, kwargs = inputs
    module = program.module()
    with _state_kept(module), _state_kept(model) if model is not None else nullcontext():
        try:
            graphamp, forward_only = _casts_of(module, args, kwargs, nullcontext())
        except Exception as error:  # the program checks its inputs' shapes and structure as it was exported
            raise ArgumentError(
                f"export(): the program cannot run on the example inputs ({_first_line(error)}); pass "
                f"example_args/example_kwargs of one call that fits it, or none to rerun it on those it was exported on."
            ) from error
        if model is None:
            return CastCounts(graphamp, None, forward_only, "pass model= (the FP32 model) to graphamp.export to count "
                              "them")
        control_flow = _control_flow_ops(program.graph_module)
        if control_flow:
            # In torch 2.13 they fail under autocast and a dispatch mode, and leave dynamo unable to export them again.
            return CastCounts(graphamp, None, forward_only, f"{', '.join(control_flow)} cannot run under "
                              f"torch.autocast while kernels are recorded (torch {torch.__version__})")
        device = next(model.parameters(), torch.empty(0)).device
        try:
            autocast, autocast_forward_only = _casts_of(model, args, kwargs, torch.autocast(device.type, dtype),
                                                        backward=not forward_only)
        except Exception as error:  # the comparison informs; a model autocast cannot run still gets its files
            return CastCounts(graphamp, None, forward_only, f"it failed with {_first_line(error)}")
        if autocast_forward_only and not forward_only:  # counts of different passes do not compare
            return CastCounts(graphamp, None, forward_only, autocast_forward_only)
    return CastCounts(graphamp, autocast, forward_only)


def _control_flow_ops(graph_module: GraphModule) -> list[str]:
    """torch.cond, while_loop, ...: higher-order ops the original model runs as such (not no_grad regions)."""
    return sorted({
        node.target.__name__
        for _, body in sub_graphs(graph_module)
        for node in body.graph.nodes
        if isinstance(node.target, HigherOrderOperator) and not node.target.__name__.startswith("wrap_with_")
    })


def _casts_of(model, args, kwargs, autocast, backward: bool = True) -> tuple[int, str]:
    """The casts a call of `model` executes, with its backward when it returns a scalar loss, and why the backward
    was not counted ("" when it was)."""
    with DtypeRecorder() as recorder:
        with autocast:
            output = model(*args, **kwargs)
        scalars = (t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.dim() == 0)
        loss = next((t for t in scalars if t.is_floating_point() and t.requires_grad), None)
        parameters = [p for p in model.parameters() if p.requires_grad]
        if loss is None or not parameters or not backward:
            return recorder.casts, "the model returns no scalar loss" if backward else "not asked for"
        forward = recorder.casts
        try:
            torch.autograd.grad(loss, parameters, allow_unused=True)
        except RuntimeError as error:  # an inference-only model: a custom op with no autograd formula
            return forward, f"its backward failed with {_first_line(error)}"
    return recorder.casts, ""


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


@contextmanager
def _state_kept(model):
    """Undo what running the model changes: BatchNorm statistics, RNG state (dropout), train/eval modes."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    tensors = [*model.parameters(), *model.buffers()]
    devices = sorted({t.device.index for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            for module, training in modes:
                module.training = training
