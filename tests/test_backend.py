"""graphamp.backend: torch.compile's dynamo captures, graphamp's lists and cast pass decide the dtypes (issue 24)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from graphamp.inspection.recording import DtypeRecorder, floating, recording_inside
from graphamp.passes.marks import mark_of
from models import deberta_v2, llama, token_batch

BF16_TOLERANCE = 3e-2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no guards, caches or automatic-dynamic decisions carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Branchy(nn.Module):
    """Python control flow on a tensor's value: torch.export cannot capture it, dynamo breaks the graph there."""

    def __init__(self, threshold=0.0):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 32)
        self.down = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.threshold = threshold

    def forward(self, x):
        h = self.norm(F.gelu(self.inp(x)))
        if h.abs().mean() > self.threshold:
            h = h + self.up(h).relu()
        else:
            h = h - self.down(h).tanh()
        return self.head(h)


def close(actual, expected, tolerance=BF16_TOLERANCE) -> bool:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item() < tolerance


def test_data_dependent_branch_runs_both_ways_with_its_matmuls_low(bf16):
    torch.manual_seed(0)
    model = Branchy()
    recorder = DtypeRecorder()
    compiled = torch.compile(model, backend=recording_inside(graphamp.backend(bf16, inductor=False), recorder))
    x = torch.randn(8, 16)
    for threshold in (-1e9, 1e9):  # one call down each branch
        model.threshold = threshold
        recorder.calls.clear()
        out = compiled(x)
        products = recorder.calls_of("addmm", "mm", "linear")
        assert len(products) == 3  # inp, one branch's GEMM, head: all of them low
        assert all(floating(call.in_dtypes) == {torch.bfloat16} for call in products)
        assert out.dtype == torch.float32
        assert close(out, model(x))


def test_inductor_compiles_the_rewritten_graphs_with_their_matmuls_low(bf16):
    torch.manual_seed(0)
    model = Branchy()
    amp_backend = graphamp.backend(bf16)
    x = torch.randn(8, 16)
    out = torch.compile(model, backend=amp_backend)(x)
    linears = [
        node for graph in amp_backend.graphs for node in graph.graph_module.graph.nodes
        if node.target == torch.ops.aten.linear.default
    ]
    assert len(linears) == 3
    assert all(node.meta["val"].dtype == torch.bfloat16 for node in linears)
    assert all("inductor" in graph.timings for graph in amp_backend.graphs)
    assert close(out, model(x))


def test_reports_hold_one_report_per_graph_dynamo_compiled(bf16):
    model = Branchy()
    amp_backend = graphamp.backend(bf16, inductor=False)
    torch.compile(model, backend=amp_backend)(torch.randn(4, 16))
    assert len(amp_backend.reports) == len(amp_backend.graphs) >= 2  # the graph break at the `if` splits it
    assert all(isinstance(report, graphamp.RewriteReport) for report in amp_backend.reports)
    assert all(report.dtype == torch.bfloat16 and report.decisions["white"] >= 1 for report in amp_backend.reports)
    assert sum(report.casts_inserted for report in amp_backend.reports) > 0


def test_black_modules_match_the_models_own_paths(bf16):
    amp_backend = graphamp.backend(bf16.with_changes(black_modules=["head"]), inductor=False)
    torch.compile(Branchy(), backend=amp_backend)(torch.randn(4, 16))
    linears = {
        mark_of(node).module: node.meta["val"].dtype
        for graph in amp_backend.graphs for node in graph.graph_module.graph.nodes
        if node.target == torch.ops.aten.linear.default
    }
    assert linears == {"inp": torch.bfloat16, "up": torch.bfloat16, "head": torch.float32}


def test_master_gradients_are_fp32_and_close_to_eager(bf16):
    torch.manual_seed(0)
    model = Branchy()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    torch.compile(model, backend=graphamp.backend(bf16, inductor=False))(x).square().mean().backward()
    reference(x).square().mean().backward()
    for parameter, expected in zip(model.parameters(), reference.parameters()):
        if expected.grad is None:
            assert parameter.grad is None
            continue
        assert parameter.dtype == parameter.grad.dtype == torch.float32
        assert close(parameter.grad, expected.grad, 5e-2)


def test_value_reading_forward_hook_registered_before_compiling_runs_on_every_call_with_eager_values(bf16):
    torch.manual_seed(0)
    model = Branchy()
    seen = []
    model.norm.register_forward_hook(lambda module, args, output: seen.append(output.abs().mean().item()))
    compiled = torch.compile(model, backend=graphamp.backend(bf16, inductor=False))
    inputs = [torch.randn(8, 16) for _ in range(3)]
    for x in inputs:
        compiled(x)
    compiled_values, seen[:] = list(seen), []
    for x in inputs:
        model(x)
    assert len(compiled_values) == 3
    assert compiled_values == pytest.approx(seen, rel=BF16_TOLERANCE)


def test_data_writes_and_module_swaps_are_seen(bf16):
    torch.manual_seed(0)
    model = Branchy()
    compiled = torch.compile(model, backend=graphamp.backend(bf16, inductor=False))
    x = torch.randn(8, 16)
    before = compiled(x)
    with torch.no_grad():
        model.head.weight.data.mul_(3.0)
    assert close(compiled(x), model(x)) and not close(compiled(x), before)
    model.head.bias.data.copy_(torch.full((4,), 5.0))
    assert close(compiled(x), model(x))
    model.head = nn.Linear(32, 4)  # a new module, with new parameters
    assert close(compiled(x), model(x))
    model.norm = nn.Identity()  # a module of another kind
    assert close(compiled(x), model(x))


def test_dynamic_batch_sizes_reuse_one_symbolic_graph(bf16):
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    amp_backend = graphamp.backend(bf16, inductor=False)
    compiled = torch.compile(model, backend=amp_backend, dynamic=True)
    for batch in (3, 5, 9):
        x = torch.randn(batch, 16)
        assert close(compiled(x), model(x))
    assert len(amp_backend.graphs) == 1


def test_o2_keeps_normalization_weights_fp32(bf16):
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    amp_backend = graphamp.backend(bf16, level="O2", inductor=False)
    torch.compile(model, backend=amp_backend)(torch.randn(4, 16))
    (graph,) = amp_backend.graphs
    (norm,) = [n for n in graph.graph_module.graph.nodes if n.target == torch.ops.aten.layer_norm.default]
    weight, bias = norm.args[2], norm.args[3]
    assert weight.op == bias.op == "placeholder"  # fed as they are, no cast in between
    assert weight.meta["val"].dtype == torch.float32


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(lambda t, block=block: block(t).relu(), x, use_reentrant=False)
        return x.square().mean()


def test_activation_checkpointing_keeps_its_regions_and_their_matmuls_run_low(bf16):
    torch.manual_seed(0)
    model = Checkpointed()
    reference = copy.deepcopy(model)
    amp_backend = graphamp.backend(bf16, inductor=False)
    x = torch.randn(4, 16)
    torch.compile(model, backend=amp_backend)(x).backward()
    reference(x).backward()
    (graph,) = amp_backend.graphs
    regions = graph.graph_module.graph.find_nodes(
        op="call_function", target=torch.ops.higher_order.tag_activation_checkpoint
    )
    assert len(regions) == 2
    body = getattr(graph.graph_module, regions[0].args[0].target)
    (linear,) = [n for n in body.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert linear.meta["val"].dtype == torch.bfloat16
    assert close(model.blocks[0].weight.grad, reference.blocks[0].weight.grad)


class Fp32Region(nn.Module):
    def __init__(self):
        super().__init__()
        self.low = nn.Linear(8, 8)
        self.kept = nn.Linear(8, 8)

    def forward(self, x):
        h = self.low(x)
        with torch.autocast("cpu", enabled=False):  # the model's own FP32 region
            return self.kept(h.float()).relu()


def test_a_region_the_model_keeps_out_of_autocast_runs_fp32(bf16):
    recorder = DtypeRecorder()
    model = Fp32Region()
    x = torch.randn(4, 8)
    out = torch.compile(model, backend=recording_inside(graphamp.backend(bf16, inductor=False), recorder))(x)
    products = recorder.calls_of("addmm")
    assert [floating(call.in_dtypes) for call in products] == [{torch.bfloat16}, {torch.float32}]
    assert close(out, model(x))


def test_the_backend_takes_lists_only():
    with pytest.raises(graphamp.ArgumentError, match="AutoMixedPrecisionLists"):
        graphamp.backend("bfloat16")


def test_tiny_llama_trains_like_autocast_with_fp32_master_gradients(bf16):
    torch.manual_seed(0)
    model = llama(num_hidden_layers=1)
    reference = copy.deepcopy(model)
    ids = token_batch(batch=2, seq=16)
    # fx code: inductor's training path is test_compile.py's (GPT-2); its C++ compile would take most of this test
    compiled = torch.compile(model, backend=graphamp.backend(bf16, inductor=False))
    optimizer = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-3), bf16)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses, reference_losses = [], []
    for _ in range(5):
        loss = compiled(input_ids=ids, labels=ids).loss
        optimizer.minimize(loss)
        assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
        optimizer.zero_grad()
        losses.append(loss.item())
        with torch.autocast("cpu", torch.bfloat16):
            reference_loss = reference(input_ids=ids, labels=ids).loss  # eager autocast: no second compile
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        reference_losses.append(reference_loss.item())
    assert losses[-1] < losses[0]  # it learns
    assert max(abs(a - b) for a, b in zip(losses, reference_losses)) < 3e-2


def test_generate_runs_its_prefill_and_decode_steps_through_rewritten_graphs(bf16):
    torch.manual_seed(0)
    model = llama(num_hidden_layers=1).eval()  # one layer: dynamo's time grows with them
    model.config.use_cache = True
    ids = token_batch(batch=1, seq=6)
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    amp_backend = graphamp.backend(bf16, inductor=False)
    model.forward = torch.compile(model.forward, backend=amp_backend)  # HF's way to compile for generate()
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), expected)
    assert len(amp_backend.graphs) >= 2  # prefill, decode
    assert all(report.decisions["white"] >= 7 for report in amp_backend.reports)  # the layer's 7 GEMMs


def test_float16_overflow_skips_the_step_and_halves_the_scale(fp16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(model, backend=graphamp.backend(fp16, inductor=False))
    # A scale of 2**40 makes the float16 backward overflow (its largest finite value is 65504).
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**40)
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.minimize(compiled(torch.randn(4, 8)).square().mean())
    assert optimizer.found_inf and optimizer.skipped_steps == 1
    assert optimizer.get_loss_scaling() == 2.0**39
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    optimizer.zero_grad()
    # With a scale the float16 backward holds, the same step is taken.
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=1024.0)
    optimizer.minimize(compiled(torch.randn(4, 8)).square().mean())
    assert not optimizer.found_inf
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def test_a_linked_optimizer_scales_inside_each_graph_so_plain_backward_gives_true_gradients(fp16):
    torch.manual_seed(0)
    model = Branchy()  # two graphs: the gradient crosses the graph break between them
    reference = copy.deepcopy(model)
    amp_backend = graphamp.backend(fp16, inductor=False)
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=1024.0)
    amp_backend.link_optimizer(optimizer)
    x = torch.randn(8, 16)
    torch.compile(model, backend=amp_backend)(x).square().mean().backward()  # no optimizer.backward()
    reference(x).square().mean().backward()
    assert len(amp_backend.graphs) == 2
    for parameter, expected in zip(model.parameters(), reference.parameters()):
        if expected.grad is not None:
            assert parameter.grad.dtype == torch.float32
            assert close(parameter.grad, expected.grad, 5e-2)  # scaled once or twice would be 1024x off
    optimizer.step()
    assert not optimizer.found_inf and optimizer.skipped_steps == 0


def test_with_a_linked_optimizer_a_float16_overflow_in_plain_backward_skips_the_step(fp16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    amp_backend = graphamp.backend(fp16, inductor=False)
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**40)
    amp_backend.link_optimizer(optimizer)
    weights = [p.detach().clone() for p in model.parameters()]
    torch.compile(model, backend=amp_backend)(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    assert optimizer.found_inf and optimizer.get_loss_scaling() == 2.0**39
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def test_deberta_v2_with_labels_trains_though_its_loss_reads_the_labels_values(bf16):
    """torch.export cannot capture it (export_program raises CaptureError); dynamo breaks the graph there."""
    torch.manual_seed(0)
    model = deberta_v2(num_hidden_layers=1)  # one layer: dynamo's time grows with them
    ids, labels = token_batch(batch=4, seq=12), torch.tensor([0, 1, 2, 1])
    with pytest.raises(graphamp.CaptureError, match="tensor's value"):
        graphamp.export_program(copy.deepcopy(model), (), {"input_ids": ids, "labels": labels}, amp_lists=bf16)
    graphamp.rewrite(model, (), {"input_ids": ids, "labels": labels}, amp_lists=bf16)
    optimizer = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=3e-3), bf16, model=model)
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.minimize(loss)
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    reports = [graph.report for graph in graphamp.rewritten_graphs(model)]
    assert sum(report.decisions["white"] for report in reports) >= 6  # the layer's q, k, v, o, 2 FFN


def test_export_writes_one_set_of_files_per_graph(bf16, tmp_path):
    amp_backend = graphamp.backend(bf16, inductor=False)
    torch.compile(Branchy(), backend=amp_backend)(torch.randn(4, 16))
    out = graphamp.export(amp_backend, tmp_path / "graphs")
    folders = sorted(p.name for p in out.iterdir())
    assert folders == [f"graph_{i}" for i in range(len(amp_backend.graphs))]
    for folder in folders:
        assert {p.name for p in (out / folder).iterdir()} >= {"graph.py", "graph.json", "diff.txt", "report.html"}
    assert "inserted cast" in (out / "graph_0" / "graph.py").read_text()


def test_a_hook_registered_after_the_first_call_runs_on_the_next(bf16):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), torch.randn(4, 8)
    compiled = torch.compile(model, backend=graphamp.backend(bf16, inductor=False))
    compiled(x)
    seen = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(output.float().sum().item()))
    compiled(x)
    compiled(x)
    assert len(seen) == 2
