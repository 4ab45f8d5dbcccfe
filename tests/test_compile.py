"""rewrite(compile=True): each rewritten graph compiled by inductor, on CPU in bfloat16 (float16 for loss scaling).

Inductor's compiles are the slow part of this file (seconds each on 2 cores), so each test builds the fewest: one
one-layer GPT-2, shared, and tiny models.
"""

import copy
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
import models
from graphamp import AutoMixedPrecisionLists
from training import relative_error

# Measured against torch.autocast(bfloat16) on the same weights (torch 2.13, 2026): loss 1.2e-5, logits 3.7e-3,
# worst parameter gradient 6.0e-3 with two layers; 5.2e-6, 3.1e-3 and 5.9e-3 with the one the tests run (2026-11-28).
# Inductor fuses the casts and reorders the bfloat16 arithmetic.
GPT2_LOSS_RTOL = 1e-3
GPT2_LOGITS_RTOL = 2e-2
GPT2_GRADIENT_RTOL = 2e-2
TRAINING_STEPS = 4


class BodyAndHead(nn.Module):
    """A white body and a head the tests keep in FP32; the sizes tell their matmuls apart in a graph."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 48)
        self.head = nn.Linear(48, 24)

    def forward(self, x):
        return self.head(torch.relu(self.body(x))).log_softmax(-1)


def gpt2_batch(seed=0):
    ids = models.token_batch(2, 16, seed=seed)
    return {"input_ids": ids, "labels": ids}


class Run(NamedTuple):
    """A few training steps of one GPT-2: the first step's outputs and gradients, and each step's loss."""

    model: nn.Module
    logits: torch.Tensor
    loss: torch.Tensor
    gradients: dict[str, torch.Tensor]
    losses: list[float]


def train_gpt2(model, autocast: bool) -> Run:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(TRAINING_STEPS):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = model(**gpt2_batch())
        out.loss.backward()
        if step == 0:
            first = out.logits.detach(), out.loss.detach()
            gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return Run(model, *first, gradients, losses)


@pytest.fixture(scope="module")
def gpt2_runs(bf16) -> dict[str, Run]:
    """GPT-2 trained a few steps compiled by rewrite(compile=True), and its copy under torch.autocast."""
    torch.manual_seed(0)
    model = models.gpt2(n_layer=1)  # inductor's time grows with the layers; what is compared is in each one
    autocast_model = copy.deepcopy(model)
    graphamp.rewrite(model, example_kwargs=gpt2_batch(), amp_lists=bf16, compile=True)
    return {"graphamp": train_gpt2(model, autocast=False), "autocast": train_gpt2(autocast_model, autocast=True)}


def test_compiled_gpt2_returns_fp32_logits_and_autocasts_loss(gpt2_runs):
    ours, autocast = gpt2_runs["graphamp"], gpt2_runs["autocast"]
    assert ours.logits.dtype == ours.loss.dtype == torch.float32  # autocast's logits are bfloat16
    assert relative_error(ours.loss, autocast.loss) < GPT2_LOSS_RTOL
    assert relative_error(ours.logits, autocast.logits.float()) < GPT2_LOGITS_RTOL


def test_compiled_gpt2_gradients_reach_the_fp32_master_weights_as_autocasts_do(gpt2_runs):
    ours, autocast = gpt2_runs["graphamp"], gpt2_runs["autocast"]
    assert ours.gradients.keys() == autocast.gradients.keys()
    for name, gradient in ours.gradients.items():
        assert gradient.dtype == torch.float32, name
        assert relative_error(gradient, autocast.gradients[name]) < GPT2_GRADIENT_RTOL, name


def test_compiled_gpt2_trains_as_autocast_does(gpt2_runs):
    ours, autocast = gpt2_runs["graphamp"], gpt2_runs["autocast"]
    assert ours.losses[-1] < ours.losses[0]
    assert relative_error(ours.losses, autocast.losses) < GPT2_LOSS_RTOL


def test_each_compiled_graph_has_its_phases_timed(gpt2_runs):
    graphs = graphamp.rewritten_graphs(gpt2_runs["graphamp"].model)
    assert graphs and all(graph.runs > 0 for graph in graphs)
    for graph in graphs:
        assert set(graph.timings) == {"lower to ATen", "passes", "pass cast", "pass grouped_query_attention", "inductor"}
        assert all(seconds > 0 for seconds in graph.timings.values())


def test_logits_the_caller_holds_are_not_overwritten_by_the_next_call(gpt2_runs):
    model = gpt2_runs["graphamp"].model
    first = model(**gpt2_batch()).logits  # with autograd on, as in training: no recompile for inference
    kept = first.detach().clone()
    second = model(**gpt2_batch(seed=1)).logits
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, kept) and not torch.equal(second, kept)


def test_compiled_gradients_through_an_output_read_outside_match_fp32(bf16, seeded):
    """HF's shape: the loss computed inside from `logits.float()`, the logits returned and read by a second loss."""
    model, x, labels = models.LossOfCastLogits(), torch.randn(4, 8), torch.randint(0, 6, (4,))
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (x, labels), amp_lists=bf16, compile=True)
    for net in (model, reference):
        loss, logits = net(x, labels)
        assert logits.dtype == torch.float32
        (loss + logits.square().mean()).backward()  # the logits' own gradient too, not only the loss's
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters()):
        assert relative_error(parameter.grad, expected.grad) < 2e-2, name


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
        # static shapes, so that the graphs' shapes tell the matmuls apart whatever sizes other models compiled
        model = graphamp.rewrite(BodyAndHead(), (x,), amp_lists=lists, compile=True, dynamic=False)
        model(x).sum().backward()

    forward, backward = post_grad_graphs
    matmul_dtypes = {shape: dtype for op, shape, dtype in backward if op == "aten.mm.default"}
    assert matmul_dtypes == {
        (16, 48): torch.float32,  # the head's input gradient: custom_black_modules
        (24, 48): torch.float32,  # the head's weight gradient
        (48, 32): torch.bfloat16,  # the body's weight gradient: white
    }
    assert {dtype for op, _, dtype in forward if op == "aten.exp.default"} == {torch.float32}  # log_softmax: black


def test_compiled_float16_training_with_in_graph_loss_scaling_lowers_the_loss(fp16):
    """The plain loop on an inductor graph: scaled inside, true gradients in .grad, steps by the decorated Adam."""
    images, labels = models.digits(64)
    images = images.flatten(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (images,), amp_lists=fp16, compile=True)
    optimizer = graphamp.decorate(torch.optim.Adam(model.parameters(), lr=1e-2), fp16, init_loss_scaling=2.0**10)

    losses = []
    for step in range(20):
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        if step == 0:  # true gradients, as the FP32 model's within float16's rounding
            F.cross_entropy(reference(images), labels).backward()
            for parameter, expected in zip(model.parameters(), reference.parameters()):
                assert relative_error(parameter.grad, expected.grad) < 1e-2
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]
    assert optimizer.skipped_steps == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("name", ["progress", "max_captures", "fp32_outputs", "regions", "weight_cache"])
def test_arguments_of_the_export_based_rewrite_are_deprecated_and_say_what_replaces_them(bf16, name):
    said = rf"rewrite\({name}=\.\.\.\) is ignored since graphamp 0\.3 and goes in 0\.4: \w"
    with pytest.warns(DeprecationWarning, match=said):
        graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16, **{name: True})


def test_an_unknown_keyword_is_refused(bf16):
    with pytest.raises(graphamp.ArgumentError, match="unexpected keyword argument 'compile_modes'"):
        graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16, compile_modes="default")
