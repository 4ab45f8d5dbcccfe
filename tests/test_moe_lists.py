"""Mixture-of-experts GEMMs are white: torch._grouped_mm and transformers' grouped-mm custom op run low, on both
front ends."""

import copy
import warnings

import pytest
import torch

import graphamp
from graphamp.inspection.recording import floating
from training import relative_error


def tiny_mixtral():
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, use_cache=False,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def mixtral(rewritten, bf16):
    """(Mixtral converted by the front end, an FP32 copy, its input ids), shared by the tests that only call it."""
    torch.manual_seed(0)
    model, ids = tiny_mixtral(), torch.randint(0, 128, (2, 16))
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = rewritten.convert(model, (), {"input_ids": ids}, amp_lists=bf16)
    return amp, reference, ids


def test_grouped_mm_is_white_in_both_dtypes(bf16, fp16):
    # torch._grouped_mm's meta kernel takes only bfloat16 (torch 2.13), so an FP32 model cannot capture it:
    # transformers calls it only on low-precision weights; the lists must still send it low.
    for lists in (bf16, fp16):
        assert lists.classify(torch.ops.aten._grouped_mm.default).color == graphamp.Decision.WHITE


def test_mixtral_experts_run_in_the_low_dtype_with_nothing_unlisted(mixtral):
    amp, reference, ids = mixtral
    assert not amp.report.unlisted_ops
    with amp.recording() as rec:
        logits = amp.run(input_ids=ids).logits
    experts = rec.calls_of("transformers::grouped_mm_fallback")
    assert len(experts) == 4  # gate-up and down projections, two layers
    assert all(floating(call.in_dtypes) == {torch.bfloat16} for call in experts)
    assert relative_error(logits, reference(input_ids=ids).logits) < 2e-2


def test_token_counts_per_expert_stay_fp32(mixtral):
    amp, _, ids = mixtral
    with amp.recording() as rec:
        amp.run(input_ids=ids)
    counts = rec.calls_of("histc")
    assert counts and all(floating(call.out_dtypes) == {torch.float32} for call in counts)
