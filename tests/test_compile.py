"""rewrite(compile=True): the rewritten graph through torch.compile (inductor), on CPU in bfloat16.

Inductor's compiles are the slow part of this file (seconds each on 2 cores), so each test builds the fewest.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
import models
from training import relative_error
from graphamp import AutoMixedPrecisionLists
from graphamp.runtime.compiled import BACKWARD_PHASE, FORWARD_PHASE
from graphamp.amp_module import CAPTURE_PHASE, CAST_PASS_PHASE

BF16 = AutoMixedPrecisionLists(dtype="bfloat16")


class BodyAndHead(nn.Module):
    """A white body and a head the tests keep in FP32; the sizes tell their matmuls apart in a graph."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 48)
        self.head = nn.Linear(48, 24)

    def forward(self, x):
        return self.head(torch.relu(self.body(x))).log_softmax(-1)


@pytest.fixture(scope="module")
def gpt2_compiled_and_eager():
    """GPT-2 rewritten twice from one set of weights, compiled and eager, after one backward each."""
    torch.manual_seed(0)
    model = models.gpt2()
    ids = models.token_batch(2, 16)
    kwargs = {"input_ids": ids, "labels": ids}
    eager_model = copy.deepcopy(model)
    # Cold caches, so that the backward really compiles (a cache hit loads it instead).
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = graphamp.rewrite(model, example_kwargs=kwargs, amp_lists=BF16, compile=True, progress=False)
        eager = graphamp.rewrite(eager_model, example_kwargs=kwargs, amp_lists=BF16)
        losses = compiled(**kwargs).loss, eager(**kwargs).loss
        for loss in losses:
            loss.backward()
    return model, eager_model, compiled, losses


def test_compiled_gpt2_loss_matches_the_eager_rewrite(gpt2_compiled_and_eager):
    _, _, _, (compiled_loss, eager_loss) = gpt2_compiled_and_eager
    assert compiled_loss.dtype == torch.float32
    # Inductor fuses the casts and reorders bf16 arithmetic; measured up to 1.6e-5 over 3 seeds (2026-11-23).
    assert relative_error(compiled_loss, eager_loss) < 1e-3


def test_compiled_gpt2_gradients_reach_the_fp32_master_weights_and_match_eager(gpt2_compiled_and_eager):
    model, eager_model, _, _ = gpt2_compiled_and_eager
    eager_parameters = dict(eager_model.named_parameters())
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.dtype == torch.float32, name
        # bf16 gradients through differently fused kernels; worst parameter 6.1e-3 to 7.1e-3 over 3 seeds.
        assert relative_error(parameter.grad, eager_parameters[name].grad) < 2e-2, name


def test_compiled_forward_and_backward_compiles_are_timed(gpt2_compiled_and_eager):
    _, _, compiled, _ = gpt2_compiled_and_eager
    assert set(compiled.timings) == {CAPTURE_PHASE, CAST_PASS_PHASE, FORWARD_PHASE, BACKWARD_PHASE}
    assert all(seconds > 0 for seconds in compiled.timings.values())


def test_compiled_gpt2_logits_come_back_fp32_from_a_cast_after_the_graph(gpt2_compiled_and_eager):
    """The graph returns bfloat16 logits (the loss saves them in bfloat16 for its backward, as under autocast) and
    the cast up to float32 runs after it."""
    _, _, compiled, _ = gpt2_compiled_and_eager
    ids = models.token_batch(2, 16)
    with torch.no_grad():
        logits = compiled(input_ids=ids, labels=ids).logits
    assert logits.dtype == torch.float32
    run = compiled.captures[-1].run
    assert run.cast_up and all(dtype == torch.float32 for _, dtype in run.cast_up)
    # The loss reading them is a compiled graph of its own: their gradient is the loss's, never zeros beside it.
    assert len(list(run.compiled.children())) == 2


def test_compiled_gradients_through_an_output_cast_up_after_the_graph_match_eager():
    torch.manual_seed(0)
    model, x, labels = models.LossOfCastLogits(), torch.randn(4, 8), torch.randint(0, 6, (4,))
    eager_model = copy.deepcopy(model)
    compiled = graphamp.rewrite(model, (x, labels), amp_lists=BF16, compile=True, progress=False)
    eager = graphamp.rewrite(eager_model, (x, labels), amp_lists=BF16)
    for amp in (compiled, eager):
        loss, logits = amp(x, labels)
        assert logits.dtype == torch.float32
        (loss + logits.square().mean()).backward()  # the logits' own gradient too, not only the loss's
    assert compiled.captures[-1].run.cast_up
    for name, parameter in model.named_parameters():
        assert relative_error(parameter.grad, dict(eager_model.named_parameters())[name].grad) < 1e-2, name


def test_compiled_backward_keeps_black_modules_and_black_ops_in_fp32():
    """pytorch#179804: autocast's FP32 regions can come back low in a compiled backward; graphamp's cannot."""
    post_grad_graphs = []

    def record(graph):
        post_grad_graphs.append(
            [(str(n.target), tuple(n.meta["val"].shape), n.meta["val"].dtype)
             for n in graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)]
        )

    torch.manual_seed(0)
    x = torch.randn(16, 32)
    lists = AutoMixedPrecisionLists(dtype="bfloat16", custom_black_modules=["head"])
    with torch._inductor.config.patch(post_grad_custom_post_pass=record, fx_graph_cache=False):
        amp = graphamp.rewrite(BodyAndHead(), (x,), amp_lists=lists, compile=True, progress=False)
        amp(x).sum().backward()

    forward, backward = post_grad_graphs
    matmul_dtypes = {shape: dtype for op, shape, dtype in backward if op == "aten.mm.default"}
    assert matmul_dtypes == {
        (16, 48): torch.float32,  # the head's input gradient: custom_black_modules
        (24, 48): torch.float32,  # the head's weight gradient
        (48, 32): torch.bfloat16,  # the body's weight gradient: white
    }
    assert {dtype for op, _, dtype in forward if op == "aten.exp.default"} == {torch.float32}  # log_softmax: black


def test_compiled_float16_training_with_loss_scaling_lowers_the_loss():
    """The compiled graph under decorate(): scaled backward, unscale, step. fp16 on CPU is slow: tiny sizes."""
    images, labels = models.digits(64)
    images = images.flatten(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    lists = AutoMixedPrecisionLists(dtype="float16")
    amp = graphamp.rewrite(model, (images,), amp_lists=lists, compile=True, progress=False)
    optimizer = graphamp.decorate(torch.optim.Adam(model.parameters(), lr=1e-2), lists, init_loss_scaling=2.0**10)

    losses = []
    for _ in range(20):
        loss = F.cross_entropy(amp(images), labels)
        optimizer.minimize(loss)
        optimizer.zero_grad()
        losses.append(loss.item())

    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]
    assert optimizer.skipped_steps == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_progress_true_prints_a_line_per_phase(capfd):
    graphamp.rewrite(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=BF16, progress=True)
    lines = capfd.readouterr().err.splitlines()
    assert f"graphamp: {CAPTURE_PHASE} ..." in lines
    assert any(line.startswith(f"graphamp: {CAST_PASS_PHASE}: done in") for line in lines)


def test_progress_false_prints_nothing(capfd):
    graphamp.rewrite(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=BF16, progress=False)
    assert "graphamp:" not in capfd.readouterr().err


def test_by_default_only_a_phase_still_running_after_the_threshold_is_announced(monkeypatch, capsys):
    import time

    from graphamp.runtime import progress

    monkeypatch.setattr(progress, "SLOW_PHASE_S", 0.05)
    reporter = progress.Progress()
    timings = {}
    with reporter.phase("quick", timings):
        pass
    with reporter.phase("slow", timings):
        time.sleep(0.3)

    assert capsys.readouterr().err.splitlines() == ["graphamp: slow ...", f"graphamp: slow: done in {timings['slow']:.1f} s"]
    assert timings["quick"] < 0.05 <= timings["slow"]


def test_progress_takes_only_none_true_or_false():
    with pytest.raises(ValueError, match="progress must be"):
        graphamp.rewrite(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=BF16, progress="yes")


def test_compiled_float32_logits_reuse_the_storage_of_logits_the_caller_dropped(gpt2_compiled_and_eager):
    """On a CPU a float32 logits buffer is fresh pages every call (page faults, 12 ms at 32 MiB); the cast after the
    graph writes into the last call's storage once nothing holds it, and into a new one while something does."""
    _, _, compiled, _ = gpt2_compiled_and_eager
    ids = models.token_batch(2, 16)
    first = compiled(input_ids=ids, labels=ids)
    kept, expected = first.logits, first.logits.detach().clone()
    del first
    second = compiled(input_ids=ids, labels=ids)
    assert second.logits.data_ptr() != kept.data_ptr() and torch.equal(kept, expected)
    address = second.logits.data_ptr()
    del second, kept
    third = compiled(input_ids=ids, labels=ids)
    assert third.logits.data_ptr() == address
    assert torch.allclose(third.logits, expected) and third.logits.requires_grad
    # One storage per output for the whole AmpModule: a capture for other shapes would reuse it, not keep its own.
    assert all(capture.run.recycled is compiled._recycled for capture in compiled.captures)
