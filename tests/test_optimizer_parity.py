"""A decorated optimizer and its rewritten model never silently diverge from eager PyTorch (issue 23): copies, steps
without gradients, closure optimizers, higher-order gradients and backward long after its forward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphamp
from models import regression_batch as batch
from training import COPIES, grads, relative_error
from training import rewritten_regression as rewritten, rewritten_regression_and_eager as rewritten_and_eager



def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- copies of a decorated model ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make_copy", COPIES.values(), ids=COPIES.keys())
def test_decorated_model_copies_and_gives_the_same_loss(fp16, make_copy):
    model = rewritten(fp16)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    twin = make_copy(model)
    assert torch.equal(twin(*batch(1)), model(*batch(1)))
    assert len(graphamp.rewritten_graphs(twin)) == 1  # the copy runs graphamp's graph of its own


@pytest.mark.parametrize("model_first", [True, False], ids=["model_first", "optimizer_first"])
@pytest.mark.parametrize("make_copy", COPIES.values(), ids=COPIES.keys())
def test_model_and_optimizer_copied_together_train_the_copy_with_in_graph_scaling(fp16, make_copy, model_first):
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    model(*batch(1)).backward()
    opt.step()
    opt.zero_grad()
    # A checkpoint may hold either first; unpickled first, the optimizer finds no model holding its parameters yet.
    if model_first:
        twin, twin_opt = make_copy((model, opt))
    else:
        twin_opt, twin = make_copy((opt, model))

    twin(*batch(2)).backward()
    model(*batch(2)).backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(twin), grads(model)))
    twin_opt.step()  # linked: the gradients were scaled in twin's graph, so step() accepts them
    opt.step()
    assert twin_opt.skipped_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), model.parameters()))


def test_deepcopy_trained_with_its_own_optimizer_uses_its_own_loss_scaling(fp16):
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**10, model=model)
    twin = copy.deepcopy(model)
    twin_opt = graphamp.decorate(torch.optim.SGD(twin.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**4, model=twin)

    twin(*batch(1)).backward()
    twin_opt.step()  # the copy's gradients were scaled by its own optimizer's scale
    assert twin_opt.skipped_steps == 0
    model(*batch(1)).backward()
    opt.step()
    assert opt.skipped_steps == 0
    # Had the copy's graph scaled by the original's 2**10, its 2**4 unscale would leave gradients 64 times too large.
    assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-4) for a, b in zip(twin.parameters(), model.parameters()))


def test_shallow_copy_of_the_optimizer_leaves_the_models_link_alone(fp16):
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    copy.copy(opt)  # dropped at once: had it taken the link, the link would be gone with it
    before = weights(model)
    model(*batch(1)).backward()
    opt.step()  # accepted: the model's graph scaled the plain backward's gradients by opt's loss scaling
    assert opt.skipped_steps == 0 and not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# -- steps without gradients --------------------------------------------------------------------------------------


def test_step_without_gradients_is_a_no_op_as_in_eager(fp16):
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.Adam(model.parameters(), lr=0.1), fp16, model=model)
    before, scale = weights(model), opt.get_loss_scaling()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert opt.get_loss_scaling() == scale and opt.skipped_steps == 0 and not opt.state

    model(*batch(1)).backward()  # the next iteration trains as usual
    opt.step()
    assert not any(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_unused_optimizer_of_a_shared_list_steps_as_a_no_op(fp16):
    model, eager = rewritten_and_eager(fp16)
    unused = nn.Linear(2, 2)
    used_opt, unused_opt = graphamp.decorate(
        [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(unused.parameters(), lr=0.1)],
        fp16, init_loss_scaling=2.0**10, incr_every_n_steps=1, model=model,
    )
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    unused_before = weights(unused)
    for step in range(2):
        model(*batch(step)).backward()
        used_opt.step()
        unused_opt.step()
        used_opt.zero_grad()
        eager(*batch(step)).backward()
        eager_opt.step()
        eager_opt.zero_grad()

    assert used_opt.get_loss_scaling() == 2.0**12  # the shared update ran after each iteration
    assert all(torch.equal(a, b) for a, b in zip(unused.parameters(), unused_before))
    assert all(relative_error(a, b) < 1e-2 for a, b in zip(model.parameters(), eager.parameters()))


# -- closure optimizers -------------------------------------------------------------------------------------------


def lbfgs_steps(model, opt, steps: int = 3, poison: float | None = None) -> list[float]:
    def closure():
        opt.zero_grad()
        loss = model(*batch(1, poison))
        loss.backward()
        return loss

    return [opt.step(closure).item() for _ in range(steps)]


def test_lbfgs_step_with_closure_matches_eager_fp32(fp16):
    model, eager = rewritten_and_eager(fp16)
    opt = graphamp.decorate(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4), fp16, model=model)
    losses = lbfgs_steps(model, opt)
    eager_losses = lbfgs_steps(eager, torch.optim.LBFGS(eager.parameters(), lr=0.5, max_iter=4))

    assert losses[-1] < losses[0]
    assert relative_error(losses, eager_losses) < 1e-2
    assert all(relative_error(a, b) < 2e-2 for a, b in zip(model.parameters(), eager.parameters()))


def test_lbfgs_step_with_inf_gradients_is_skipped_and_the_scale_halves(fp16):
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4), fp16, model=model)
    before, scale = weights(model), opt.get_loss_scaling()
    lbfgs_steps(model, opt, steps=1, poison=float("inf"))
    assert opt.found_inf and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert opt.get_loss_scaling() == scale / 2


# -- higher-order gradients ---------------------------------------------------------------------------------------


def penalized_gradients(model, wrt: str) -> list[torch.Tensor]:
    """.grad after backward of the loss plus the norm of its gradient w.r.t. the parameters or the input."""
    x, y = batch(1)
    x.requires_grad_(wrt == "input")
    loss = model(x, y)
    inputs = [x] if wrt == "input" else list(model.parameters())
    penalty = torch.cat([g.flatten() for g in torch.autograd.grad(loss, inputs, create_graph=True)]).norm()
    (loss + penalty).backward()
    return grads(model)


@pytest.mark.parametrize("wrt", ["parameters", "input"])
def test_gradient_penalty_matches_the_unscaled_path(fp16, wrt):
    scaled = rewritten(fp16)
    graphamp.decorate(torch.optim.SGD(scaled.parameters(), lr=0.1), fp16, init_loss_scaling=256.0, model=scaled)
    unscaled = rewritten(fp16)
    graphamp.decorate(
        torch.optim.SGD(unscaled.parameters(), lr=0.1), fp16, use_dynamic_loss_scaling=False, init_loss_scaling=1.0,
        model=unscaled,
    )
    for a, b in zip(penalized_gradients(scaled, wrt), penalized_gradients(unscaled, wrt)):
        assert relative_error(a, b) < 1e-2


def penalized_gradients_of_outputs(fp16, **scaling) -> list[torch.Tensor]:
    """The loss computed outside the graph from its outputs, so the first-order gradient entering it requires grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    graphamp.rewrite(model, (batch(0)[0],), amp_lists=fp16)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, **scaling, model=model)
    x = batch(1)[0].requires_grad_()
    loss = model(x).pow(3).mean()
    penalty = sum(g.pow(2).sum() for g in torch.autograd.grad(loss, [x, *model.parameters()], create_graph=True))
    (loss + penalty).backward()
    return [*grads(model), x.grad]


def test_gradient_penalty_of_a_loss_outside_the_graph_matches_the_unscaled_path(fp16):
    scaled = penalized_gradients_of_outputs(fp16, init_loss_scaling=1024.0)
    unscaled = penalized_gradients_of_outputs(fp16, use_dynamic_loss_scaling=False, init_loss_scaling=1.0)
    for a, b in zip(scaled, unscaled):
        assert relative_error(a, b) < 1e-2


# -- backward long after its forward ------------------------------------------------------------------------------


def linked_with_the_gradients_of_batch_1(fp16):
    """A linked rewritten model, its decorated SGD, and the gradients of batch 1 from a backward right after its
    forward."""
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**10, model=model)
    model(*batch(1)).backward()
    expected = grads(model)
    opt.zero_grad()
    return model, opt, expected


def test_backward_after_a_skipped_step_and_another_forward_uses_its_own_forwards_scale(fp16):
    model, opt, expected = linked_with_the_gradients_of_batch_1(fp16)

    first = model(*batch(1))
    model(*batch(2, poison=float("inf"))).backward()
    opt.step()  # skipped: the scale halves
    opt.zero_grad()
    assert opt.skipped_steps == 1
    second = model(*batch(1))
    first.backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), expected))
    opt.zero_grad()
    second.backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), expected))


def test_backward_after_a_step_gives_the_gradients_of_the_forward_as_it_ran(fp16):
    """As torch.autocast: the forward saved its low-precision weights, so backward differentiates the forward that
    ran (the weights before the step). Eager FP32 raises instead: it saved the master weights the step wrote."""
    model, opt, expected = linked_with_the_gradients_of_batch_1(fp16)

    loss = model(*batch(1))
    model(*batch(2)).backward()
    before = weights(model)
    opt.step()
    opt.zero_grad()
    assert not any(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), expected))


def test_backward_after_a_step_raises_as_in_eager_for_weights_run_in_fp32(fp16):
    """A normalization weight stays FP32, so the forward saved the master weight itself (as torch.autocast does)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    graphamp.rewrite(model, (batch(0)[0],), amp_lists=fp16)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    loss = model(batch(1)[0]).pow(2).mean()
    with torch.no_grad():
        model[1].weight.add_(1.0)  # what a step in between does
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
