"""Activation checkpointing on a rewritten model: torch.utils.checkpoint in forward (both use_reentrant settings),
checkpoint_wrapper, HF gradient_checkpointing_enable() and rewrite(checkpoint=pattern) save for backward within
15% of what torch.autocast saves with the same checkpointing, give autocast's gradients, and keep the matmuls of
the checkpointed blocks low. Dynamo traces each checkpoint as a region of the graph; graphamp casts inside it."""

import copy

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import graphamp
from graphamp.inspection.activation_memory import saved_activation_bytes
from models import BlockStack, ResidualBlock, gpt2, token_batch
from training import matmul_dtypes, relative_error

# graphamp's warnings that code ran eagerly, in float32, outside its graphs: none may pass unless a test expects it.
pytestmark = pytest.mark.filterwarnings("error:graphamp. :UserWarning")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 128)
        self.fc2 = nn.Linear(128, 32)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class CheckpointedStack(nn.Module):
    """Three blocks, each under torch.utils.checkpoint unless use_reentrant is None."""

    def __init__(self, use_reentrant):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for block in self.blocks:
            if self.use_reentrant is None:
                x = block(x)
            else:
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
        return x.square().mean()


def saved_bytes_and_gradients(model, loss_fn):
    saved = saved_activation_bytes(model, loss_fn)
    model.zero_grad()
    loss_fn().backward()
    return saved, [p.grad.clone() for p in model.parameters()]


def compare_with_autocast(model, eager, amp_loss, eager_loss):
    """(graphamp's saved bytes, autocast's saved bytes, the worst relative gradient error against autocast), for a
    rewritten `model` and `eager`, its FP32 twin copied before rewrite."""
    amp_loss()  # compiled outside the measurement
    amp_saved, amp_grads = saved_bytes_and_gradients(model, amp_loss)

    def autocast_loss():
        with torch.autocast("cpu", torch.bfloat16):
            return eager_loss()

    autocast_saved, autocast_grads = saved_bytes_and_gradients(eager, autocast_loss)
    return amp_saved, autocast_saved, max(relative_error(a, b) for a, b in zip(amp_grads, autocast_grads))


def stack_and_batch(use_reentrant):
    torch.manual_seed(0)
    return CheckpointedStack(use_reentrant), torch.randn(16, 32, requires_grad=True)


def unchecked_saved_bytes(x, amp_lists) -> int:
    model, _ = stack_and_batch(None)
    graphamp.rewrite(model, (x,), amp_lists=amp_lists)
    return saved_activation_bytes(model, lambda: model(x))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_torch_checkpoint_in_forward_saves_what_autocast_saves(bf16, use_reentrant):
    model, x = stack_and_batch(use_reentrant)
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    amp_saved, autocast_saved, gradient_error = compare_with_autocast(model, eager, lambda: model(x), lambda: eager(x))
    assert abs(amp_saved - autocast_saved) <= 0.15 * autocast_saved
    assert amp_saved < 0.5 * unchecked_saved_bytes(x, bf16)  # the checkpoint really dropped activations
    assert gradient_error < 1e-2
    assert matmul_dtypes(model) == [torch.bfloat16] * 6


class DropoutBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.dropout, self.fc2 = nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 32)

    def forward(self, x):
        return self.fc2(self.dropout(torch.relu(self.fc1(x))))


class NestedCheckpoints(nn.Module):
    """A checkpointed region holding another, with dropout in both."""

    def __init__(self):
        super().__init__()
        self.inner, self.fc, self.dropout = DropoutBlock(), nn.Linear(32, 32), nn.Dropout(0.5)

    def forward(self, x):
        return self.fc(self.dropout(torch_checkpoint.checkpoint(self.inner, x, use_reentrant=False)))


class CheckpointedDropout(nn.Module):
    def __init__(self, use_reentrant, block=DropoutBlock):
        super().__init__()
        self.block, self.head, self.use_reentrant = block(), nn.Linear(32, 1), use_reentrant

    def forward(self, x):
        if self.use_reentrant is None:
            return self.head(self.block(x)).square().mean()
        h = torch_checkpoint.checkpoint(self.block, x, use_reentrant=self.use_reentrant)
        return self.head(h).square().mean()


@pytest.mark.parametrize("checkpointing", ["use_reentrant=False", "use_reentrant=True", "rewrite(checkpoint=...)",
                                           "nested"])
def test_dropout_in_a_checkpointed_region_is_recomputed_with_its_forward_mask(bf16, checkpointing):
    """Run as fx code, the region's recompute in backward draws the forward's dropout mask again (torch's own call
    of the region turns preserve_rng_state off, for inductor): the gradients are autocast's with the same seed."""
    torch.manual_seed(0)
    by_pattern = checkpointing.startswith("rewrite")
    if checkpointing == "nested":
        model = CheckpointedDropout(False, NestedCheckpoints)
    else:
        model = CheckpointedDropout(None if by_pattern else checkpointing.endswith("True"))
    eager = copy.deepcopy(model)
    x = torch.randn(8, 32, requires_grad=True)
    graphamp.rewrite(model, amp_lists=bf16, checkpoint="block" if by_pattern else None)
    gradients = {}
    for name, net, region in [("graphamp", model, torch.autocast("cpu", enabled=False)),
                              ("autocast", eager, torch.autocast("cpu", torch.bfloat16))]:
        torch.manual_seed(1)
        with region:
            loss = net(x)
        loss.backward()
        gradients[name] = [p.grad for p in net.parameters()]

    assert all(relative_error(a, b) < 1e-2 for a, b in zip(gradients["graphamp"], gradients["autocast"]))


def test_checkpoint_pattern_saves_what_autocast_saves_with_torch_checkpoint(bf16):
    model, x = stack_and_batch(None)
    checkpointed_twin, _ = stack_and_batch(False)  # the same weights, checkpointed by hand in eager
    graphamp.rewrite(model, amp_lists=bf16, checkpoint="blocks.*")
    amp_saved, autocast_saved, gradient_error = compare_with_autocast(
        model, checkpointed_twin, lambda: model(x), lambda: checkpointed_twin(x)
    )
    assert abs(amp_saved - autocast_saved) <= 0.15 * autocast_saved
    assert gradient_error < 1e-2
    assert matmul_dtypes(model) == [torch.bfloat16] * 6


def test_checkpoint_pattern_checkpoints_the_outermost_matches_only(bf16):
    """fnmatch's * crosses dots: 'blocks.*' matches blocks.0.fc1 too, which its block's checkpoint already covers."""
    model, _ = stack_and_batch(None)
    graphamp.rewrite(model, amp_lists=bf16, checkpoint="blocks.*")
    assert all("forward" in vars(block) for block in model.blocks)
    assert not any("forward" in vars(layer) for block in model.blocks for layer in block.children())


def test_checkpoint_pattern_matching_nothing_is_refused(bf16):
    model, x = stack_and_batch(None)
    with pytest.raises(graphamp.ArgumentError, match="matches no submodule"):
        graphamp.rewrite(model, (x,), amp_lists=bf16, checkpoint="layers.*")


def test_checkpoint_pattern_keeps_an_instance_forward_inside_the_checkpoint(bf16):
    """accelerate's hooks set `module.forward` on the instance: the checkpoint runs that one, not the class's."""
    model, x = stack_and_batch(None)
    eager = copy.deepcopy(model)
    for net in (model, eager):
        class_forward = net.blocks[1].forward
        net.blocks[1].forward = lambda *args, class_forward=class_forward: class_forward(*args) * 2
    instance_forward = model.blocks[1].forward
    graphamp.rewrite(model, amp_lists=bf16, checkpoint="blocks.*")
    _, _, gradient_error = compare_with_autocast(model, eager, lambda: model(x), lambda: eager(x))
    assert gradient_error < 1e-2  # the class's forward alone would give other gradients
    assert model.blocks[1].forward.args == (instance_forward,)


def test_checkpoint_wrapper_on_the_blocks_saves_what_autocast_saves(bf16, seeded):
    """checkpoint_wrapper (FSDP's companion, apply_activation_checkpointing) checkpoints each block in its module."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing, checkpoint_wrapper,
    )

    model, tokens = BlockStack(n_blocks=3), token_batch()
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda module: isinstance(module, ResidualBlock)
    )
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    amp_saved, autocast_saved, gradient_error = compare_with_autocast(
        model, eager, lambda: model(tokens, tokens), lambda: eager(tokens, tokens)
    )
    assert abs(amp_saved - autocast_saved) <= 0.15 * autocast_saved
    assert gradient_error < 1e-2
    assert matmul_dtypes(model) == [torch.bfloat16] * 7  # the blocks' up and down projections, the head


def test_checkpoint_pattern_on_the_blocks_of_a_block_stack_matches_autocast(bf16, seeded):
    """What rewrite(regions=..., checkpoint=...) did: the blocks recomputed in backward, in mixed precision."""
    model, tokens = BlockStack(n_blocks=3), token_batch()
    eager = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16, checkpoint="blocks.*")
    graphamp.rewrite(plain, amp_lists=bf16)
    plain(tokens, tokens)
    _, _, gradient_error = compare_with_autocast(
        model, eager, lambda: model(tokens, tokens), lambda: eager(tokens, tokens)
    )
    assert saved_activation_bytes(model, lambda: model(tokens, tokens)) < 0.5 * saved_activation_bytes(
        plain, lambda: plain(tokens, tokens)
    )
    assert gradient_error < 1e-2


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_hf_gradient_checkpointing_saves_what_autocast_saves(bf16, use_reentrant):
    torch.manual_seed(0)
    model = gpt2(n_layer=1, n_embd=32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    eager = copy.deepcopy(model)
    ids = token_batch()
    graphamp.rewrite(model, amp_lists=bf16)
    amp_saved, autocast_saved, gradient_error = compare_with_autocast(
        model, eager, lambda: model(input_ids=ids, labels=ids).loss, lambda: eager(input_ids=ids, labels=ids).loss
    )
    assert abs(amp_saved - autocast_saved) <= 0.15 * autocast_saved
    assert gradient_error < 1e-2
    assert set(matmul_dtypes(model)) == {torch.bfloat16}


def test_hf_gradient_checkpointing_enabled_after_rewrite_takes_effect(bf16):
    """HF's switch is a Python attribute forward reads: dynamo guards on it and recompiles."""
    torch.manual_seed(0)
    model = gpt2(n_layer=1, n_embd=32)
    ids = token_batch()
    graphamp.rewrite(model, (), {"input_ids": ids, "labels": ids}, amp_lists=bf16)
    without = saved_activation_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(input_ids=ids, labels=ids)  # compiled outside the measurement
    with_checkpointing = saved_activation_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
    assert with_checkpointing < 0.5 * without


def test_composable_checkpoint_of_a_block_is_refused_with_the_fix(bf16):
    """torch.distributed's checkpoint(module) recomputes outside the graphs, eagerly in float32: backward would fail
    with a CheckpointError (as under plain torch.compile). rewrite() says what to use instead."""
    from torch.distributed._composable import checkpoint

    model, x = stack_and_batch(use_reentrant=None)
    checkpoint(model.blocks[1])
    with pytest.raises(graphamp.ArgumentError, match=r"'blocks\.1' is checkpointed .* checkpoint='blocks\.1'"):
        graphamp.rewrite(model, (x,), amp_lists=bf16)


@pytest.mark.parametrize("name, blocks", [("gpt2", "transformer.h.*"), ("llama", "model.layers.*")])
def test_checkpoint_pattern_on_hf_blocks_runs_every_gemm_low_as_hf_checkpointing_does(bf16, name, blocks):
    """rewrite(checkpoint=...) wraps each block's forward; what dynamo runs of it outside the graphs, forward and the
    recomputation in backward, follows the lists like HF's own gradient_checkpointing_enable()."""
    from conftest import CompiledCodeRecorder

    def gemm_dtypes(model):
        ids = token_batch()
        with CompiledCodeRecorder() as recorder:
            model(input_ids=ids, labels=ids).loss.backward()
        return [c.in_dtypes[0] for c in recorder.calls_of("mm", "addmm", "bmm")]

    import models

    torch.manual_seed(0)
    # one block: the pattern wraps every block alike, and dynamo's time grows with the number of blocks
    build = {"gpt2": lambda: models.gpt2(n_layer=1), "llama": lambda: models.llama(num_hidden_layers=1)}[name]
    ours, hf = build(), build()
    hf.load_state_dict(ours.state_dict())
    graphamp.rewrite(ours, amp_lists=bf16, checkpoint=blocks)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    graphamp.rewrite(hf, amp_lists=bf16)
    ours_dtypes, hf_dtypes = gemm_dtypes(ours), gemm_dtypes(hf)
    assert set(hf_dtypes) == {torch.bfloat16}
    assert set(ours_dtypes) == {torch.bfloat16} and len(ours_dtypes) >= len(hf_dtypes)
