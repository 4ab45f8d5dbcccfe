"""Activation checkpointing survives the rewrite: torch.utils.checkpoint (both use_reentrant settings), HF
gradient_checkpointing_enable() and rewrite(checkpoint=pattern) save for backward within 15% of what
torch.autocast saves with the same checkpointing, and give autocast's gradients, with rewrite's default settings.
With regions, checkpoint= still checkpoints the blocks it names; torch.distributed's composable checkpoint(module)
makes its module a region of its own."""

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import graphamp
from graphamp.inspection.activation_memory import saved_activation_bytes
from models import gpt2, token_batch
from training import relative_error


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 128)
        self.fc2 = nn.Linear(128, 32)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class CheckpointedStack(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for block in self.blocks:
            x = x if self.use_reentrant is None else torch_checkpoint.checkpoint(
                block, x, use_reentrant=self.use_reentrant
            )
            x = block(x) if self.use_reentrant is None else x
        return x.square().mean()


def saved_bytes_and_gradients(model, loss_fn):
    saved = saved_activation_bytes(model, loss_fn)
    model.zero_grad()
    loss_fn().backward()
    return saved, [p.grad.clone() for p in model.parameters()]


def compare_with_autocast(model, amp_loss, eager_loss):
    """(graphamp's saved bytes, autocast's saved bytes, the worst relative gradient error against autocast)."""
    amp_saved, amp_grads = saved_bytes_and_gradients(model, amp_loss)

    def autocast_loss():
        with torch.autocast("cpu", torch.bfloat16):
            return eager_loss()

    autocast_saved, autocast_grads = saved_bytes_and_gradients(model, autocast_loss)
    return amp_saved, autocast_saved, max(relative_error(a, b) for a, b in zip(amp_grads, autocast_grads))


def stack_and_batch(use_reentrant):
    torch.manual_seed(0)
    return CheckpointedStack(use_reentrant), torch.randn(16, 32, requires_grad=True)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_torch_checkpoint_saves_what_autocast_saves(bf16, use_reentrant):
    model, x = stack_and_batch(use_reentrant)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    amp_saved, autocast_saved, gradient_error = compare_with_autocast(model, lambda: amp(x), lambda: model(x))
    _, unchecked_saved, _ = compare_with_autocast(*_unchecked(x, bf16))
    assert abs(amp_saved - autocast_saved) <= 0.15 * autocast_saved
    assert amp_saved < 0.5 * unchecked_saved  # the checkpoint really dropped activations
    assert gradient_error < 1e-2


def _unchecked(x, amp_lists):
    model, _ = stack_and_batch(None)
    amp = graphamp.rewrite(model, (x,), amp_lists=amp_lists)
    return model, lambda: amp(x), lambda: model(x)


def test_checkpoint_pattern_saves_what_autocast_saves_with_torch_checkpoint(bf16):
    model, x = stack_and_batch(None)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16, checkpoint="blocks.*")
    checkpointed_twin, _ = stack_and_batch(False)  # the same weights, checkpointed by hand in eager
    amp_saved, _, gradient_error = compare_with_autocast(model, lambda: amp(x), lambda: model(x))
    twin_loss = lambda: checkpointed_twin(x)  # noqa: E731
    _, autocast_saved, _ = compare_with_autocast(checkpointed_twin, twin_loss, twin_loss)
    assert abs(amp_saved - autocast_saved) <= 0.15 * autocast_saved
    assert gradient_error < 1e-2


def test_checkpoint_pattern_matching_nothing_is_refused(bf16):
    model, x = stack_and_batch(None)
    with pytest.raises(ValueError, match="matches no submodule"):
        graphamp.rewrite(model, (x,), amp_lists=bf16, checkpoint="layers.*")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_hf_gradient_checkpointing_saves_what_autocast_saves(bf16, use_reentrant):
    torch.manual_seed(0)
    model = gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ids = token_batch()
    amp = graphamp.rewrite(model, (), {"input_ids": ids, "labels": ids}, amp_lists=bf16)
    amp_saved, autocast_saved, gradient_error = compare_with_autocast(
        model, lambda: amp(input_ids=ids, labels=ids).loss, lambda: model(input_ids=ids, labels=ids).loss
    )
    assert abs(amp_saved - autocast_saved) <= 0.15 * autocast_saved
    assert gradient_error < 1e-2


def test_hf_gradient_checkpointing_saves_less_than_without(bf16):
    torch.manual_seed(0)
    model = gpt2()
    ids = token_batch()
    amp = graphamp.rewrite(model, (), {"input_ids": ids, "labels": ids}, amp_lists=bf16)
    without = saved_activation_bytes(model, lambda: amp(input_ids=ids, labels=ids).loss)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    amp.recapture()  # HF's switch is a Python attribute read in forward
    amp(input_ids=ids, labels=ids)  # captured outside the measurement
    with_checkpointing = saved_activation_bytes(model, lambda: amp(input_ids=ids, labels=ids).loss)
    assert with_checkpointing < 0.5 * without


def test_checkpoint_pattern_leaves_the_modules_forward_as_it_was(bf16):
    model, x = stack_and_batch(None)
    instance_forward = model.blocks[1].forward
    model.blocks[1].forward = instance_forward  # as accelerate's hooks set one
    graphamp.rewrite(model, (x,), amp_lists=bf16, checkpoint="blocks.*")
    assert "forward" not in vars(model.blocks[0])
    assert vars(model.blocks[1])["forward"] is instance_forward


def test_checkpoint_pattern_on_the_regions_checkpoints_them(bf16):
    torch.manual_seed(0)
    model, x = CheckpointedStack(use_reentrant=None), torch.randn(16, 32)
    plain = graphamp.rewrite(model, (x,), amp_lists=bf16, regions="blocks.*")
    plain_saved, plain_grads = saved_bytes_and_gradients(model, lambda: plain(x))
    marked = graphamp.rewrite(model, (x,), amp_lists=bf16, regions="blocks.*", checkpoint="blocks.*")
    marked_saved, marked_grads = saved_bytes_and_gradients(model, lambda: marked(x))
    assert marked_saved < plain_saved / 2
    assert all(relative_error(a, b) < 1e-6 for a, b in zip(marked_grads, plain_grads))


def test_composable_checkpoint_on_a_block_saves_what_autocast_saves(bf16):
    from torch.distributed._composable import checkpoint

    model, x = stack_and_batch(use_reentrant=None)
    for block in model.blocks:
        checkpoint(block)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    amp_saved, autocast_saved, error = compare_with_autocast(model, lambda: amp(x), lambda: model(x))
    assert amp_saved <= 1.15 * autocast_saved
    assert error < 2e-2
