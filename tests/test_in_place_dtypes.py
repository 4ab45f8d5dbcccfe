"""An op writing into a tensor gets its other floating inputs in that tensor's dtype where its kernel wants them so
(issue 38): the FP32 trace has no `.to(cache.dtype)` of a low GEMM output written into an FP32 buffer (it was a no-op
there), so index_copy_, index_put_ and index_add_ would get a bfloat16 source for a float32 self and refuse it."""

import contextlib
import copy

import pytest
import torch
from torch import nn

import graphamp
from graphamp.inspection.recording import floating
from conftest import CompiledCodeRecorder
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


OUT_CALLS = {
    "mm": lambda x, w, buffer: torch.mm(x, w.t(), out=buffer),
    "matmul": lambda x, w, buffer: torch.matmul(x, w.t(), out=buffer),
    "addmm": lambda x, w, buffer: torch.addmm(buffer, x, w.t(), out=buffer),
}


class WritesAGemmWithOut(nn.Module):
    """A GEMM that writes into an FP32 buffer with out= (TRL's chunked LM head tiles, an accumulator)."""

    def __init__(self, call):
        super().__init__()
        self.fc, self.call = nn.Linear(16, 16), call
        self.register_buffer("acc", torch.zeros(4, 16))

    def forward(self, x):
        with torch.no_grad():
            self.call(x, self.fc.weight.detach(), self.acc)
        return self.fc(x) + self.acc


@pytest.mark.parametrize("call", OUT_CALLS)
@pytest.mark.parametrize("front_end", [*FRONT_ENDS, "auto_cast"])
def test_a_white_op_with_out_runs_low_and_its_buffer_keeps_its_dtype_as_under_auto_cast(front_end, call, bf16, seeded):
    """The lists decide the op (low, as auto_cast runs it); its result is copied into the buffer, which stays float32.
    The out= kernel itself refuses a bfloat16 input for a float32 buffer: a raw RuntimeError before."""
    model, x = WritesAGemmWithOut(OUT_CALLS[call]), torch.randn(4, 16)
    expected = copy.deepcopy(model)(x)
    if front_end == "export":
        model = graphamp.export_program(model, (x,), amp_lists=bf16).module()
    elif front_end != "auto_cast":
        graphamp.rewrite(model, amp_lists=bf16, compile=front_end == "rewrite-inductor")
    with graphamp.auto_cast(bf16) if front_end == "auto_cast" else contextlib.nullcontext(), \
            CompiledCodeRecorder() as recorder:
        out = model(x)
    assert model.acc.dtype == torch.float32
    assert relative_error(out, expected) < 2e-2
    if front_end != "rewrite-inductor":  # inductor's kernels are its own
        assert {dtype for c in recorder.calls if c.op in ("mm", "addmm", "matmul") for dtype in floating(c.in_dtypes)} \
            == {torch.bfloat16}
