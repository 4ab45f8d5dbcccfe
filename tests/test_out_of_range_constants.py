"""Number arguments beyond the low dtype's range (HF's `finfo(float32).min` as minus infinity) keep their meaning."""

import copy

import pytest
import torch
from torch import nn

import graphamp
from graphamp.inspection.recording import floating
from training import relative_error

FP32_MIN = torch.finfo(torch.float32).min


class MaskedScores(nn.Module):
    """Scores from a white linear, masked with finfo(float32).min as HF does, then softmax."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x, mask):
        return self.proj(x).masked_fill(mask, FP32_MIN).softmax(-1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fill_with_float32_min_runs_low_and_matches_fp32(rewritten, dtype, seeded):
    model, x = MaskedScores(), torch.randn(2, 8, 16)
    mask = torch.rand(2, 8, 16) > 0.7
    expected = model(x, mask)
    amp = rewritten.convert(model, (x, mask), amp_lists=graphamp.AutoMixedPrecisionLists(dtype=dtype))
    with amp.recording() as rec:
        out = amp.run(x, mask)
    (fill,) = rec.calls_of("masked_fill")
    assert floating(fill.in_dtypes) == {getattr(torch, dtype)}
    assert bool((out[mask] == 0).all())  # still minus infinity for softmax
    assert relative_error(out, expected) < 1e-2


def test_fill_value_becomes_the_low_dtypes_most_negative_number(rewritten, bf16, seeded):
    x, mask = torch.randn(2, 16), torch.rand(2, 16) > 0.5
    graph_module, _ = rewritten(MaskedScores(), (x, mask), amp_lists=bf16)
    (fill,) = [n for n in graph_module.graph.nodes if n.target == torch.ops.aten.masked_fill.Scalar]
    assert fill.args[2] == -torch.finfo(torch.bfloat16).max


def deberta_v2():
    from transformers import DebertaV2Config, DebertaV2Model

    config = DebertaV2Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=16,
    )
    return DebertaV2Model(config).eval()


def test_deberta_v2_runs_as_close_to_fp32_as_autocast(rewritten, bf16, seeded):
    model = deberta_v2()
    ids, mask = torch.randint(0, 128, (2, 16)), torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    expected = model(**batch).last_hidden_state
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_error = relative_error(model(**batch).last_hidden_state, expected)
    amp = rewritten.convert(model, (), batch, amp_lists=bf16)
    error = relative_error(amp.run(**batch).last_hidden_state, expected)
    assert error <= 1.5 * autocast_error


class MaskedWithAConstantTensor(nn.Module):
    """Scores masked with `finfo(scores.dtype).min` made as a tensor, in the ways models write it. The FP32 trace
    froze scores.dtype as float32; under autocast it is the low dtype, whose min is finite there."""

    def __init__(self, spelling: str, fill: float | None = None):
        super().__init__()
        self.q, self.k, self.spelling, self.fill = nn.Linear(16, 16), nn.Linear(16, 16), spelling, fill

    def forward(self, x, keep):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        fill = torch.finfo(scores.dtype).min if self.fill is None else self.fill
        if self.spelling == "where(torch.tensor)":  # ImageGPT's mask_value
            scores = torch.where(keep, scores, torch.tensor(fill, dtype=scores.dtype))
        elif self.spelling == "masked_fill(torch.tensor)":
            scores = scores.masked_fill(~keep, torch.tensor(fill))
        elif self.spelling == "where(full([]))":
            scores = torch.where(keep, scores, torch.full([], fill, dtype=scores.dtype))
        else:  # "index_put": scores[~keep] = min
            scores = scores.clone()
            scores[~keep] = fill
        return scores.softmax(-1)


def fully_masked_row():
    keep = torch.ones(2, 8, 8, dtype=torch.bool)
    keep[:, :, 5:] = False
    keep[1, 2, :] = False  # a padding row: softmax of equal scores, 1/8 each
    return torch.randn(2, 8, 16), keep


SPELLINGS = ["where(torch.tensor)", "masked_fill(torch.tensor)", "where(full([]))", "index_put"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_float32_min_tensor_cast_down_saturates_instead_of_becoming_minus_infinity(rewritten, bf16, spelling, seeded):
    model, (x, keep) = MaskedWithAConstantTensor(spelling), fully_masked_row()
    expected = model(x, keep)
    with torch.autocast("cpu", torch.bfloat16):
        autocast_error = relative_error(model(x, keep), expected)
    amp = rewritten.convert(model, (x, keep), amp_lists=bf16)
    with amp.recording() as rec:
        out = amp.run(x, keep)
    assert all(floating(call.in_dtypes) == {torch.bfloat16} for call in rec.calls_of("matmul", "bmm", "mm"))
    assert not out.isnan().any()  # was NaN on the padding row: -3.4e38 is -inf in bfloat16
    assert torch.equal(out[1, 2], torch.full((8,), 1 / 8))
    assert relative_error(out, expected) <= 1.5 * autocast_error + 1e-3


def test_a_constant_tensors_infinity_stays_infinite_as_in_fp32(rewritten, bf16, seeded):
    model, (x, keep) = MaskedWithAConstantTensor("where(torch.tensor)", fill=float("-inf")), fully_masked_row()
    amp = rewritten.convert(model, (x, keep), amp_lists=bf16)
    assert model(x, keep)[1, 2].isnan().all() and amp.run(x, keep)[1, 2].isnan().all()


def test_training_through_a_saturated_constant_gives_finite_gradients_as_close_to_fp32_as_autocasts(bf16, seeded):
    model, (x, keep) = MaskedWithAConstantTensor("masked_fill(torch.tensor)"), fully_masked_row()
    target = torch.randn(2, 8, 8)
    fp32, autocast = copy.deepcopy(model), copy.deepcopy(model)
    fp32(x, keep).sub(target).square().sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        autocast(x, keep).sub(target).square().sum().backward()
    graphamp.rewrite(model, amp_lists=bf16)
    loss = model(x, keep).sub(target).square().sum()
    loss.backward()

    def gradients(m):
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    assert loss.isfinite() and gradients(model).isfinite().all()  # the masked fill's backward hid the NaN row
    autocast_error = relative_error(gradients(autocast), gradients(fp32))
    assert relative_error(gradients(model), gradients(fp32)) <= 1.5 * autocast_error + 1e-3


class ClampedToItsDtypesRange(nn.Module):
    """`clamp(min=finfo(h.dtype).min)`: under autocast the low dtype's bounds; the FP32 trace froze float32's, given
    as clamp's optional numbers (`Scalar? min`)."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.proj, self.in_place = nn.Linear(16, 16), in_place

    def forward(self, x):
        h = self.proj(x)
        bounds = torch.finfo(h.dtype)
        return h.clamp_(min=bounds.min, max=bounds.max) if self.in_place else h.clamp(min=bounds.min, max=bounds.max)


@pytest.mark.parametrize("in_place", [False, True], ids=["clamp", "clamp_"])
def test_a_clamp_to_the_dtypes_range_runs_low_as_under_autocast(rewritten, bf16, in_place, seeded):
    model, x = ClampedToItsDtypesRange(in_place), torch.randn(2, 8, 16)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
    amp = rewritten.convert(model, (x,), amp_lists=bf16)
    with amp.recording() as rec:
        out = amp.run(x)
    (clamp,) = rec.calls_of("clamp", "clamp_")
    assert floating(clamp.in_dtypes) == {torch.bfloat16}
    assert relative_error(out, expected) == 0
