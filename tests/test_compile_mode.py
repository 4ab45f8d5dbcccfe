"""rewrite(compile=True, mode=..., options=...): torch.compile's own arguments, "reduce-overhead" for CUDA graphs.

On a CPU inductor records no CUDA graph and runs its kernels as they are; these tests check that the mode is
passed and trains as the fx-code rewrite does. The CUDA graph itself is measured on a GPU (benchmarks/GPU_RUNBOOK.md).
"""

import pytest
import torch
from torch import nn

import graphamp
from training import relative_error


def model_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 24))
    return model, [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]


def train(amp_lists, **rewrite_arguments):
    model, batches = model_and_batches()
    graphamp.rewrite(model, (batches[0],), amp_lists=amp_lists, **rewrite_arguments)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x in batches:  # two micro-batches per step
            model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture
def compile_calls(monkeypatch):
    """The keyword arguments of each torch.compile call made while the test runs."""
    calls = []
    real_compile = torch.compile

    def recording_compile(*args, **kwargs):
        calls.append(kwargs)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    return calls


def test_reduce_overhead_trains_as_the_fx_code_rewrite_does(bf16):
    compiled = train(bf16, compile=True, mode="reduce-overhead")
    fx_code = train(bf16)
    # Inductor reorders bf16 arithmetic; measured 0.0 on this model (2026-11-23).
    assert relative_error(compiled, fx_code) < 1e-3


def test_mode_and_options_reach_torch_compile(bf16, compile_calls):
    graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16, compile=True, mode="max-autotune-no-cudagraphs")
    graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16, compile=True, options={"max_autotune": False})
    assert [call["mode"] for call in compile_calls] == ["max-autotune-no-cudagraphs", None]
    assert [call["options"] for call in compile_calls] == [None, {"max_autotune": False}]


def test_dynamic_and_fullgraph_reach_torch_compile(bf16, compile_calls):
    graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16, dynamic=True, fullgraph=True)
    graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16)
    assert [(call["dynamic"], call["fullgraph"]) for call in compile_calls] == [(True, True), (None, False)]


def test_compile_mode_is_deprecated_for_mode(bf16, compile_calls):
    with pytest.warns(DeprecationWarning, match=r"rewrite\(compile_mode=\.\.\.\) is now rewrite\(mode=\.\.\.\)"):
        graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16, compile=True, compile_mode="reduce-overhead")
    assert compile_calls[0]["mode"] == "reduce-overhead"


def test_mode_without_compile_is_refused(bf16):
    with pytest.raises(graphamp.ArgumentError, match="pass compile=True"):
        graphamp.rewrite(nn.Linear(4, 4), amp_lists=bf16, mode="reduce-overhead")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reduce_overhead_on_cuda_trains_as_inductor_without_cuda_graphs_does(bf16):
    """CUDA graphs recorded and replayed, a fused AdamW stepping the FP32 master weights: the same kernels as
    compile=True alone, so the same weights. One batch per step: a gradient accumulated over replays reads a graph
    output the next replay wrote over (so in torch.compile alone)."""
    results = []
    for arguments in ({"compile": True, "mode": "reduce-overhead"}, {"compile": True}):
        model, batches = model_and_batches()
        model, batches = model.cuda(), [x.cuda() for x in batches]
        graphamp.rewrite(model, (batches[0],), amp_lists=bf16, **arguments)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for step in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            model(batches[step % 2]).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-3, atol=1e-4)
