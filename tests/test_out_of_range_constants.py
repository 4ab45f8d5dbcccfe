"""Number arguments beyond the low dtype's range (HF's `finfo(float32).min` as minus infinity) keep their meaning."""

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
