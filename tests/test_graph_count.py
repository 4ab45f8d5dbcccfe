"""How many graphs rewrite() makes over a run of calls, against torch.compile's on the same calls: graphamp's
lowering and passes add no guard of their own, so a training run, its last smaller batch and an eval pass
recompile no more often than torch.compile does."""

from __future__ import annotations

import contextlib
import itertools
import types

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import graphamp

_fresh_names = itertools.count()


class ConvNet(nn.Module):
    """conv-bn-relu twice and a linear head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        )
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


def _train_then_evaluate(model: nn.Module, call) -> None:
    """Three batches of 8 and a last one of 5, then eval mode on batches of 16 and 3."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for batch in (8, 8, 8, 5):
        call(torch.randn(batch, 3, 8, 8)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        for batch in (16, 3):
            call(torch.randn(batch, 3, 8, 8))


def _graphamp_graphs(amp_lists) -> int:
    torch.manual_seed(0)
    model = graphamp.rewrite(ConvNet(), amp_lists=amp_lists)
    _train_then_evaluate(model, model)
    return len(graphamp.rewritten_graphs(model))


@pytest.fixture(scope="module")
def graphamp_graphs(bf16) -> int:
    return _graphamp_graphs(bf16)


def _torch_compile_graphs(autocast: bool) -> int:
    """torch.compile's graphs over the same calls, on a call function of its own: dynamo keeps its automatic-dynamic
    record of sizes per code object, and another test's compile of ConvNet.forward would share it."""
    model, counter = ConvNet(), torch._dynamo.testing.CompileCounter()

    def call_model(module, x):
        return module(x)

    name = f"call_model_{next(_fresh_names)}"
    code = call_model.__code__.replace(co_name=name, co_qualname=name)
    compiled = torch.compile(types.FunctionType(code, globals(), name), backend=counter)

    def call(x):
        with torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext():
            return compiled(model, x)

    _train_then_evaluate(model, call)
    return counter.frame_count


def test_training_then_eval_makes_no_more_graphs_than_torch_compile_of_the_fp32_model(graphamp_graphs, seeded):
    assert graphamp_graphs <= _torch_compile_graphs(autocast=False)


@pytest.mark.xfail(strict=True, reason=(
    "torch's FP32 CPU conv kernel choice guards the batch at 16 in dynamo's FP32 trace, which graphamp rewrites "
    "(as in plain torch.compile's): the eval graph made at 16 fails the call at 3. Under autocast dynamo traces a "
    "bfloat16 conv, which asks nothing. The test below shows it is the one difference (docs/shapes_and_generation.md)."
))
def test_training_then_eval_makes_no_more_graphs_than_torch_compile_under_autocast(graphamp_graphs, seeded):
    assert graphamp_graphs <= _torch_compile_graphs(autocast=True)


def test_without_torchs_fp32_cpu_conv_kernel_choice_graphamp_makes_no_more_graphs_than_torch_compile_under_autocast(
    bf16, seeded
):
    """torch's fake convolution (torch/_subclasses/fake_impls.py, conv) asks _select_conv_backend which kernel the
    input would run, and for an FP32 CPU input mkldnn's and nnpack's heuristics test `batch >= 16`: a guard in every
    FP32 trace of a conv, none in a bfloat16 one. With both kernels off, the same calls make as many graphs."""
    with torch.backends.mkldnn.flags(enabled=False), torch.backends.nnpack.flags(enabled=False):
        assert _graphamp_graphs(bf16) <= _torch_compile_graphs(autocast=True)
