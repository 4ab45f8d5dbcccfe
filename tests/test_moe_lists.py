"""Mixture-of-experts GEMMs are white: torch._grouped_mm and transformers' grouped-mm custom op run low."""

import warnings

import torch
import graphamp
from graphamp.inspection.recording import DtypeRecorder, floating
from training import relative_error


def tiny_mixtral():
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, use_cache=False,
    )
    return AutoModelForCausalLM.from_config(config)


def test_grouped_mm_is_white_in_both_dtypes(bf16, fp16):
    # torch._grouped_mm's meta kernel takes only bfloat16 (torch 2.13), so an FP32 model cannot capture it:
    # transformers calls it only on low-precision weights; the lists must still send it low.
    for lists in (bf16, fp16):
        assert lists.classify(torch.ops.aten._grouped_mm.default).color == graphamp.Decision.WHITE


def test_mixtral_experts_run_in_the_low_dtype_with_nothing_unlisted(bf16, seeded):
    model, ids = tiny_mixtral(), torch.randint(0, 128, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = graphamp.rewrite(model, (), {"input_ids": ids}, amp_lists=bf16)
    assert not amp.report.unlisted_ops
    with DtypeRecorder() as rec:
        logits = amp(input_ids=ids).logits
    experts = rec.calls_of("transformers::grouped_mm_fallback")
    assert len(experts) == 4  # gate-up and down projections, two layers
    assert all(floating(call.in_dtypes) == {torch.bfloat16} for call in experts)
    assert relative_error(logits, model(input_ids=ids).logits) < 2e-2


def test_token_counts_per_expert_stay_fp32(bf16, seeded):
    model, ids = tiny_mixtral(), torch.randint(0, 128, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = graphamp.rewrite(model, (), {"input_ids": ids}, amp_lists=bf16)
    with DtypeRecorder() as rec:
        amp(input_ids=ids)
    counts = rec.calls_of("histc")
    assert counts and all(floating(call.out_dtypes) == {torch.float32} for call in counts)
