"""Regional rewrite: blocks run as their own rewritten graphs, through their modules' __call__ (hooks included)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed._composable import checkpoint

import graphamp
from models import BlockStack, gpt2, token_batch
from training import relative_error

BF16_TOLERANCE = 2e-2


def parameter_grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_gpt2_with_regions_computes_what_the_whole_model_rewrite_computes(seeded, bf16):
    model, tokens = gpt2(), token_batch()
    whole = graphamp.rewrite(model, (tokens,), {"labels": tokens}, amp_lists=bf16)
    expected = whole(tokens, labels=tokens)
    expected.loss.backward()
    expected_grads = parameter_grads(model)
    model.zero_grad()

    regional = graphamp.rewrite(model, (tokens,), {"labels": tokens}, amp_lists=bf16, regions="transformer.h.*")
    result = regional(tokens, labels=tokens)
    result.loss.backward()

    assert torch.equal(result.logits, expected.logits)  # the same casts: the whole-model decisions, cut apart
    assert all(map(torch.equal, parameter_grads(model), expected_grads))
    with torch.no_grad():
        fp32_logits = copy.deepcopy(model)(tokens).logits
    assert not torch.equal(result.logits, fp32_logits)  # not a no-op: the blocks ran in bfloat16
    assert relative_error(result.logits, fp32_logits) < BF16_TOLERANCE


def test_regions_match_eager_autocast(seeded, bf16):
    model, tokens = BlockStack(), token_batch()
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(tokens, tokens)
    expected.backward()
    expected_grads = parameter_grads(model)
    model.zero_grad()

    loss = graphamp.rewrite(model, (tokens, tokens), amp_lists=bf16, regions="blocks.*")(tokens, tokens)
    loss.backward()

    assert relative_error(loss, expected) < BF16_TOLERANCE
    for grad, expected_grad in zip(parameter_grads(model), expected_grads):
        assert relative_error(grad, expected_grad) < BF16_TOLERANCE


def test_identical_blocks_share_one_rewritten_graph(seeded, bf16):
    model, tokens = BlockStack(n_blocks=4), token_batch()
    amp_model = graphamp.rewrite(model, (tokens, tokens), amp_lists=bf16, regions="blocks.*")
    pieces = [next(iter(forward.pieces.values())) for forward in amp_model._regions.forwards.values()]
    assert len(pieces) == 4
    assert all(piece.graph_module is pieces[0].graph_module for piece in pieces)
    assert pieces[0].state[0].owner is model.blocks[0].norm and pieces[3].state[0].owner is model.blocks[3].norm


def test_forward_hooks_on_a_region_run_on_every_call_with_the_blocks_arguments(seeded, bf16):
    model, tokens = BlockStack(), token_batch()
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda module, args: seen.append(("pre", tuple(args[0].shape))))
    model.blocks[1].register_forward_hook(lambda module, args, output: seen.append(("post", output.dtype)))
    amp_model = graphamp.rewrite(model, (tokens, tokens), amp_lists=bf16, regions="blocks.*")
    seen.clear()  # capture does not run them: they are the call's, not the graph's
    for _ in range(3):
        amp_model(tokens, tokens)
    assert seen == [("pre", (2, 16, 64)), ("post", torch.float32)] * 3


def test_a_forward_hook_that_changes_a_blocks_output_changes_the_result_as_in_eager(seeded, bf16):
    model, tokens = BlockStack(), token_batch()
    model.blocks[0].register_forward_hook(lambda module, args, output: output * 0.0)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(tokens, tokens)
    loss = graphamp.rewrite(model, (tokens, tokens), amp_lists=bf16, regions="blocks.*")(tokens, tokens)
    assert relative_error(loss, expected) < BF16_TOLERANCE


def test_a_full_backward_hook_on_a_region_sees_the_gradient_eager_sees(seeded, bf16):
    model, tokens = BlockStack(), token_batch()
    grad_outputs = []
    model.blocks[1].register_full_backward_hook(lambda module, grad_in, grad_out: grad_outputs.append(grad_out[0]))
    with torch.autocast("cpu", torch.bfloat16):
        model(tokens, tokens).backward()
    amp_model = graphamp.rewrite(model, (tokens, tokens), amp_lists=bf16, regions="blocks.*")
    amp_model(tokens, tokens).backward()
    assert len(grad_outputs) == 2
    assert relative_error(grad_outputs[1], grad_outputs[0]) < BF16_TOLERANCE


def saved_tensor_count(amp_model, tokens) -> int:
    count = 0

    def pack(tensor):
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = amp_model(tokens, tokens)
    loss.backward()
    return count


def test_a_checkpointed_region_saves_fewer_tensors_and_gives_the_same_gradients(seeded, bf16):
    tokens = token_batch()
    plain = BlockStack(n_blocks=4)
    checkpointed = copy.deepcopy(plain)
    for block in checkpointed.blocks:
        checkpoint(block)  # activation checkpointing as module hooks, FSDP2's companion
    plain_model = graphamp.rewrite(plain, (tokens, tokens), amp_lists=bf16, regions="blocks.*")
    checkpointed_model = graphamp.rewrite(checkpointed, (tokens, tokens), amp_lists=bf16, regions="blocks.*")

    assert saved_tensor_count(checkpointed_model, tokens) < saved_tensor_count(plain_model, tokens) / 2
    assert all(map(torch.equal, parameter_grads(checkpointed), parameter_grads(plain)))


def test_a_block_called_on_its_own_runs_its_class_forward(seeded, bf16):
    model, tokens = BlockStack(), token_batch()
    graphamp.rewrite(model, (tokens, tokens), amp_lists=bf16, regions="blocks.*")
    x = torch.randn(3, 5, 64)  # a shape no capture has seen
    block = model.blocks[0]
    assert torch.equal(block(x), type(block).forward(block, x))


def test_regions_matching_no_module_raise_with_the_fix(bf16):
    tokens = token_batch()
    with pytest.raises(graphamp.CaptureError, match=r"matches no submodule.*'blocks\.\*'"):
        graphamp.rewrite(BlockStack(), (tokens, tokens), amp_lists=bf16, regions="layers.*")


def test_a_pattern_component_does_not_match_across_dots(bf16):
    tokens = token_batch()
    amp_model = graphamp.rewrite(BlockStack(), (tokens, tokens), amp_lists=bf16, regions="blocks.*")
    assert amp_model._regions.paths == ["blocks.0", "blocks.1"]


def test_nested_regions_raise_with_the_fix(bf16):
    tokens = token_batch()
    with pytest.raises(graphamp.CaptureError, match="inside 'blocks.0'"):
        graphamp.rewrite(BlockStack(), (tokens, tokens), amp_lists=bf16, regions=["blocks.*", "blocks.0.up"])


def test_compile_compiles_identical_blocks_once(seeded, bf16):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, tokens = BlockStack(n_blocks=3), token_batch()
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(tokens, tokens)
    amp_model = graphamp.rewrite(model, (tokens, tokens), amp_lists=bf16, regions="blocks.*", compile=True)
    before = counters["stats"]["unique_graphs"]
    loss = amp_model(tokens, tokens)
    loss.backward()
    assert counters["stats"]["unique_graphs"] - before == 1
    assert relative_error(loss, expected) < BF16_TOLERANCE
