"""An op writing into a tensor gets its other floating inputs in that tensor's dtype where its kernel wants them so
(issue 38): the FP32 trace has no `.to(cache.dtype)` of a low GEMM output written into an FP32 buffer (it was a no-op
there), so index_copy_, index_put_ and index_add_ would get a bfloat16 source for a float32 self and refuse it."""

import copy

import pytest
import torch
from torch import nn

import graphamp
from models import VOCAB, token_batch
from training import relative_error

FRONT_ENDS = ("rewrite-fx", "rewrite-inductor", "export")
WRITES = {
    "index_copy_": lambda cache, index, value: cache.index_copy_(0, index, value),
    "index_put_": lambda cache, index, value: cache.__setitem__(index, value),
    "index_add_": lambda cache, index, value: cache.index_add_(0, index, value),
    "index_copy": lambda cache, index, value: cache.copy_(cache.index_copy(0, index, value)),
}


class WritesLinearIntoBuffer(nn.Module):
    """A GEMM's output written into rows of an FP32 buffer, as HF's static KV cache writes k_proj's and v_proj's."""

    def __init__(self, write):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(6, 8))
        self.write = write

    def forward(self, x, index):
        self.write(self.cache, index, self.fc(x))
        return self.cache.clone()


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_low_gemm_output_written_into_an_fp32_buffer_is_written_in_its_dtype(front_end, write, bf16, seeded):
    model, x, index = WritesLinearIntoBuffer(WRITES[write]), torch.randn(2, 8), torch.tensor([1, 4])
    twin = copy.deepcopy(model)
    if front_end == "export":
        run = graphamp.export_program(copy.deepcopy(model), (x, index), amp_lists=bf16).module()
    else:
        graphamp.rewrite(model, (x, index), amp_lists=bf16, compile=front_end == "rewrite-inductor")
        run = model
    model.cache.zero_()
    out = run(x, index)
    expected = twin(x, index)
    assert out.dtype == torch.float32
    assert relative_error(out, expected) < 2e-2
    assert relative_error(model.cache if front_end != "export" else run.cache, expected) < 2e-2


def static_cache_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        use_cache=True,
    )
    return LlamaForCausalLM(config).eval()


def static_greedy(model, ids):
    return model.generate(ids, max_new_tokens=4, cache_implementation="static", do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("compile", [False, True], ids=["fx", "inductor"])
def test_static_cache_generation_of_a_rewritten_llama_gives_the_fp32_tokens(compile, bf16, seeded):
    # A one-token prompt: the prefill has the decode steps' shapes, so inductor's two graphs (the first call's, then
    # the later steps') share their C++ kernels; every step still writes the cache and the next reads it.
    model, ids = static_cache_llama(), token_batch(1, 1, seed=3)
    twin = copy.deepcopy(model)
    expected = static_greedy(twin, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(static_greedy(twin, ids), expected)  # this model's tokens do not hinge on rounding
    graphamp.rewrite(model, amp_lists=bf16, compile=compile)
    assert torch.equal(static_greedy(model, ids), expected)
