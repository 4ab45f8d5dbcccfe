"""`amp_model.generate()` runs HF generation through rewritten graphs: tokens as autocast's, matmuls low, captures bounded."""

from __future__ import annotations

import inspect
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


class _WeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts float32 -> bfloat16 casts of parameters (by storage) during the block."""

    def __init__(self, model):
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and isinstance(source, torch.Tensor):
            read = args[1] if func is torch.ops.aten.copy_.default else source
            if read.dtype == torch.float32 and read.untyped_storage().data_ptr() in self.storages:
                self.count += 1
        return func(*args, **kwargs)


def test_one_generate_call_casts_each_weight_once_whatever_its_length(bf16, seeded):
    """As autocast keeps its casts for the length of its context: a decode step does not cast the weights again."""
    model = llama().eval()
    amp = graphamp.rewrite(model, (), {"input_ids": token_batch(1, 8)}, amp_lists=bf16)
    greedy(amp, token_batch(1, 8, seed=3))  # captures the prefill and decode steps
    counts = []
    for new_tokens in (2, 7):
        with _WeightCasts(model) as casts:
            greedy(amp, token_batch(1, 8, seed=4), new_tokens=new_tokens)
        counts.append(casts.count)
    weights = len([p for p in model.parameters() if p.dim() == 2]) - 1  # the embedding is read in FP32
    assert counts[0] == counts[1] and 0 < counts[0] <= weights + 1  # the tied or untied head


def test_a_weight_written_between_generate_calls_is_read_by_the_next(bf16, seeded):
    model = llama().eval()
    amp = graphamp.rewrite(model, (), {"input_ids": token_batch(1, 8)}, amp_lists=bf16)
    ids = token_batch(1, 8, seed=3)
    greedy(amp, ids)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight))  # another model's head
        model.model.layers[0].mlp.down_proj.weight.data = torch.randn_like(model.model.layers[0].mlp.down_proj.weight)
    tokens = greedy(amp, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = greedy(model, ids)
    assert torch.equal(tokens, expected)


def test_a_step_captured_during_generate_runs_outside_it_with_its_weights_cast_per_call(bf16, seeded):
    """A graph made during generate() takes its weights' casts as inputs; called outside, it is given fresh ones."""
    from graphamp.runtime.generation import GenerationCall

    model = llama().eval()
    ids = token_batch(1, 8)
    amp = graphamp.rewrite(model, (), {"input_ids": ids}, amp_lists=bf16)
    amp.recapture()
    amp._generation = GenerationCall()
    try:
        with torch.no_grad():
            inside = amp(input_ids=ids).logits
    finally:
        amp._generation = None
    assert amp.captures[-1].fed_weights
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # outside a generate() call nothing is kept: the next call reads this
        outside = amp(input_ids=ids).logits
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(input_ids=ids).logits
    assert len(amp.captures) == 1 and not torch.equal(inside, outside)
    torch.testing.assert_close(outside, expected.float(), rtol=2e-2, atol=2e-2)


def test_decode_steps_with_symbolic_lengths_group_key_value_heads_on_a_cpu(bf16, seeded):
    """The decode graph (symbolic sequence length) hands SDPA the unrepeated heads, as eager HF does."""
    model = llama().eval()
    amp = graphamp.rewrite(model, (), {"input_ids": token_batch(1, 8)}, amp_lists=bf16)
    greedy(amp, token_batch(1, 8, seed=3))
    graph = amp.captures[-1].run.graph
    attention = graph.find_nodes(op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default)
    assert attention and all(node.kwargs.get("enable_gqa") for node in attention)
    assert not graph.find_nodes(op="call_function", target=torch.ops.aten.expand.default) or all(
        node.meta["val"].dim() != 5 for node in graph.find_nodes(op="call_function", target=torch.ops.aten.expand.default)
    )


def test_a_module_swapped_between_generate_calls_is_seen_by_the_next(bf16, seeded):
    """Within one call the model is checked at its first forward; each call checks again."""
    model = llama().eval()
    amp = graphamp.rewrite(model, (), {"input_ids": token_batch(1, 8)}, amp_lists=bf16)
    ids = token_batch(1, 8, seed=3)
    greedy(amp, ids)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, VOCAB, bias=True)
    tokens = greedy(amp, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = greedy(model, ids)
    assert torch.equal(tokens, expected)


def _decode_with_one_cache_object(model, steps=4):
    """HF's documented manual loop: one DynamicCache passed to every call, updated in place by the model."""
    from transformers import DynamicCache

    cache, tokens = DynamicCache(), []
    forward = getattr(model, "original_module", model).forward
    keyword = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"  # renamed in 5.x
    with torch.no_grad():
        out = model(input_ids=token_batch(1, 8, seed=3), use_cache=True, **{keyword: cache})
        for _ in range(steps):
            tokens.append(out.logits[:, -1:].argmax(-1))
            out = model(input_ids=tokens[-1], use_cache=True, **{keyword: cache})
    returned = [value for value in out.values() if isinstance(value, DynamicCache)]
    return torch.cat(tokens, 1), cache, returned


def test_a_cache_passed_to_every_call_is_updated_in_place_as_by_the_eager_model(decoder):
    amp, model = decoder
    tokens, cache, out = _decode_with_one_cache_object(amp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_cache, _ = _decode_with_one_cache_object(model)
    assert len(out) == 1 and out[0] is cache  # the object passed in, as eager returns it
    assert cache.get_seq_length() == expected_cache.get_seq_length() == 8 + 4
    assert torch.equal(tokens, expected)
