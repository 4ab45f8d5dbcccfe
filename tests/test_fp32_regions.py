"""Code a model runs under `torch.autocast(..., enabled=False)` stays FP32 through the cast pass, as under autocast, on
both front ends."""

import warnings

import pytest
import torch
from torch import nn

import graphamp
from graphamp.inspection.recording import floating
from graphamp.passes.marks import mark_of
from training import relative_error


class AttentionKeptFP32(nn.Module):
    """A projection (white), then scores the model computes in FP32 inside an autocast-disabled block."""

    def __init__(self, disable):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.disable = disable

    def forward(self, x):
        h = self.proj(x)
        with self.disable():
            scores = h.float() @ h.float().transpose(-1, -2)
        return scores.softmax(-1) @ h


DISABLED_FORMS = {
    "cpu": lambda: torch.autocast("cpu", enabled=False),
    "cuda": lambda: torch.autocast("cuda", enabled=False),
    "torch.amp": lambda: torch.amp.autocast("cpu", enabled=False),
}


@pytest.mark.parametrize("form", sorted(DISABLED_FORMS))
def test_matmul_inside_autocast_disabled_region_runs_fp32(rewritten, form, bf16, seeded):
    x = torch.randn(2, 8, 16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast("cuda") without CUDA warns that it is disabled anyway
        amp = rewritten.convert(AttentionKeptFP32(DISABLED_FORMS[form]), (x,), amp_lists=bf16)
        with amp.recording() as rec:
            amp.run(x).sum().backward()
    gemms = rec.calls_of("bmm")
    assert floating(gemms[0].in_dtypes) == {torch.float32}  # the scores, inside the region
    assert floating(gemms[1].in_dtypes) == {torch.bfloat16}  # softmax @ h, outside: white as usual
    assert floating(rec.calls_of("addmm")[0].in_dtypes) == {torch.bfloat16}


def test_autocast_disabled_region_matches_eager_autocast(rewritten, bf16, seeded):
    model = AttentionKeptFP32(DISABLED_FORMS["cpu"])
    x = torch.randn(2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x).float()
    amp = rewritten.convert(model, (x,), amp_lists=bf16)
    # The same kernels in the same dtypes as autocast: equal up to summation order (bf16 scores differ by ~1e-3).
    assert relative_error(amp.run(x), expected) < 1e-5


def test_region_nodes_are_reported_as_the_models_own_choice(rewritten, bf16, seeded):
    x = torch.randn(2, 8, 16)
    graph_module, _ = rewritten(AttentionKeptFP32(DISABLED_FORMS["cpu"]), (x,), amp_lists=bf16)
    body = next(m for name, m in graph_module.named_children() if isinstance(m, torch.fx.GraphModule))
    decided = [mark_of(n) for n in body.graph.nodes if mark_of(n) is not None]
    assert decided and all(d.decision == graphamp.Decision.EXPLICIT_CAST for d in decided)
    assert all("autocast(enabled=False)" in d.source for d in decided if d.source != "model")


class EnabledInsideDisabled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            kept = x @ x.transpose(-1, -2)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                low = self.proj(x)
        return kept.sum() + low.float().sum()


def test_autocast_enabled_inside_a_disabled_region_follows_the_lists_again(rewritten, bf16, seeded):
    x = torch.randn(2, 8, 16)
    amp = rewritten.convert(EnabledInsideDisabled(), (x,), amp_lists=bf16)
    with amp.recording() as rec:
        amp.run(x)
    assert floating(rec.calls_of("bmm")[0].in_dtypes) == {torch.float32}
    assert floating(rec.calls_of("addmm", "mm")[0].in_dtypes) == {torch.bfloat16}
