"""PEFT: rewrite() refuses a PeftModel, whose generate() and merge_and_unload() reach the unconverted model inside,
and the recipe its error gives (rewrite the base model, then peft.get_peft_model) trains, generates and merges low."""

from __future__ import annotations

import pytest
import torch

import graphamp
from graphamp.inspection.recording import floating
from graphamp.passes.marks import mark_of
from conftest import CompiledCodeRecorder
from models import gpt2, token_batch

peft = pytest.importorskip("peft")

MATMUL_KERNELS = ("addmm", "mm", "bmm")
# Per GPT-2 layer: c_attn, its adapters' A and B, attn.c_proj, mlp.c_fc, mlp.c_proj; then lm_head.
LAYERS = 1  # the recipe's GPT-2s have one layer: dynamo's time grows with the layers
FORWARD_MATMULS = LAYERS * 6 + 1


def lora_config():
    # init_lora_weights=False: B is not zeros, so the adapters change the output from the start
    return peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)


def matmuls_in(recorder: CompiledCodeRecorder, dtype: torch.dtype) -> int:
    return sum(floating(call.in_dtypes) == {dtype} for call in recorder.calls_of(*MATMUL_KERNELS))


def recipe(bf16):
    """A tiny GPT-2 rewritten first, then given LoRA adapters: (the PeftModel, the rewritten base model)."""
    torch.manual_seed(0)
    base = graphamp.rewrite(gpt2(n_layer=LAYERS), amp_lists=bf16)
    return peft.get_peft_model(base, lora_config()), base


def test_rewrite_of_a_peft_model_is_refused_with_the_recipe(bf16):
    torch.manual_seed(0)
    lora = peft.get_peft_model(gpt2(), lora_config())

    with pytest.raises(graphamp.ArgumentError, match=r"rewrite\(\) got a peft PeftModel: its generate\(\) and "
                                                     r"merge_and_unload\(\) reach the model inside.*"
                                                     r"graphamp\.rewrite\(base_model, \.\.\.\), then "
                                                     r"peft\.get_peft_model\(base_model, config\)"):
        graphamp.rewrite(lora, amp_lists=bf16)
    assert not graphamp.is_rewritten(lora.get_base_model())  # refused before converting anything


def test_the_model_inside_a_peft_model_is_not_refused(bf16):
    """peft gives the wrapped model a peft_config too; only the PeftModel (with get_base_model) is refused."""
    torch.manual_seed(0)
    inner = peft.get_peft_model(gpt2(), lora_config()).get_base_model()

    assert graphamp.rewrite(inner, amp_lists=bf16) is inner


def test_the_recipe_trains_the_base_and_adapter_matmuls_low(bf16):
    lora, base = recipe(bf16)
    ids = token_batch(2, 8)

    with CompiledCodeRecorder() as recorder:
        lora(input_ids=ids, labels=ids).loss.backward()

    assert matmuls_in(recorder, torch.float32) == 0
    assert matmuls_in(recorder, torch.bfloat16) >= 2 * FORWARD_MATMULS  # forward, and at least as many backward
    adapter_dtypes = {
        node.meta["val"].dtype for graph in graphamp.rewritten_graphs(base) for node in graph.graph_module.graph.nodes
        if getattr(node.target, "_opname", None) in ("linear", "mm") and "lora_" in mark_of(node).module
    }
    assert adapter_dtypes == {torch.bfloat16}
    assert all(p.grad is not None for name, p in lora.named_parameters() if "lora_" in name)


def test_generate_of_the_recipe_runs_the_rewritten_model(bf16):
    lora, _ = recipe(bf16)

    with CompiledCodeRecorder() as recorder:
        lora.generate(input_ids=token_batch(2, 4), max_new_tokens=3, do_sample=False, pad_token_id=0)

    assert matmuls_in(recorder, torch.float32) == 0
    assert matmuls_in(recorder, torch.bfloat16) >= 3 * FORWARD_MATMULS  # the prompt and two more tokens at least


def test_merge_and_unload_of_the_recipe_gives_back_the_rewritten_model(bf16):
    lora, base = recipe(bf16)
    merged = lora.merge_and_unload()

    with CompiledCodeRecorder() as recorder:
        merged(input_ids=token_batch(2, 8))

    assert merged is base
    assert matmuls_in(recorder, torch.float32) == 0
    assert matmuls_in(recorder, torch.bfloat16) >= FORWARD_MATMULS - 2 * LAYERS  # the merged layers hold no adapters
