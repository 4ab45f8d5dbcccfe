"""`amp_model.generate()` runs HF generation through rewritten graphs: tokens as autocast's, matmuls low, captures bounded."""

from __future__ import annotations

import warnings

import pytest
import torch

import graphamp
from graphamp.inspection.recording import DtypeRecorder
from tests.models import VOCAB, gpt2, token_batch

MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        use_cache=False,  # for rewrite()'s own call; generate() turns the cache on
    )
    return LlamaForCausalLM(config)


def greedy(model, ids, new_tokens=6):
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)


@pytest.fixture(params=["llama", "gpt2"])
def decoder(request, bf16, seeded):
    """(rewritten decoder in eval mode, its original)."""
    model = (llama() if request.param == "llama" else gpt2()).eval()
    return graphamp.rewrite(model, (), {"input_ids": token_batch(1, 8)}, amp_lists=bf16), model


def test_greedy_tokens_equal_autocast_on_the_original(decoder):
    amp, model = decoder
    ids = token_batch(1, 8, seed=3)

    tokens = greedy(amp, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = greedy(model, ids)

    assert torch.equal(tokens, expected)


def test_generation_matmuls_execute_in_bfloat16(decoder):
    amp, _ = decoder
    greedy(amp, token_batch(1, 8, seed=3))  # captures the prefill and decode steps

    with DtypeRecorder() as recorder:
        greedy(amp, token_batch(1, 8, seed=4))

    matmuls = recorder.calls_of(*MATMULS)
    assert len(matmuls) >= 6 * 2 * 4  # new tokens x layers x (q/k/v or qkv, out, two MLP) at the least
    assert all(set(call.in_dtypes) == {torch.bfloat16} for call in matmuls)


def test_generations_of_other_prompt_lengths_cost_no_new_capture(decoder):
    amp, _ = decoder
    greedy(amp, token_batch(1, 8, seed=3))
    captures = len(amp.captures)

    for length in (5, 11, 14):
        greedy(amp, token_batch(1, length, seed=length), new_tokens=4)

    assert captures <= 4  # rewrite's own call, a prefill and a decode step
    assert len(amp.captures) == captures


def test_batched_generation_with_padding_matches_autocast(bf16, seeded):
    model = llama().eval()
    amp = graphamp.rewrite(model, (), {"input_ids": token_batch(2, 8)}, amp_lists=bf16)
    ids = token_batch(2, 8, seed=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of the first prompt

    # Four tokens: the fifth of the padded row is a near tie of two logits in this random model (measured).
    tokens = amp.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)

    assert torch.equal(tokens, expected)


def llama_branching_on_a_token_in_eval():
    """A Llama whose forward, in eval mode only, branches on a token's value: it is rewritten in train mode,
    and its generation steps (eval mode) cannot be captured, whatever keywords generate() passes."""
    model = llama().train()
    plain_forward = type(model).forward

    def forward(self, input_ids=None, **kwargs):
        if not self.training and input_ids.max() > VOCAB:
            input_ids = input_ids % VOCAB
        return plain_forward(self, input_ids=input_ids, **kwargs)

    model.forward = forward.__get__(model)
    return model


def test_uncapturable_generation_warns_once_and_runs_the_original(bf16, seeded):
    model = llama_branching_on_a_token_in_eval()
    amp = graphamp.rewrite(model, (), {"input_ids": token_batch(1, 8)}, amp_lists=bf16).eval()
    ids = token_batch(1, 8, seed=3)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = greedy(amp, ids)
        second = greedy(amp, ids)

    fp32 = [w for w in caught if "runs the original model in FP32" in str(w.message)]
    assert len(fp32) == 1
    assert "tensor's value" in str(fp32[0].message)
    assert torch.equal(first, greedy(model, ids)) and torch.equal(second, first)


def test_amp_model_without_generate_has_no_generate(bf16):
    amp = graphamp.rewrite(torch.nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=bf16)

    assert not hasattr(amp, "generate")
