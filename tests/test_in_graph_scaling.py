"""Loss scaling inside the graph: the plain loop `loss.backward(); opt.step()` with a decorated optimizer."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from graphamp import LossScalingError
from tests.training import relative_error

STEPS_OF_A_SHORT_RUN = 20


class Regression(nn.Module):
    """A two-layer MLP whose forward returns its MSE loss, as HF models return theirs."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


def batch(step: int, poison: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's inputs; `poison` (inf or nan) is written into one input value."""
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
    if poison is not None:
        x[0, 0] = poison
    return x, y


def rewritten(amp_lists, compile=False):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 on CPU is slow: these models are tiny
        return graphamp.rewrite(Regression(), batch(0), amp_lists=amp_lists, compile=compile, progress=False)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def state(opt) -> list[torch.Tensor]:
    return [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def backward_linked_and_eager(amp_lists) -> tuple[nn.Module, nn.Module]:
    """A linked AmpModule and an FP32 copy of its model, after a plain backward() of the same batch."""
    amp_model = rewritten(amp_lists)
    graphamp.decorate(torch.optim.SGD(amp_model.parameters(), lr=0.1), amp_lists)
    eager = copy.deepcopy(amp_model.original_module)
    amp_model(*batch(1)).backward()
    eager(*batch(1)).backward()
    return amp_model, eager


def test_plain_backward_matches_the_unscale_path_bit_for_bit(fp16):
    linked = rewritten(fp16)
    graphamp.decorate(torch.optim.SGD(linked.parameters(), lr=0.1), fp16)
    linked(*batch(1)).backward()

    unlinked = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(unlinked.original_module.parameters(), lr=0.1), fp16)
    unlinked._linked_optimizer = None  # unlinked by hand: backward(loss) scales the loss, unscale_() the gradients
    opt.backward(unlinked(*batch(1)))
    opt.unscale_()

    for a, b in zip(grads(linked), grads(unlinked)):
        assert torch.equal(a, b)


def test_plain_backward_gives_eager_fp32_gradients_within_float16_tolerance(fp16):
    amp_model, eager = backward_linked_and_eager(fp16)
    for a, b in zip(grads(amp_model), grads(eager)):
        assert relative_error(a, b) < 1e-2


def test_inf_step_is_skipped_bit_identically_and_the_scale_halves(fp16):
    amp_model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.Adam(amp_model.parameters(), lr=1e-2), fp16)
    amp_model(*batch(1)).backward()
    opt.step()
    opt.zero_grad()
    params, moments, scale = [p.detach().clone() for p in amp_model.parameters()], state(opt), opt.get_loss_scaling()

    amp_model(*batch(2, poison=float("inf"))).backward()
    opt.step()

    assert opt.found_inf and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(amp_model.parameters(), params))
    assert all(torch.equal(a, b) for a, b in zip(state(opt), moments))
    assert opt.get_loss_scaling() == scale / 2


def test_clip_grad_norm_after_backward_returns_the_true_norm(fp16):
    amp_model, eager = backward_linked_and_eager(fp16)
    norm = torch.nn.utils.clip_grad_norm_(amp_model.parameters(), max_norm=1e9)
    true_norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm=1e9)
    assert relative_error(norm, true_norm) < 1e-2


def test_gradient_accumulation_adds_true_gradients(fp16):
    amp_model = rewritten(fp16)
    graphamp.decorate(torch.optim.SGD(amp_model.parameters(), lr=0.1), fp16)
    amp_model(*batch(1)).backward()
    first = grads(amp_model)
    amp_model.zero_grad()
    amp_model(*batch(2)).backward()
    second = grads(amp_model)
    amp_model.zero_grad()
    amp_model(*batch(1)).backward()
    amp_model(*batch(2)).backward()
    for total, a, b in zip(grads(amp_model), first, second):
        torch.testing.assert_close(total, a + b)


def test_scale_follows_paddle_rule_through_plain_backward(fp16):
    amp_model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(amp_model.parameters(), lr=1e-3), fp16, init_loss_scaling=1024.0,
                            incr_every_n_steps=2, decr_every_n_nan_or_inf=2)
    poisoned = {2, 3, 5}
    scales = []
    for step in range(7):
        amp_model(*batch(step, poison=float("nan") if step in poisoned else None)).backward()
        opt.step()
        opt.zero_grad()
        scales.append(opt.get_loss_scaling())
    # good, good (x2), bad, bad (/2), good, bad, good
    assert scales == [1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 1024.0, 1024.0]


def test_backward_through_the_optimizer_does_not_scale_twice(fp16):
    amp_model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(amp_model.parameters(), lr=0.1), fp16)
    amp_model(*batch(1)).backward()
    plain = grads(amp_model)
    opt.zero_grad()
    opt.backward(amp_model(*batch(1)))
    opt.unscale_()  # nothing left to unscale: only the inf/NaN check
    for a, b in zip(grads(amp_model), plain):
        assert torch.equal(a, b)


def test_float16_loss_from_no_linked_amp_module_is_refused(fp16):
    model = Regression()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16)
    model(*batch(1)).backward()
    with pytest.raises(LossScalingError, match=r"graphamp.rewrite\(\) before decorate\(\)"):
        opt.step()


def test_bfloat16_plain_loop_trains_with_nothing_inserted(bf16):
    amp_model = rewritten(bf16)
    opt = graphamp.decorate(torch.optim.Adam(amp_model.parameters(), lr=1e-2), bf16)
    losses = []
    for step in range(STEPS_OF_A_SHORT_RUN):
        loss = amp_model(*batch(0))
        assert "ScaleGradients" not in type(loss.grad_fn).__name__
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_bfloat16_step_on_unlinked_model_is_not_refused(bf16):
    model = Regression()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), bf16)
    before = model.net[0].weight.detach().clone()
    model(*batch(1)).backward()
    opt.step()
    assert not torch.equal(model.net[0].weight, before)


def test_decorate_model_argument_links_the_amp_module(fp16):
    amp_model = rewritten(fp16)
    amp_model._linked_optimizer = None
    opt = graphamp.decorate(torch.optim.SGD(amp_model.parameters(), lr=0.1), fp16, model=amp_model)
    assert amp_model._linked_optimizer() is opt


def test_decorate_model_argument_without_amp_module_is_refused(fp16):
    model = Regression()
    with pytest.raises(LossScalingError, match="holds no AmpModule"):
        graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)


def test_output_written_in_place_after_the_call_keeps_eager_gradients(fp16, bf16):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    eager = copy.deepcopy(net)
    amp_model = graphamp.rewrite(net, batch(0)[0], amp_lists=bf16, progress=False)
    graphamp.decorate(torch.optim.SGD(amp_model.parameters(), lr=0.1), fp16)
    for model in (amp_model, eager):
        out = model(batch(1)[0])
        out.mul_(3.0)
        out.pow(2).mean().backward()
    for a, b in zip(grads(amp_model), grads(eager)):
        assert relative_error(a, b) < 2e-2


def test_compiled_plain_backward_matches_the_eager_rewrite(bf16):
    compiled, eager_rewrite = rewritten(bf16, compile=True), rewritten(bf16)
    for model in (compiled, eager_rewrite):
        graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), bf16, use_dynamic_loss_scaling=True)
        model(*batch(1)).backward()
    for a, b in zip(grads(compiled), grads(eager_rewrite)):
        assert relative_error(a, b) < 1e-2


class SharedGradients(nn.Module):
    """Gradients the graph's backward hands out in unusual shapes: `w1 + w2` gives both parameters the very same
    gradient tensor, `bias.sum()` an expanded one, `scale * x` a 0-dim one."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
        self.bias, self.scale = nn.Parameter(torch.randn(4)), nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return ((x @ (self.w1 + self.w2)) * self.scale).pow(2).mean() + self.bias.sum()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")  # torch's reference-cycle note
@pytest.mark.parametrize("create_graph", [False, True])
def test_gradients_leaving_the_graph_are_divided_once_whatever_their_layout(fp16, seeded, create_graph):
    """The node dividing the gradients into the master weights does it in place where it owns them, never twice
    through one storage, out of place for expanded ones, and differentiably under create_graph."""
    model, x = SharedGradients(), torch.randn(3, 4)
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp_model = graphamp.rewrite(model, (x,), amp_lists=fp16, progress=False)
    # a scale that leaves the float16 backward finite (the 0-dim `scale` gradient sums 12 products)
    graphamp.decorate(torch.optim.SGD(amp_model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**10)
    amp_model(x).backward(create_graph=create_graph)
    eager(x).backward(create_graph=create_graph)
    for (name, a), b in zip(amp_model.named_parameters(), eager.parameters()):
        assert relative_error(a.grad.detach(), b.grad.detach()) < 1e-2, name
    assert torch.equal(amp_model.w1.grad, amp_model.w2.grad)
    if create_graph:  # the gradients stay differentiable: a gradient penalty can go on
        assert amp_model.w1.grad.requires_grad
