"""export(): the five files, what they say, and that what they say is what runs.

GPT-2 (2 layers, the transformers model of the core tests) goes through graphamp.export_program for bfloat16 and
is exported once per module; the other tests build their own small model. A model rewrite() converted is
exported a folder per graph.
"""

import ast
import json
import re
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from html.parser import HTMLParser

import pytest
import torch
from torch import nn

import graphamp
from graphamp.inspection.export_files import FILES
from graphamp.inspection.graph_picture import find_dot
from graphamp.inspection.recording import DtypeRecorder, floating
from graphamp.passes.marks import mark_of
from models import CustomOpModel, RegionsModel, SmallResNet, gpt2, token_batch
from training import relative_error

FIELDS = {"name", "op", "decision", "source", "in_dtypes", "out_dtype", "module"}
DECISIONS = {"white", "black", "gray", "unlisted", "explicit-cast", "inserted-cast", "higher-order"}
SVG = "{http://www.w3.org/2000/svg}"
# Composite ops of the graph that execute as one kernel of another name.
KERNEL_OF = {"layer_norm": "native_layer_norm"}


def gpt2_inputs():
    ids = token_batch()
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def gpt2_export(bf16, tmp_path_factory):
    """(2-layer GPT-2's program for bfloat16, its export folder, graph.json)."""
    torch.manual_seed(0)
    model = gpt2(n_layer=2)
    program = graphamp.export_program(model, (), gpt2_inputs(), amp_lists=bf16)
    out = graphamp.export(program, tmp_path_factory.mktemp("gpt2"), model=model)
    return program, out, json.loads((out / "graph.json").read_text())


def export_of(model, args, tmp_path, amp_lists):
    program = graphamp.export_program(model, args, amp_lists=amp_lists)
    out = graphamp.export(program, tmp_path, model=model)
    return program, out, json.loads((out / "graph.json").read_text())


def name(dtype):
    return str(dtype).removeprefix("torch.")


def inserted_casts(summary):
    return [node for node in summary["nodes"] if node["decision"] == "inserted-cast"]


def svg_titles(path):
    return {title.text for title in ElementTree.parse(path).iter(f"{SVG}title")}


def svg_text(path):
    return " ".join(text.text or "" for text in ElementTree.parse(path).iter(f"{SVG}text"))


# -- the files -------------------------------------------------------------------------------------------------

def test_export_writes_the_five_files_and_each_parses(gpt2_export):
    _, out, _ = gpt2_export

    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    ast.parse((out / "graph.py").read_text())
    ElementTree.parse(out / "graph.svg")
    HTMLParser().feed((out / "report.html").read_text())
    diff = (out / "diff.txt").read_text()
    assert diff.startswith("--- captured (torch.export)\n+++ rewritten (graphamp bfloat16 O1)")


def test_graph_json_names_dtype_level_and_cast_count(gpt2_export):
    program, _, summary = gpt2_export
    report = program.graph_module.meta["graphamp_report"]

    assert (summary["dtype"], summary["level"]) == ("bfloat16", "O1")
    assert summary["casts"] == report.casts_inserted == len(inserted_casts(summary)) > 0


def test_every_graph_json_node_has_the_fields(gpt2_export):
    _, _, summary = gpt2_export

    for node in summary["nodes"]:
        assert set(node) == FIELDS, node
        assert node["decision"] in DECISIONS, node


def test_graph_json_sources_name_the_list_line_and_modules_the_module_path(gpt2_export):
    _, _, summary = gpt2_export
    (lm_head,) = [n for n in summary["nodes"] if n["op"] == "linear.default"]
    first_gemm = next(n for n in summary["nodes"] if n["op"] == "addmm.default")

    assert re.fullmatch(r"lists/white\.txt:\d+", lm_head["source"])
    assert lm_head["module"] == "lm_head"
    assert first_gemm["module"] == "transformer.h.0.attn.c_attn"


def test_graph_json_decisions_match_the_dtypes_that_execute(gpt2_export):
    program, _, summary = gpt2_export
    module = program.module()
    with DtypeRecorder() as recorder:
        module(**gpt2_inputs())
    recorded = defaultdict(list)
    for call in recorder.calls:
        recorded[call.op].append(call)
    in_graph = defaultdict(list)
    for node in summary["nodes"]:
        in_graph[node["op"].partition(".")[0]].append(node)

    # Ops that run as one kernel each, with as many kernel calls as graph nodes: compare node by node, in order.
    compared = {}
    for op, nodes in in_graph.items():
        calls = recorded[KERNEL_OF.get(op, op)]
        if len(calls) == len(nodes):
            for node, call in zip(nodes, calls):
                assert {name(d) for d in floating(call.in_dtypes)} == {
                    d for d in node["in_dtypes"] if d.startswith(("float", "bfloat"))
                }, (node, call)
                assert name(call.out_dtypes[0]) == node["out_dtype"], (node, call)
            compared[op] = nodes[0]["decision"]

    assert compared["addmm"] == "white", compared
    assert {n["in_dtypes"][0] for n in in_graph["addmm"]} == {"bfloat16"}
    # gray: GPT-2's norms read the FP32 residual stream (embeddings + attention output promote to FP32)
    assert compared["layer_norm"] == "gray" and {n["in_dtypes"][0] for n in in_graph["layer_norm"]} == {"float32"}


def test_graph_py_marks_every_inserted_cast(gpt2_export):
    _, out, summary = gpt2_export
    code = (out / "graph.py").read_text()

    marked = re.findall(r"^\s*(\w+)\b.*# graphamp: inserted cast to ", code, flags=re.M)

    assert sorted(marked) == sorted(node["name"] for node in inserted_casts(summary))


def test_diff_adds_every_inserted_cast(gpt2_export):
    _, out, summary = gpt2_export
    added = [line for line in (out / "diff.txt").read_text().splitlines() if line.startswith("+ ")]

    casts = [line for line in added if "= torch.ops.aten._to_copy.default(" in line]

    assert len(casts) == summary["casts"]


# -- the picture -----------------------------------------------------------------------------------------------

def test_svg_names_every_inserted_cast(bf16, tmp_path):
    _, out, summary = export_of(SmallResNet(), (torch.randn(2, 1, 8, 8),), tmp_path, bf16)

    titles = svg_titles(out / "graph.svg")

    assert {node["name"] for node in inserted_casts(summary)} <= titles
    assert "cluster_layer1.conv1" in titles  # modules are clusters


def test_svg_draws_the_first_repeated_block_in_full_and_summarises_the_rest(gpt2_export):
    _, out, summary = gpt2_export
    casts_in = defaultdict(set)
    for node in inserted_casts(summary):
        casts_in[node["module"].startswith("transformer.h.1")].add(node["name"])

    titles, text = svg_titles(out / "graph.svg"), svg_text(out / "graph.svg")

    assert casts_in[False] <= titles and not casts_in[True] & titles
    per_block = len([n for n in inserted_casts(summary) if n["module"].startswith("transformer.h.0.")])
    assert "h.1: same as h.0" in text and f"({per_block} casts each)" in text


def test_svg_of_a_deeper_gpt2_has_no_more_nodes(bf16, gpt2_export, tmp_path):
    _, out, _ = gpt2_export
    torch.manual_seed(0)
    program = graphamp.export_program(gpt2(n_layer=4), (), gpt2_inputs(), amp_lists=bf16)

    deeper = graphamp.export(program, tmp_path)

    def node_count(path):
        return sum(1 for g in ElementTree.parse(path).iter(f"{SVG}g") if g.get("class") == "node")

    assert node_count(deeper / "graph.svg") == node_count(out / "graph.svg")
    assert "h.1–h.3: same as h.0" in svg_text(deeper / "graph.svg")


def test_a_block_kept_fp32_by_black_modules_is_drawn_in_full(tmp_path):
    torch.manual_seed(0)
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16", custom_black_modules=["transformer.h.1", "lm_head"])
    program = graphamp.export_program(gpt2(n_layer=4), (), gpt2_inputs(), amp_lists=lists)

    out = graphamp.export(program, tmp_path)

    summary = json.loads((out / "graph.json").read_text())
    (lm_head,) = [n for n in summary["nodes"] if n["op"] == "linear.default"]
    assert (lm_head["decision"], lm_head["source"], lm_head["out_dtype"]) == (
        "black", "custom_black_modules: lm_head", "float32"
    )
    titles, text = svg_titles(out / "graph.svg"), svg_text(out / "graph.svg")
    assert {"cluster_transformer.h.0", "cluster_transformer.h.1", "cluster_transformer.h.2"} <= titles
    assert "cluster_transformer.h.3" not in titles
    assert "h.3: same as h.2" in text


def test_sub_graph_nodes_are_named_after_their_body(bf16, tmp_path):
    _, out, summary = export_of(RegionsModel(), (torch.randn(4, 8),), tmp_path, bf16)
    names = {node["name"] for node in summary["nodes"]}

    assert {"true_graph_0.linear", "false_graph_0.linear"} <= names
    assert {n["name"] for n in inserted_casts(summary) if n["name"].startswith("true_graph_0.")} <= svg_titles(
        out / "graph.svg"
    )
    assert "cluster_true_graph_0: body of cond" in svg_titles(out / "graph.svg")
    code = (out / "graph.py").read_text()
    ast.parse(code)
    assert "class true_graph_0(torch.nn.Module):" in code
    assert "not measured: cond cannot run under torch.autocast" in (out / "report.html").read_text()


def test_find_dot_finds_graphviz_pure():
    assert find_dot().endswith(("graphviz-pure", "dot"))


def test_find_dot_finds_graphviz_pure_of_a_pip_install_target(tmp_path, monkeypatch):
    """pip install --target DIR puts graphamp in DIR/graphamp and graphviz-pure's program in DIR/bin."""
    import graphamp.inspection.graph_picture as graph_picture

    program = tmp_path / "bin" / "graphviz-pure"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    elsewhere = str(tmp_path / "nowhere")
    monkeypatch.setattr(graph_picture, "__file__", str(tmp_path / "graphamp" / "inspection" / "graph_picture.py"))
    monkeypatch.setattr(graph_picture.shutil, "which", lambda name: None)
    monkeypatch.setattr(graph_picture.sysconfig, "get_path", lambda *args: elsewhere)
    monkeypatch.setattr(graph_picture.sys, "executable", str(tmp_path / "nowhere" / "python"))

    assert find_dot() == str(program)


def test_export_without_graphviz_says_how_to_install_it(bf16, tmp_path, monkeypatch):
    program = graphamp.export_program(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=bf16)
    monkeypatch.setattr("graphamp.inspection.graph_picture.os.access", lambda path, mode: False)

    with pytest.raises(graphamp.ExportError, match="pip install graphviz-pure"):
        graphamp.export(program, tmp_path)


# -- the page --------------------------------------------------------------------------------------------------

def test_report_is_one_page_without_network(gpt2_export):
    _, out, _ = gpt2_export
    page = (out / "report.html").read_text()

    assert "<svg" in page and "<?xml" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<script" not in page and "<link" not in page


def test_report_tables_each_op_with_dtype_decision_and_source(gpt2_export):
    _, out, summary = gpt2_export
    page = (out / "report.html").read_text()
    gemms = sum(node["op"] == "addmm.default" for node in summary["nodes"])
    norms = sum(node["op"] == "layer_norm.default" for node in summary["nodes"])

    assert re.search(
        rf"<td><code>addmm\.default</code></td><td class=n>{gemms}</td><td>bfloat16</td><td>white</td>"
        r"<td>lists/white\.txt:\d+</td>", page
    )
    assert re.search(
        rf"<td><code>layer_norm\.default</code></td><td class=n>{norms}</td><td>float32</td><td>gray</td>", page
    )


def test_report_counts_casts_forward_and_backward_against_torch_autocast(gpt2_export):
    _, out, _ = gpt2_export
    page = (out / "report.html").read_text()

    graphamp_casts = int(re.search(r"graphamp \(the rewritten graph\)</td><td class=n>(\d+)", page)[1])
    autocast_casts = int(re.search(r"torch\.autocast on the original model</td><td class=n>(\d+)", page)[1])

    assert "Counted: forward and backward" in page
    assert graphamp_casts > 0 and autocast_casts > 0


def test_report_lists_the_unlisted_ops(bf16, tmp_path):
    _, out, summary = export_of(CustomOpModel(), (torch.randn(4, 8),), tmp_path, bf16)

    assert summary["unlisted_ops"] == {"graphamp_test::scaled_tanh": 1}
    assert "<code>graphamp_test::scaled_tanh</code>" in (out / "report.html").read_text()


def test_report_counts_forward_only_when_the_model_returns_no_loss(bf16, tmp_path):
    _, out, _ = export_of(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),), tmp_path, bf16)

    assert "Counted: forward only" in (out / "report.html").read_text()


@torch.library.custom_op("graphamp_test_export::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:  # no autograd formula: an inference-only op
    return x * 2


doubled.register_fake(torch.empty_like)


class InferenceOnlyLoss(nn.Linear):
    def forward(self, x):
        return doubled(super().forward(x)).sum()


@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_report_counts_forward_only_when_the_loss_has_no_backward(bf16, tmp_path, with_model):
    model = InferenceOnlyLoss(4, 4)
    program = graphamp.export_program(model, (torch.randn(2, 4),), amp_lists=bf16)

    page = (graphamp.export(program, tmp_path, model=model if with_model else None) / "report.html").read_text()

    assert ("Counted: forward only (its backward failed with RuntimeError: Trying to backward through "
            "graphamp_test_export.doubled.default but no autograd formula was registered") in page
    assert int(re.search(r"graphamp \(the rewritten graph\)</td><td class=n>(\d+)", page)[1]) > 0
    assert bool(re.search(r"torch\.autocast on the original model</td><td class=n>\d", page)) is with_model


class RefusesAutocast(nn.Linear):
    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("this model does not run under autocast")
        return super().forward(x)


def test_report_says_so_when_torch_autocast_cannot_run_the_model(bf16, tmp_path):
    _, out, _ = export_of(RefusesAutocast(4, 4), (torch.randn(2, 4),), tmp_path, bf16)

    assert "not measured: it failed with RuntimeError: this model does not run under autocast" in (
        out / "report.html"
    ).read_text()


def test_report_without_the_fp32_model_counts_graphamp_casts_only(bf16, tmp_path):
    program = graphamp.export_program(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=bf16)

    page = (graphamp.export(program, tmp_path) / "report.html").read_text()

    assert "not measured: pass model= (the FP32 model)" in page
    assert int(re.search(r"graphamp \(the rewritten graph\)</td><td class=n>(\d+)", page)[1]) > 0


def test_report_reruns_the_program_on_the_example_args_given(bf16, tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1), nn.Flatten(0))
    program = graphamp.export_program(model, (torch.randn(4, 8),), amp_lists=bf16)

    # the static program meets the batch given: a typed error naming torch's guard
    with pytest.raises(graphamp.ArgumentError, match=r"cannot run on the example inputs \(AssertionError: .*"
                                                     r"size\(\)\[0\] == 4"):
        graphamp.export(program, tmp_path / "a", example_args=(torch.randn(3, 8),), model=model)
    page = (graphamp.export(program, tmp_path / "b", example_args=(torch.randn(4, 8),), model=model) / "report.html")

    assert re.search(r"torch\.autocast on the original model</td><td class=n>[1-9]", page.read_text())


def test_export_leaves_the_model_as_it_was(bf16, tmp_path):
    model = SmallResNet().train()
    program = graphamp.export_program(model, (torch.randn(4, 1, 8, 8),), amp_lists=bf16)
    before = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.random.get_rng_state()

    graphamp.export(program, tmp_path, model=model)

    assert all(torch.equal(before[name], b) for name, b in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert model.training


def test_export_refuses_what_graphamp_did_not_convert(tmp_path):
    with pytest.raises(graphamp.ArgumentError, match="graphamp.export_program"):
        graphamp.export(nn.Linear(2, 2), tmp_path)


def test_export_of_a_program_torch_export_made_says_to_use_export_program(tmp_path):
    program = torch.export.export(nn.Linear(2, 2), (torch.randn(1, 2),))

    with pytest.raises(graphamp.ArgumentError, match="make it with graphamp.export_program"):
        graphamp.export(program, tmp_path)


# -- the program after torch.export.save / load ------------------------------------------------------------

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)), torch.randn(8, 16)


def test_saved_and_loaded_program_keeps_the_decisions_and_runs_close_to_fp32(bf16, tmp_path):
    model, x = mlp()
    program = graphamp.export_program(model, (x,), amp_lists=bf16)
    decisions = {n.name: n.meta["custom"]["graphamp"] for n in program.graph.nodes if mark_of(n) is not None}
    torch.export.save(program, tmp_path / "mlp.pt2")

    loaded = torch.export.load(tmp_path / "mlp.pt2")

    kept = {n.name: n.meta.get("custom", {}).get("graphamp") for n in loaded.graph.nodes}
    assert decisions and {name: kept.get(name) for name in decisions} == decisions
    assert {d["decision"] for d in decisions.values()} >= {"white", "inserted-cast"}
    with torch.no_grad():
        out, fp32 = loaded.module()(x), model(x)
    assert out.dtype == torch.float32
    assert 0 < relative_error(out, fp32) < 2e-2  # bfloat16's error, not FP32's nor a wrong graph's


def test_aotinductor_compiles_the_program_for_deployment_with_its_casts(bf16, tmp_path):
    model, x = mlp()
    model.eval()
    program = graphamp.export_program(model, (x,), amp_lists=bf16)
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "mlp.pt2"))

    deployed = torch._inductor.aoti_load_package(package)

    with torch.no_grad():
        out, program_out, fp32 = deployed(x), program.module()(x), model(x)
    assert out.dtype == torch.float32
    assert relative_error(out, program_out) < 1e-2  # the program as compiled ahead ...
    assert 0 < relative_error(out, fp32) < 2e-2  # ... in bfloat16, not FP32


# -- a model rewrite() converted: a folder per graph -----------------------------------------------------------

class BrokenInTwo(nn.Module):
    """Two graphs: dynamo breaks the graph at the print."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        print("between the graphs")
        return self.b(h)


def test_export_of_a_rewritten_model_writes_a_folder_per_graph(bf16, tmp_path, capsys):
    model = graphamp.rewrite(BrokenInTwo(), (torch.randn(4, 8),), amp_lists=bf16)
    graphs = graphamp.rewritten_graphs(model)

    out = graphamp.export(model, tmp_path / "graphs")

    assert len(graphs) == 2
    assert sorted(p.name for p in out.iterdir()) == ["graph_0", "graph_1"]
    for i, graph in enumerate(graphs):
        assert sorted(p.name for p in (out / f"graph_{i}").iterdir()) == sorted(FILES)
        summary = json.loads((out / f"graph_{i}" / "graph.json").read_text())
        assert summary["model"] == f"BrokenInTwo graph {i}"
        assert summary["casts"] == graph.report.casts_inserted == len(inserted_casts(summary)) > 0
        assert "white" in {n["decision"] for n in summary["nodes"]}



def test_an_export_over_one_of_more_graphs_leaves_no_folder_of_a_graph_the_model_lacks(bf16, tmp_path):
    graphamp.export(graphamp.rewrite(BrokenInTwo(), (torch.randn(4, 8),), amp_lists=bf16), tmp_path / "graphs")
    one_graph = graphamp.rewrite(nn.Linear(8, 8), (torch.randn(4, 8),), amp_lists=bf16)

    out = graphamp.export(one_graph, tmp_path / "graphs", overwrite=True)

    assert sorted(p.name for p in out.iterdir()) == ["graph_0"]

def test_export_of_a_rewritten_model_that_has_not_run_asks_for_a_call(bf16, tmp_path):
    model = graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16)

    with pytest.raises(graphamp.ArgumentError, match="call the model once"):
        graphamp.export(model, tmp_path)
