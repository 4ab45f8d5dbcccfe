"""Clipping with optimizer.backward(loss): the scaled gradients are never clipped into a wrong step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphamp


def model_and_batch():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), torch.randn(4, 8), torch.randn(4, 2)


def loss_of(model, x, y):
    return nn.functional.mse_loss(model(x), y) * 10


def assert_clipped_as_fp32(model, reference, x, y, norm, max_norm, **tolerance):
    """`norm` and `model`'s parameters are those of FP32's SGD step clipped to `max_norm` on `reference`."""
    loss_of(reference, x, y).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(norm, expected, **tolerance)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, **tolerance)


def test_clipping_scaled_gradients_before_unscale_is_refused_and_nothing_steps(fp16):
    model, x, y = model_and_batch()
    before = copy.deepcopy(model.state_dict())
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=1024.0)
    optimizer.backward(loss_of(model, x, y))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(graphamp.LossScalingError, match="call optimizer.unscale_\\(\\) before clipping"):
        optimizer.step()
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_clipping_after_unscale_clips_the_true_gradients(fp16):
    model, x, y = model_and_batch()
    reference = copy.deepcopy(model)
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=1024.0)
    optimizer.backward(loss_of(model, x, y))
    optimizer.unscale_()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    assert_clipped_as_fp32(model, reference, x, y, norm, 1.0)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["clip-without-unscale", "unscale-then-clip"])
def test_linked_gradients_are_true_after_backward_so_a_clip_before_unscale_clips_them(fp16, unscale_first):
    # docs/loss_scaling.md, Clipping: linked, the graphs unscale as the gradients leave them
    model, x, y = model_and_batch()
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=fp16)
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model,
                                 init_loss_scaling=1024.0)
    loss_of(model, x, y).float().backward()
    if unscale_first:
        optimizer.unscale_()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optimizer.step()
    assert not optimizer.step_was_skipped
    assert_clipped_as_fp32(model, reference, x, y, norm, 0.05, rtol=1e-2, atol=1e-3)  # float16 forward


def test_accelerators_clip_of_scaled_gradients_is_refused(fp16):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    model, x, y = model_and_batch()
    accelerator = accelerate.Accelerator(mixed_precision="no", cpu=True)
    model, optimizer = accelerator.prepare(
        model, graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=1024.0)
    )
    optimizer.optimizer.backward(loss_of(model, x, y))  # docs/backend.md: opt.backward(loss) without a link
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(graphamp.LossScalingError, match="clipped scaled gradients"):
        optimizer.step()
    AcceleratorState._reset_state(reset_partial_state=True)


def test_gradient_accumulation_over_several_scaled_backwards_still_steps(fp16):
    model, x, y = model_and_batch()
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=1024.0)
    for _ in range(3):
        optimizer.backward(loss_of(model, x, y))
    optimizer.step()
    assert optimizer.skipped_steps == 0
