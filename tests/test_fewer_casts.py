"""Black ops that can compute in FP32 inside their kernel get no cast kernel, so graphamp casts no more than autocast."""

import warnings

import pytest
import torch
from torch import nn

import graphamp
from encoder_models import ENCODERS
from graphamp.inspection.recording import DtypeRecorder, floating
from training import relative_error


class ConvNeXtBlockTail(nn.Module):
    """conv -> layer_norm -> linear, as in ConvNeXt: the norm reads the conv's low output."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x).permute(0, 2, 3, 1)))


def test_norm_feeding_only_a_gemm_reads_the_low_input_with_fp32_parameters(bf16, seeded):
    model, x = ConvNeXtBlockTail(), torch.randn(2, 8, 6, 6)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    with DtypeRecorder() as rec:
        out = amp(x)
    (norm,) = rec.calls_of("native_layer_norm")
    assert norm.in_dtypes == (torch.bfloat16, torch.float32, torch.float32)
    (node,) = [n for n in amp.graph_module.graph.nodes if n.target == torch.ops.aten.layer_norm.default]
    neighbours = [*node.all_input_nodes, *node.users]  # autocast casts the input up and the output back down
    assert not [n for n in neighbours if n.meta.get("graphamp", {}).get("decision") == "inserted-cast"]
    assert relative_error(out, model(x)) < 2e-2


def test_norm_whose_output_is_also_a_residual_reads_fp32(bf16, seeded):
    class PostNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm, self.out = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.norm(self.fc(x))
            return self.out(h) + h  # the residual keeps FP32, as under autocast

    x = torch.randn(2, 8)
    amp = graphamp.rewrite(PostNorm(), (x,), amp_lists=bf16)
    with DtypeRecorder() as rec:
        amp(x)
    assert floating(rec.calls_of("native_layer_norm")[0].in_dtypes) == {torch.float32}


def test_sum_of_a_low_value_accumulates_in_fp32_through_its_dtype_argument(bf16, seeded):
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    amp = graphamp.rewrite(nn.Sequential(model, Mean()), (x,), amp_lists=bf16)
    with DtypeRecorder() as rec:
        out = amp(x)
    (mean,) = rec.calls_of("mean")
    assert mean.in_dtypes == (torch.bfloat16,) and mean.out_dtypes == (torch.float32,)
    assert relative_error(out, model(x).mean(-1)) < 1e-2


class Mean(nn.Module):
    def forward(self, h):
        return h.mean(-1)


# ConvNeXt 50 vs 47, Segformer 97 vs 75, MobileViT 354 vs 293, ALBERT 54 vs 41 casts per step (bf16, CPU): not yet.
NOT_YET = {"convnext", "segformer", "mobilevit", "albert"}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason="more casts than autocast still", strict=True)) if n in NOT_YET else n
    for n in ENCODERS
])
def test_casts_per_training_step_are_no_more_than_autocasts(name, bf16, seeded):
    model, batch = ENCODERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = graphamp.rewrite(model, (), batch, amp_lists=bf16, progress=False)
    counts = {}
    for label, run, autocast in (("graphamp", amp, False), ("autocast", model, True)):
        with DtypeRecorder() as rec, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            run(**batch).logits.float().pow(2).mean().backward()
        counts[label] = rec.casts
    assert counts["graphamp"] <= counts["autocast"], counts
