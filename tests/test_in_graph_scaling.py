"""Loss scaling inside the graph: with the model rewritten, then its optimizer decorated for float16, the plain loop
`loss.backward(); opt.step()` leaves true FP32 gradients in `.grad` and skips steps on inf/NaN."""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphamp
from graphamp import LossScalingError
from models import BrokenGraph, LossOfCastLogits, Regression, regression_batch as batch
from training import grads, relative_error
from training import rewritten_regression as rewritten, rewritten_regression_and_eager as rewritten_and_eager

STEPS_OF_A_SHORT_RUN = 20
# float16's rounding in a Tanh MLP's gradients: measured 2e-4 to 6e-4 against FP32 (2026, torch 2.13).
FP16_GRADIENT_RTOL = 1e-2


def state(opt) -> list[torch.Tensor]:
    return [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def backward_linked_and_eager(amp_lists) -> tuple[nn.Module, nn.Module]:
    """A linked rewritten model and its FP32 copy, after a plain backward() of the same batch."""
    model, eager = rewritten_and_eager(amp_lists)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), amp_lists, model=model)
    model(*batch(1)).backward()
    eager(*batch(1)).backward()
    return model, eager


# -- the gradients a plain backward leaves ------------------------------------------------------------------------


def test_plain_backward_matches_the_unscale_path_bit_for_bit(fp16):
    linked = rewritten(fp16)
    graphamp.decorate(torch.optim.SGD(linked.parameters(), lr=0.1), fp16, model=linked)
    linked(*batch(1)).backward()

    torch.manual_seed(0)
    unlinked = Regression()
    opt = graphamp.decorate(torch.optim.SGD(unlinked.parameters(), lr=0.1), fp16)
    graphamp.rewrite(unlinked, batch(0), amp_lists=fp16)  # rewritten after decorate(): not linked
    opt.backward(unlinked(*batch(1)))  # the loss scaled outside, the gradients unscaled by unscale_()
    opt.unscale_()

    for a, b in zip(grads(linked), grads(unlinked)):
        assert torch.equal(a, b)


def test_plain_backward_gives_eager_fp32_gradients_within_float16_tolerance(fp16):
    model, eager = backward_linked_and_eager(fp16)
    for a, b in zip(grads(model), grads(eager)):
        assert a.dtype == torch.float32
        assert relative_error(a, b) < FP16_GRADIENT_RTOL


def test_plain_backward_gives_autocast_and_grad_scalers_unscaled_gradients(fp16):
    model, eager = rewritten_and_eager(fp16)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    model(*batch(1)).backward()

    autocast_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = eager(*batch(1))
    scaler.scale(loss).backward()
    scaler.unscale_(autocast_opt)

    for a, b in zip(grads(model), grads(eager)):
        assert relative_error(a, b) < FP16_GRADIENT_RTOL


def test_a_loss_computed_outside_the_graph_gets_true_gradients(fp16, seeded):
    """The scale enters at the graph's outputs: the loss after them (cross entropy here) runs unscaled in FP32."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    x, labels = batch(1)[0], torch.tensor([0, 1, 2, 3, 0, 1])
    graphamp.rewrite(model, (x,), amp_lists=fp16)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**12, model=model)
    F.cross_entropy(model(x), labels).backward()
    F.cross_entropy(eager(x), labels).backward()
    for a, b in zip(grads(model), grads(eager)):
        assert relative_error(a, b) < FP16_GRADIENT_RTOL


def test_an_output_read_by_the_graphs_loss_and_by_a_loss_outside_gets_both_gradients(fp16, seeded):
    """HF's shape: the loss computed inside from the logits, and a second term (a z-loss) on the returned logits."""
    model, x, labels = LossOfCastLogits(), torch.randn(4, 8), torch.randint(0, 6, (4,))
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, (x, labels), amp_lists=fp16)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**8, model=model)
    for net in (model, eager):
        loss, logits = net(x, labels)
        (loss + 1e-2 * logits.square().mean()).backward()
    for a, b in zip(grads(model), grads(eager)):
        assert relative_error(a, b) < FP16_GRADIENT_RTOL


def test_gradients_between_the_graphs_of_a_graph_break_are_true(fp16, seeded):
    """Each graph scales what enters its outputs and unscales what leaves into its inputs, the activation from
    the graph before the break among them: the gradients stay true between graphs and in .grad."""
    model, x = BrokenGraph(), batch(1)[0]
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=fp16)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**12, model=model)
    model(x).pow(2).mean().backward()
    eager(x).pow(2).mean().backward()

    assert len(graphamp.rewritten_graphs(model)) == 2
    for a, b in zip(grads(model), grads(eager)):
        assert relative_error(a, b) < FP16_GRADIENT_RTOL


class HeadThenBreak(nn.Module):
    """A float16 head whose logits leave the graph (low, presented float32), then a graph break before the loss."""

    def __init__(self, loss_in_a_graph_of_its_own: bool):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 32)
        self.loss_in_a_graph_of_its_own = loss_in_a_graph_of_its_own

    def forward(self, x):
        logits = self.head(torch.tanh(self.body(x)))
        if not self.loss_in_a_graph_of_its_own:
            return logits
        torch._dynamo.graph_break()
        return TINY * logits.float().square().sum()


# A loss gradient below float16's smallest subnormal (6e-8) until the loss scaling lifts it: a large vocabulary's
# cross-entropy gives most logits such gradients (probability / tokens), and GradScaler keeps them.
TINY = 1e-9


@pytest.mark.parametrize("where", ["outside the graphs", "in a graph after a break"])
def test_a_gradient_too_small_for_float16_unscaled_reaches_the_weights_as_under_grad_scaler(fp16, seeded, where):
    """The scale multiplies the float32 gradient that reaches a low output before it is cast low, and the gradient
    leaving a graph into another graph's low output goes back in float32: none is cast to float16 unscaled."""
    model = HeadThenBreak(loss_in_a_graph_of_its_own=where != "outside the graphs")
    eager = copy.deepcopy(model)
    x = batch(1)[0]
    graphamp.rewrite(model, (x,), amp_lists=fp16)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    loss = model(x)
    (loss if model.loss_in_a_graph_of_its_own else TINY * loss.float().square().sum()).backward()
    with torch.autocast("cpu", dtype=torch.float16):
        reference = eager(x) if eager.loss_in_a_graph_of_its_own else TINY * eager(x).float().square().sum()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(reference).backward()
    scaler.unscale_(torch.optim.SGD(eager.parameters(), lr=0.1))

    assert len(graphamp.rewritten_graphs(model)) == (2 if model.loss_in_a_graph_of_its_own else 1)
    for (name, mine), grad_scalers in zip(model.named_parameters(), grads(eager)):
        assert grad_scalers.abs().sum() > 0, name
        assert relative_error(mine.grad, grad_scalers) < FP16_GRADIENT_RTOL, name


class OutputShapes(TorchDispatchMode):
    """The shapes of what each ATen call run eagerly returns (an inductor kernel is no ATen call)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_a_gradient_crossing_a_graph_break_goes_on_scaled_in_float16_untouched(fp16, seeded):
    """Between the loss graph and the head's graph the logits' gradient stays as the loss graph left it, scaled
    in float16: no kernel between the graphs copies, casts or multiplies it (the largest tensor of a language
    model's backward)."""
    model, x = HeadThenBreak(loss_in_a_graph_of_its_own=True), batch(1)[0]
    graphamp.rewrite(model, (x,), amp_lists=fp16, compile=True)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    loss = model(x)
    with OutputShapes() as backward:
        loss.backward()
    logits_shape = (x.shape[0], model.head.out_features)
    assert backward.shapes and logits_shape not in backward.shapes


class LossAfterBreakAndLogits(HeadThenBreak):
    def forward(self, x):
        logits = self.head(torch.tanh(self.body(x)))
        torch._dynamo.graph_break()
        return logits.float().square().mean(), logits


@pytest.mark.parametrize("compile", [False, True], ids=["fx code", "inductor"])
def test_an_output_crossing_a_break_into_a_loss_and_read_outside_gets_both_gradients(fp16, seeded, compile):
    """The scaled float16 gradient the loss graph leaves is summed with the true one from outside as float32."""
    model = LossAfterBreakAndLogits(loss_in_a_graph_of_its_own=True)
    eager, x = copy.deepcopy(model), batch(1)[0]
    graphamp.rewrite(model, (x,), amp_lists=fp16, compile=compile)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    for net in (model, eager):
        loss, logits = net(x)
        (loss + 1e-3 * logits.sum() + TINY * logits.square().sum()).backward()
    for a, b in zip(grads(model), grads(eager)):
        assert relative_error(a, b) < FP16_GRADIENT_RTOL


def test_gradient_accumulation_adds_true_gradients(fp16):
    model, eager = rewritten_and_eager(fp16)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    for net in (model, eager):
        net(*batch(1)).backward()
        net(*batch(2)).backward()
    accumulated = grads(model)
    model.zero_grad()
    model(*batch(1)).backward()
    first = grads(model)
    model.zero_grad()
    model(*batch(2)).backward()

    for total, a, b in zip(accumulated, first, grads(model)):
        torch.testing.assert_close(total, a + b)
    for total, expected in zip(accumulated, grads(eager)):
        assert relative_error(total, expected) < FP16_GRADIENT_RTOL


def test_clip_grad_norm_after_backward_returns_the_true_norm(fp16):
    model, eager = backward_linked_and_eager(fp16)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    true_norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm=1e9)
    assert relative_error(norm, true_norm) < FP16_GRADIENT_RTOL


def test_clip_grad_norm_clips_the_true_gradients(fp16):
    model, eager = backward_linked_and_eager(fp16)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm=0.05)
    for a, b in zip(grads(model), grads(eager)):
        assert relative_error(a, b) < FP16_GRADIENT_RTOL


def test_output_written_in_place_after_the_call_keeps_eager_gradients(fp16, seeded):
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    eager = copy.deepcopy(net)
    graphamp.rewrite(net, batch(0)[0], amp_lists=fp16)
    graphamp.decorate(torch.optim.SGD(net.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**8, model=net)
    for model in (net, eager):
        out = model(batch(1)[0])
        out.mul_(3.0)
        out.pow(2).mean().backward()
    for a, b in zip(grads(net), grads(eager)):
        assert relative_error(a, b) < FP16_GRADIENT_RTOL


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
    graphamp.rewrite(model, (x,), amp_lists=fp16)
    # a scale that leaves the float16 backward finite (the 0-dim `scale` gradient sums 12 products)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**10, model=model)
    model(x).backward(create_graph=create_graph)
    eager(x).backward(create_graph=create_graph)
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        assert relative_error(a.grad.detach(), b.grad.detach()) < FP16_GRADIENT_RTOL, name
    assert torch.equal(model.w1.grad, model.w2.grad)
    if create_graph:  # the gradients stay differentiable: a gradient penalty can go on
        assert model.w1.grad.requires_grad


class SparseEmbeddingBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.head = nn.Embedding(32, 8, sparse=True), nn.Linear(8, 4)

    def forward(self, ids):
        return self.head(self.embedding(ids).mean(1))


def test_a_sparse_gradient_leaving_the_graph_trains_and_skips_as_under_grad_scaler(fp16, seeded):
    """nn.Embedding(sparse=True) leaves a sparse gradient, which has no storage to unscale in place."""
    model, generator = SparseEmbeddingBag(), torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (4, 6), generator=generator), torch.randn(4, 4, generator=generator))
               for _ in range(4)]
    eager = copy.deepcopy(model)

    def make(m):
        return [torch.optim.SparseAdam([m.embedding.weight], lr=1e-2), torch.optim.Adam(m.head.parameters(), lr=1e-2)]

    graphamp.rewrite(model, amp_lists=fp16)
    opts = graphamp.decorate(make(model), fp16, init_loss_scaling=2.0**10, incr_every_n_steps=2, model=model)
    eager_opts, scaler = make(eager), torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    skipped, eager_scales = [], []
    for step, (ids, target) in enumerate(batches):
        overflow = 1e30 if step == 2 else 1.0  # float16's backward overflows at that step in both
        F.mse_loss(model(ids).float(), target).mul(overflow).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        skipped.append(opts[0].step_was_skipped)
        with torch.autocast("cpu", torch.float16):
            loss = F.mse_loss(eager(ids).float(), target).mul(overflow)
        scaler.scale(loss).backward()
        for opt in eager_opts:
            scaler.step(opt)
            opt.zero_grad()
        scaler.update()
        eager_scales.append(scaler.get_scale())
    assert skipped == [False, False, True, False]
    assert opts[0].get_loss_scaling() == eager_scales[-1]
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(a, b), name


# -- steps ----------------------------------------------------------------------------------------------------------


def test_inf_step_is_skipped_bit_identically_and_the_scale_halves(fp16):
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.Adam(model.parameters(), lr=1e-2), fp16, model=model)
    model(*batch(1)).backward()
    opt.step()
    opt.zero_grad()
    params, moments, scale = [p.detach().clone() for p in model.parameters()], state(opt), opt.get_loss_scaling()

    model(*batch(2, poison=float("inf"))).backward()
    opt.step()

    assert opt.found_inf and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    assert all(torch.equal(a, b) for a, b in zip(state(opt), moments))
    assert opt.get_loss_scaling() == scale / 2


def test_a_too_large_scale_backs_off_until_the_float16_backward_is_finite(fp16):
    """2^24 overflows the float16 backward; the steps are skipped and the scale halves until it fits."""
    model, eager = rewritten_and_eager(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**24, model=model)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(STEPS_OF_A_SHORT_RUN):
        model(*batch(0)).backward()
        opt.step()
        opt.zero_grad()
    skipped = opt.skipped_steps
    for step in range(STEPS_OF_A_SHORT_RUN - skipped):
        eager(*batch(0)).backward()
        eager_opt.step()
        eager_opt.zero_grad()

    assert 0 < skipped < STEPS_OF_A_SHORT_RUN and opt.get_loss_scaling() < 2.0**24
    for a, b in zip(model.parameters(), eager.parameters()):
        assert relative_error(a, b) < FP16_GRADIENT_RTOL


def test_scale_follows_paddle_rule_through_plain_backward(fp16):
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=1e-3), fp16, init_loss_scaling=1024.0,
                            incr_every_n_steps=2, decr_every_n_nan_or_inf=2, model=model)
    poisoned = {2, 3, 5}
    scales = []
    for step in range(7):
        model(*batch(step, poison=float("nan") if step in poisoned else None)).backward()
        opt.step()
        opt.zero_grad()
        scales.append(opt.get_loss_scaling())
    # good, good (x2), bad, bad (/2), good, bad, good
    assert scales == [1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 1024.0, 1024.0]


def test_backward_through_the_optimizer_does_not_scale_twice(fp16):
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    model(*batch(1)).backward()
    plain = grads(model)
    opt.zero_grad()
    opt.backward(model(*batch(1)))
    opt.unscale_()  # nothing left to unscale: only the inf/NaN check
    for a, b in zip(grads(model), plain):
        assert torch.equal(a, b)


def test_minimize_trains_a_linked_model_as_the_plain_loop_does(fp16):
    plain, minimized = rewritten(fp16), rewritten(fp16)
    plain_opt = graphamp.decorate(torch.optim.SGD(plain.parameters(), lr=0.1), fp16, model=plain)
    minimize_opt = graphamp.decorate(torch.optim.SGD(minimized.parameters(), lr=0.1), fp16, model=minimized)
    for step in range(3):
        plain(*batch(step)).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        minimize_opt.minimize(minimized(*batch(step)))
        minimize_opt.zero_grad()
    assert minimize_opt.skipped_steps == plain_opt.skipped_steps == 0
    for a, b in zip(plain.parameters(), minimized.parameters()):
        assert torch.equal(a, b)


def test_bfloat16_plain_loop_trains_with_nothing_inserted(bf16):
    model = rewritten(bf16)
    opt = graphamp.decorate(torch.optim.Adam(model.parameters(), lr=1e-2), bf16, model=model)
    losses = []
    for step in range(STEPS_OF_A_SHORT_RUN):
        loss = model(*batch(0))
        assert "ScaleGradients" not in type(loss.grad_fn).__name__
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# -- one pass: the graphs' own inf/NaN check counts at step() ------------------------------------------------------


class InfChecks(TorchDispatchMode):
    """How many gradients torch's fused inf/NaN check (`_amp_foreach_non_finite_check_and_unscale_`) went over."""

    def __init__(self):
        super().__init__()
        self.gradients = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default:
            self.gradients += len(args[0])
        return func(*args, **(kwargs or {}))


def test_step_checks_no_gradient_the_graphs_checked_already(fp16):
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    loss = model(*batch(1))  # outside the mode: a call under a TorchDispatchMode runs eagerly, with no graph
    with InfChecks() as backward:
        loss.backward()
    with InfChecks() as step:
        opt.step()
    assert backward.gradients == 4  # the graph divided and checked all four as they left it
    assert step.gradients == 0  # before one pass: 4, each gradient checked a second time
    assert opt.skipped_steps == 0


def test_an_overflow_inside_the_graph_skips_the_step_by_the_graphs_own_check(fp16):
    """2^24 overflows the float16 backward: found by the check inside the graph, none at step()."""
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.Adam(model.parameters(), lr=1e-2), fp16, init_loss_scaling=2.0**24,
                            model=model)
    before = [p.detach().clone() for p in model.parameters()]
    model(*batch(1)).backward()
    with InfChecks() as step:
        opt.step()
    assert step.gradients == 0
    assert opt.found_inf and opt.skipped_steps == 1 and opt.get_loss_scaling() == 2.0**23
    assert all(torch.equal(a, b) and a.isfinite().all() for a, b in zip(model.parameters(), before))
    assert opt.state == {}  # Adam never stepped: no moments


def poison_outside_the_graph(model, outside, where):
    """A plain backward whose inf reaches a gradient from eager code, not from the graph's backward."""
    loss = model(*batch(1))
    if where == "a parameter used outside only":
        loss = loss + (outside * float("inf")).sum()
    elif where == "a parameter used inside and outside":
        loss = loss + model.net[0].bias.sum() * float("inf")
    loss.backward()
    if where == "a gradient changed in place after backward":
        model.net[2].weight.grad[0, 0] = float("inf")


@pytest.mark.parametrize("where", ["a parameter used outside only", "a parameter used inside and outside",
                                   "a gradient changed in place after backward"])
def test_an_inf_from_outside_the_graphs_still_skips_the_step(fp16, where):
    model = rewritten(fp16)
    outside = nn.Parameter(torch.ones(4))
    opt = graphamp.decorate(torch.optim.SGD([*model.parameters(), outside], lr=0.1), fp16, model=model)
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    poison_outside_the_graph(model, outside, where)
    with InfChecks() as step:
        opt.step()
    assert step.gradients >= 1  # the gradient eager code touched is checked at step()
    assert opt.found_inf and opt.skipped_steps == 1 and opt.get_loss_scaling() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(opt.param_groups[0]["params"], before))


def test_gradients_accumulated_over_micro_batches_are_checked_again_at_step(fp16):
    """Each micro-batch's gradient was checked in the graph; their sum in .grad is checked once more."""
    model = rewritten(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    model(*batch(1)).backward()
    model(*batch(2)).backward()
    with InfChecks() as step:
        opt.step()
    assert step.gradients == 4 and opt.skipped_steps == 0


def test_an_inf_inside_the_graph_skips_only_the_optimizer_whose_gradients_hold_it(fp16):
    """decorate([a, b]): the graph's check keeps a found_inf per optimizer, as GradScaler's step(a), step(b) do. An
    inf in the input reaches the first layer's gradients only (tanh makes it 1 on the way up)."""
    model = rewritten(fp16)
    first, second = graphamp.decorate(
        [torch.optim.SGD(model.net[0].parameters(), lr=0.1), torch.optim.SGD(model.net[2].parameters(), lr=0.1)],
        fp16, model=model,
    )
    before = [p.detach().clone() for p in model.parameters()]
    model(*batch(1, poison=float("inf"))).backward()
    first.step()
    second.step()
    assert (first.found_inf, second.found_inf) == (True, False)
    moved = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
    assert moved == [False, False, True, True]
    assert first.get_loss_scaling() == 2.0**15


def test_accumulation_and_clipping_train_as_grad_scaler_does(fp16):
    """Two micro-batches per step, unscale_() then clip_grad_norm_: the same updates as autocast with GradScaler."""
    model, eager = rewritten_and_eager(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    eager_opt, scaler = torch.optim.SGD(eager.parameters(), lr=0.1), torch.amp.GradScaler("cpu")
    start = [p.detach().clone() for p in model.parameters()]
    norms = []
    for step in range(4):
        for micro_batch in (2 * step, 2 * step + 1):
            model(*batch(micro_batch)).backward()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = eager(*batch(micro_batch))
            scaler.scale(loss).backward()
        opt.unscale_()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1))
        opt.step()
        opt.zero_grad()
        scaler.unscale_(eager_opt)
        torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm=0.1)
        scaler.step(eager_opt)
        scaler.update()
        eager_opt.zero_grad()
    assert opt.skipped_steps == 0 and min(norms) > 0.1  # every step clipped
    for a, b, a0 in zip(model.parameters(), eager.parameters(), start):
        assert relative_error(a - a0, b - a0) < FP16_GRADIENT_RTOL


# -- the link -------------------------------------------------------------------------------------------------------


def test_float16_loss_from_no_linked_model_is_refused(fp16):
    model = Regression()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16)
    model(*batch(1)).backward()
    with pytest.raises(LossScalingError, match=r"graphamp.rewrite\(\) the model before decorate\(\)"):
        opt.step()


def test_bfloat16_step_on_unlinked_model_is_not_refused(bf16):
    model = Regression()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), bf16)
    before = model.net[0].weight.detach().clone()
    model(*batch(1)).backward()
    opt.step()
    assert not torch.equal(model.net[0].weight, before)


class Wrapper(nn.Module):
    """What a LightningModule is to its model: a module holding the rewritten one."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return self.inner(x, y)


def test_decorate_finding_the_model_through_its_parameters_warns_to_pass_model(fp16):
    model = rewritten(fp16)
    with pytest.warns(FutureWarning, match=r"found the rewritten Regression.*model=model"):
        opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16)
    before = [p.detach().clone() for p in model.parameters()]
    model(*batch(1)).backward()
    opt.step()  # still linked, for now: the graph scaled the plain backward's gradients (unlinked, step refuses them)
    assert opt.skipped_steps == 0 and not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
        graphamp.decorate(torch.optim.SGD(Regression().parameters(), lr=0.1), fp16)  # no model to find: no link


def test_decorate_model_argument_links_a_module_holding_the_rewritten_model(fp16):
    model = rewritten(fp16)
    wrapper = Wrapper(model)
    opt = graphamp.decorate(torch.optim.SGD(wrapper.parameters(), lr=0.1), fp16, model=wrapper)
    wrapper(*batch(1)).backward()
    opt.step()  # linked: the gradients were scaled in the graph, so step() accepts them
    assert opt.skipped_steps == 0 and opt.get_loss_scaling() == 2.0**16


def test_decorate_model_argument_with_a_model_not_rewritten_is_refused(fp16):
    model = Regression()
    with pytest.raises(LossScalingError, match="did not convert.*rewrite the model first"):
        graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=Wrapper(model))


def test_decorate_model_argument_without_the_optimizers_parameters_is_refused(fp16):
    model = rewritten(fp16)
    other = nn.Linear(2, 2)
    with pytest.raises(LossScalingError, match="holds none of that model's parameters"):
        graphamp.decorate(torch.optim.SGD(other.parameters(), lr=0.1), fp16, model=model)


def test_the_latest_decorate_over_a_models_parameters_wins(fp16):
    model = rewritten(fp16)
    first = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**10, model=model)
    second = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=2.0**4, model=model)
    model(*batch(1)).backward()
    second.step()
    assert second.skipped_steps == 0
    with pytest.raises(LossScalingError, match="without a scaled backward"):
        first.step()


# -- models linked to different loss scalers -------------------------------------------------------------------------


def mlp(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, 16), nn.ReLU(), nn.Linear(16, outputs))


def gan_losses(G, D, backward_and_step, steps: int, amp=contextlib.nullcontext) -> list[float]:
    """A GAN's loop: D's step on detached fakes, then G's step, whose loss goes through D."""
    bce, data = F.binary_cross_entropy_with_logits, torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        z, real = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data) + 1
        with amp():
            fake = G(z)
            loss_d = bce(D(real).float(), torch.ones(4, 1)) + bce(D(fake.detach()).float(), torch.zeros(4, 1))
        backward_and_step("D", loss_d)
        with amp():
            loss_g = bce(D(G(z)).float(), torch.ones(4, 1))
        backward_and_step("G", loss_g)
        losses += [loss_d.item(), loss_g.item()]
    return losses


def test_a_loss_through_a_model_of_another_loss_scaler_is_scaled_as_its_own_grad_scaler_would(fp16):
    """G's loss goes through D, whose scale (2^24) overflows D's float16 backward: G's own (16) scales it all the
    way, as a GradScaler for G's loss does. Only D's steps are skipped; G trains."""
    scales, steps = {"G": 16.0, "D": 2.0**24}, 2
    torch.manual_seed(0)
    G, D = mlp(8, 4), mlp(4, 1)
    eager = {"G": copy.deepcopy(G), "D": copy.deepcopy(D)}
    models = {"G": graphamp.rewrite(G, amp_lists=fp16), "D": graphamp.rewrite(D, amp_lists=fp16)}
    opts = {name: graphamp.decorate(torch.optim.Adam(m.parameters(), lr=1e-2), fp16, model=m,
                                    init_loss_scaling=scales[name]) for name, m in models.items()}
    eager_opts = {name: torch.optim.Adam(m.parameters(), lr=1e-2) for name, m in eager.items()}
    scalers = {name: torch.amp.GradScaler("cpu", init_scale=scale) for name, scale in scales.items()}

    def linked_step(name, loss):
        loss.backward()
        opts[name].step()
        for opt in opts.values():
            opt.zero_grad()

    def grad_scaler_step(name, loss):
        scalers[name].scale(loss).backward()
        scalers[name].step(eager_opts[name])
        scalers[name].update()
        for opt in eager_opts.values():
            opt.zero_grad()

    losses = gan_losses(G, D, linked_step, steps)
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.float16)
    assert losses == gan_losses(eager["G"], eager["D"], grad_scaler_step, steps, autocast)
    assert (opts["G"].skipped_steps, opts["D"].skipped_steps) == (0, steps)
    assert [opts[n].get_loss_scaling() for n in scales] == [scalers[n].get_scale() for n in scales] == [16, 2**22]
    for name in scales:
        for a, b in zip(models[name].parameters(), eager[name].parameters()):
            assert relative_error(a, b) < 1e-6


def test_a_graph_reading_models_of_two_other_loss_scalers_is_refused_with_the_fix(fp16):
    torch.manual_seed(0)
    a, b, head = (graphamp.rewrite(m, amp_lists=fp16) for m in (mlp(8, 4), mlp(8, 4), mlp(4, 1)))
    linked = [graphamp.decorate(torch.optim.SGD(m.parameters(), lr=0.1), fp16, model=m) for m in (a, b, head)]
    x = torch.randn(4, 8)
    with pytest.raises(LossScalingError, match="different loss scalers.*decorate their optimizers in one call"):
        head(a(x) + b(x))

    opts = graphamp.decorate([torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b, head)], fp16, 2.0**10,
                             model=nn.ModuleDict({"a": a, "b": b, "head": head}))
    head(a(x) + b(x)).float().mean().backward()
    for opt in opts:
        opt.step()
    assert [opt.skipped_steps for opt in opts] == [0, 0, 0] and len(linked) == 3


# -- on a GPU -------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_plain_backward_on_cuda_makes_no_host_sync_and_gives_grad_scalers_gradients(fp16):
    torch.manual_seed(0)
    model = Regression().cuda()
    eager = copy.deepcopy(model)
    x, y = (t.cuda() for t in batch(1))  # copied before the sync check: a host-to-device copy syncs
    graphamp.rewrite(model, (x, y), amp_lists=fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16)
    model(x, y).backward()  # the loss scaler's device state is made at the first scaled call
    opt.zero_grad()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x, y).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")

    autocast_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = eager(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(autocast_opt)
    for a, b in zip(grads(model), grads(eager)):
        assert relative_error(a, b) < FP16_GRADIENT_RTOL


class BreakingBlock(nn.Linear):
    """A block whose call breaks the graph first, as FSDP2's per-block hooks do."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return x + super().forward(x)


class LoopOverBreakingBlocks(nn.Module):
    """A nanoGPT-style frame: the input layer, the loop over blocks that break the graph and the LM head in one frame,
    which dynamo runs eagerly, so graphamp's eager policy runs its matmuls low, beside the blocks' graphs."""

    def __init__(self, width: int = 16, vocabulary: int = 32):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(BreakingBlock(width, width) for _ in range(2))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, x, y):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)), y)


class OwnCastsBesideTheGraphs(LoopOverBreakingBlocks):
    """The frame's code crosses float16's edge by itself: its own casts, type promotion, an in-place add of float16
    into float32, a float16 value written into a float32 tensor by indexing."""

    def forward(self, x, y):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float() + self.head(x)  # a cast up, then float32 + float16
        logits = logits.to(torch.float16) * self.head(x)  # a cast down
        logits = logits.float()
        logits += self.head(x)
        written = torch.zeros_like(logits)
        written[:, :8] = self.head(x)[:, 8:16]
        return F.cross_entropy(logits + written, y)


# float16 underflows the gradients of a loss this small unless they are scaled
SMALL_LOSS = 1e-4


def frame_batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 32, (16,), generator=generator)


def grad_scalers_gradients(model_type: type, steps: int = 1, batches=frame_batch):
    """autocast + GradScaler on the same model and batches: each step's true gradients and the scale after it."""
    torch.manual_seed(0)
    model = model_type()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    gradients, scales = [], []
    for step in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(*batches(step)) * SMALL_LOSS
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return gradients, scales, model


def linked_gradients(model_type: type, compile: bool, steps: int = 1, batches=frame_batch, recorder=None):
    """graphamp's plain loop, decorate(model=...) linked: each step's gradients and the scale after it."""
    fp16 = graphamp.AutoMixedPrecisionLists(dtype="float16")
    torch._dynamo.reset()  # torch < 2.13 counts BreakingBlock's recompiles over every model: past the limit, no graph
    torch.manual_seed(0)
    model = graphamp.rewrite(model_type(), amp_lists=fp16, compile=compile)
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model, incr_every_n_steps=2)
    gradients, scales = [], []
    for step in range(steps):
        optimizer.zero_grad()
        with recorder or contextlib.nullcontext():
            (model(*batches(step)) * SMALL_LOSS).backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        optimizer.step()
        scales.append(optimizer.get_loss_scaling())
    assert graphamp.rewritten_graphs(model)  # the blocks ran in graphs, the rest of the frame beside them
    return gradients, scales, model


def fp32_gradients(model_type: type) -> torch.Tensor:
    torch.manual_seed(0)
    model = model_type()
    (model(*frame_batch()) * SMALL_LOSS).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("model_type", [LoopOverBreakingBlocks, OwnCastsBesideTheGraphs])
def test_float16_ops_beside_the_graphs_get_gradients_as_accurate_as_grad_scalers(model_type, compile):
    """The eager policy's casts across float16's edge scale the gradient as the graphs' edges do: a plain
    loss.backward() of a tiny loss underflows no float16 gradient of the frame's own matmuls, and none is warned of."""
    from conftest import CompiledCodeRecorder

    expected = fp32_gradients(model_type)
    (scalers,), _, _ = grad_scalers_gradients(model_type)
    recorder = CompiledCodeRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (linked,), _, _ = linked_gradients(model_type, compile, recorder=recorder)
    # the frame's matmuls (the embedding and the head, beside the blocks' graphs) ran in float16, forward and backward
    assert len([c for c in recorder.calls_of("addmm", "mm") if torch.float16 in c.in_dtypes]) >= 6
    assert not (linked == 0).any() and not (expected == 0).any()
    assert relative_error(linked, expected) < 2 * relative_error(scalers, expected)
    assert relative_error(linked, scalers) < FP16_GRADIENT_RTOL / 10
    assert not [w for w in caught if "float16 ops outside graphamp's graphs" in str(w.message)]


class KeywordNormBesideTheGraphs(LoopOverBreakingBlocks):
    """The frame normalizes a float16 value by a call naming its weight before its input."""

    def __init__(self):
        super().__init__()
        self.mid = nn.Linear(16, 16)

    def forward(self, x, y):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        h = torch.layer_norm(weight=self.norm.weight, bias=self.norm.bias, input=self.mid(x), normalized_shape=[16])
        return F.cross_entropy(self.head(h), y)


def test_a_norm_called_with_its_input_by_keyword_beside_the_graphs_gets_grad_scalers_gradients():
    """The data of a normalization is its `input`, wherever the call puts it: the float32 weight named first is no
    float16 crossing (before: the weight was taken for the data, 6e-5 off GradScaler's gradients)."""
    (scalers,), _, _ = grad_scalers_gradients(KeywordNormBesideTheGraphs)
    (linked,), _, _ = linked_gradients(KeywordNormBesideTheGraphs, compile=False)
    assert relative_error(linked, scalers) < 1e-5


def test_a_step_skipped_beside_the_graphs_follows_grad_scalers_skips_and_scales():
    """An inf in one step's frame: graphamp skips the same step and backs off the scale as GradScaler does."""
    def batches(step):
        x, y = frame_batch(step)
        if step == 1:
            x[0, 0] = 1e30  # float16 inf in the frame's first matmul
        return x, y

    scalers, scales, eager = grad_scalers_gradients(LoopOverBreakingBlocks, steps=4, batches=batches)
    linked, linked_scales, model = linked_gradients(LoopOverBreakingBlocks, False, steps=4, batches=batches)
    assert linked_scales == scales == [2.0**16, 2.0**15, 2.0**15, 2.0**16]
    for step in (0, 2, 3):
        assert relative_error(linked[step], scalers[step]) < FP16_GRADIENT_RTOL / 10
    trained, expected = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (model, eager))
    assert trained.isfinite().all()
    assert relative_error(trained, expected) < 1e-6  # the bias started at 0 has ~1e-3 of it: float16's rounding


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_eager_policys_casts_keep_their_gradients_unscaled_without_a_decorated_optimizers_link(dtype):
    """Linked by a function of one's own (link_loss_scaling), only the graphs scale: float16 ops beside them are warned
    of on every call. bfloat16 has no loss scaling to miss."""
    lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    torch._dynamo.reset()  # as in linked_gradients
    model = graphamp.rewrite(LoopOverBreakingBlocks(), amp_lists=lists)
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), lists, model=model)
    model._graphamp.backend.link_loss_scaling(lambda run, args: optimizer.run_graph_scaled(run, args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            model(*frame_batch(step)).backward()
            optimizer.step()
    said = [str(w.message) for w in caught if "ran float16 ops outside graphamp's graphs" in str(w.message)]
    assert len(said) == (2 if dtype == "float16" else 0)
    if said:
        assert "underflow" in said[0] and "Fix:" in said[0]


class GrayBlock(nn.Module):
    """A block of gray ops only, whose call breaks the graph first: its graph's float16 output follows its input's."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return x * 2 + 1


class GrayGraphsBesideTheFrame(LoopOverBreakingBlocks):
    """The frame's float16 matmuls on either side of graphs of gray ops (float16 in, float16 out)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(GrayBlock() for _ in range(2))

    def forward(self, x, y):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)), y)


def test_a_graph_of_gray_ops_between_float16_ops_beside_the_graphs_scales_their_gradient_once():
    """The gradient eager float16 ops hand a gray graph's float16 output holds the scale already: the graph does not
    multiply it again (it did: the embedding's gradient came out inf, scale times scale, and every step skipped)."""
    expected = fp32_gradients(GrayGraphsBesideTheFrame)
    (scalers,), _, _ = grad_scalers_gradients(GrayGraphsBesideTheFrame)
    (linked,), scales, _ = linked_gradients(GrayGraphsBesideTheFrame, compile=False)
    assert linked.isfinite().all() and scales == [2.0**16]  # the step was taken
    assert relative_error(linked, expected) < 2 * relative_error(scalers, expected)


class OwnCastBlock(nn.Module):
    """A block whose call breaks the graph first; its graph returns its float16 input doubled and its float32 second
    input cast to float16 by the model's own cast: a float16 output that does not come from the float16 input."""

    def forward(self, x, z):
        torch._dynamo.graph_break()
        return x * 2, z.half() * 3


class OwnCastBesideALowInput(LoopOverBreakingBlocks):
    """The frame's float16 embedding and a float32 value of its own (gray ops on the input) into such a block, in a
    loop (the frame runs eagerly beside the block's graph); the head reads the sum of what it returns."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([OwnCastBlock()])
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x, y):
        h, z = self.embed(x), torch.tanh(x.repeat(1, 2) * self.gain)
        for block in self.blocks:
            h, z = block(h, z)
        return F.cross_entropy(self.head(self.norm(h + z)), y)


class OwnCastBetweenGraphs(OwnCastBesideALowInput):
    """The same, the block called directly: the frame is graphs before and after the block's, and the last graph reads
    the block's low output (presented as float32) and its plain float16 one."""

    def forward(self, x, y):
        h, z = self.blocks[0](self.embed(x), torch.tanh(x.repeat(1, 2) * self.gain))
        return F.cross_entropy(self.head(self.norm(h + z)), y)


@pytest.mark.parametrize("model_type", [OwnCastBesideALowInput, OwnCastBetweenGraphs])
def test_a_float16_output_beside_a_low_input_that_does_not_come_from_it_gets_grad_scalers_gradients(model_type):
    """A graph reading a float16 value that holds a scaled gradient (the frame's, or another graph's low output) and
    returning, beside its double, a float16 value of the model's own cast: the gradient each gets from the float16 ops
    reading them is scaled once, by the frame's casts, not again by the graph (it keeps every plain float16 output
    beside a kept input unscaled). Between graphs, the sum's backward hands both one gradient tensor: dividing the
    plain one in place as it left the last graph divided the low output's too, kept scaled (the embedding's gradient
    came out 1/scale of the true one)."""
    expected = fp32_gradients(model_type)
    (scalers,), _, _ = grad_scalers_gradients(model_type)
    (linked,), scales, _ = linked_gradients(model_type, compile=False)
    assert linked.isfinite().all() and scales == [2.0**16]  # the step was taken
    assert relative_error(linked, expected) < 2 * relative_error(scalers, expected)


class GradientReversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class LogitsOfTheFrame(LoopOverBreakingBlocks):
    """The frame's float16 logits returned for a loss outside: reversed in the frame (a view an autograd Function
    made), or passed through a graph of gray ops after the blocks' breaks (a view, a multiply: float16 in and out)."""

    def __init__(self, end: str):
        super().__init__()
        self.end = end

    def forward(self, x):
        logits = self.frame(x)
        if self.end == "graph after":  # dynamo compiles the rest of this frame after the nested frame's breaks
            return logits.view(logits.shape) * 1
        return logits

    def frame(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return GradientReversal.apply(logits) if self.end == "reversed" else logits


@pytest.mark.parametrize("end", ["reversed", "hooked", "graph after"])
def test_float16_logits_returned_from_beside_the_graphs_keep_their_backward_and_scaling(end):
    """A float16 result of the frame the call returns is presented as float32 over itself, not over its view base (a
    gradient reversal's backward and a module's full backward hook were skipped: every sign flipped, the hook never
    called), and also when a graph of gray ops returns it (it came back plain float16, its gradient unscaled)."""
    def gradients(model: nn.Module, autocast=contextlib.nullcontext(), scale=1.0):
        called = []
        if end == "hooked":
            model.head.register_full_backward_hook(lambda module, grad_input, grad_output: called.append(grad_output))
        x, y = frame_batch()
        with autocast:
            logits = model(x)
        (F.cross_entropy(logits.float(), y) * SMALL_LOSS * scale).backward()
        assert len(called) == (end == "hooked")
        return logits, torch.cat([p.grad.flatten() / scale for p in model.parameters()])

    torch.manual_seed(0)
    _, expected = gradients(LogitsOfTheFrame(end))
    torch.manual_seed(0)
    _, scalers = gradients(LogitsOfTheFrame(end), torch.autocast("cpu", dtype=torch.float16), scale=2.0**16)
    fp16 = graphamp.AutoMixedPrecisionLists(dtype="float16")
    torch.manual_seed(0)
    model = graphamp.rewrite(LogitsOfTheFrame(end), amp_lists=fp16)
    graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    logits, linked = gradients(model)
    assert logits.dtype == torch.float32
    assert relative_error(linked, expected) < 2 * relative_error(scalers, expected)
