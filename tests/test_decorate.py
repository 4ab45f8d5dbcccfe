"""graphamp.decorate(): the optimizer wrapper that trains with loss scaling."""

import copy
import inspect
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from graphamp import AutoMixedPrecisionLists, LossScalingError

INF = float("inf")
NAN = float("nan")


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(step, size=8):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(size, 4, generator=generator), torch.randn(size, 3, generator=generator)


def loss_at(model, step, poison=None):
    """The step's MSE loss; ``poison`` (inf or nan) is multiplied into the first weight's gradient."""
    x, y = batch(step)
    loss = F.mse_loss(model(x), y)
    if poison is not None:
        loss = loss + poison * model[0].weight.sum()
    return loss


def snapshot(model, optimizer):
    """Parameters and the wrapped optimizer's state (moments, step counts, momentum buffers), copied."""
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.optimizer.state_dict())


def assert_bit_identical(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bit_identical(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bit_identical(x, y)
    else:
        assert a == b


# -- decorate() and its defaults ---------------------------------------------------------------------------------


def test_defaults_are_paddle_amp_defaults():
    parameters = inspect.signature(graphamp.decorate).parameters
    defaults = {name: p.default for name, p in parameters.items() if name != "optimizer"}
    assert defaults == {
        "amp_lists": None,
        "init_loss_scaling": None,  # 2**16 where the scaling is dynamic (float16), 1.0 for bfloat16: below
        "incr_every_n_steps": 2000,
        "decr_every_n_nan_or_inf": 1,
        "incr_ratio": 2.0,
        "decr_ratio": 0.5,
        "use_dynamic_loss_scaling": None,
        "max_loss_scaling": None,
        "process_group": None,  # the default group once torch.distributed runs more than one rank
        "model": None,  # the rewritten models are found through the optimizer's parameters
    }
    sgd = torch.optim.SGD(small_model().parameters(), lr=0.1)
    assert graphamp.decorate(sgd).get_loss_scaling() == 2.0**16


def test_dynamic_loss_scaling_is_on_by_default_for_float16():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.loss_scaler.use_dynamic_loss_scaling
    opt.minimize(loss_at(model, 0, poison=INF))
    assert opt.get_loss_scaling() == 2.0**15


def test_float16_lists_keep_dynamic_loss_scaling_on():
    sgd = torch.optim.SGD(small_model().parameters(), lr=0.1)
    opt = graphamp.decorate(sgd, AutoMixedPrecisionLists(dtype="float16"))
    assert opt.loss_scaler.use_dynamic_loss_scaling


def test_bf16_lists_turn_dynamic_loss_scaling_off_by_default():
    model = small_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = graphamp.decorate(sgd, amp_lists=AutoMixedPrecisionLists(dtype="bfloat16"), incr_every_n_steps=1)
    assert not opt.loss_scaler.use_dynamic_loss_scaling
    for step, poison in enumerate([INF, None, None, INF]):
        opt.zero_grad()
        opt.minimize(loss_at(model, step, poison))
        assert opt.get_loss_scaling() == 1.0  # bfloat16 has float32's range: no scaling at all
    assert opt.skipped_steps == 2  # without scaling, inf/NaN steps are still skipped


def test_use_dynamic_loss_scaling_false_keeps_init_loss_scaling_for_bfloat16():
    model = small_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    bf16 = AutoMixedPrecisionLists(dtype="bfloat16")
    opt = graphamp.decorate(sgd, bf16, init_loss_scaling=1024.0, use_dynamic_loss_scaling=False)
    opt.minimize(loss_at(model, 0, poison=INF))
    assert opt.get_loss_scaling() == 1024.0


def test_use_dynamic_loss_scaling_false_keeps_init_loss_scaling_for_float16():
    model = small_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = graphamp.decorate(sgd, init_loss_scaling=512.0, use_dynamic_loss_scaling=False)
    opt.minimize(loss_at(model, 0, poison=INF))
    assert opt.get_loss_scaling() == 512.0


def test_use_dynamic_loss_scaling_true_overrides_the_bf16_default():
    model = small_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = graphamp.decorate(sgd, amp_lists=AutoMixedPrecisionLists(dtype="bfloat16"), use_dynamic_loss_scaling=True)
    opt.minimize(loss_at(model, 0, poison=INF))
    assert opt.get_loss_scaling() == 2.0**15


def test_decorating_a_wrapper_raises():
    opt = graphamp.decorate(torch.optim.SGD(small_model().parameters(), lr=0.1))
    with pytest.raises(LossScalingError, match="already decorated"):
        graphamp.decorate(opt)


# -- the scaling trajectory through the wrapper ------------------------------------------------------------------


def test_scripted_inf_and_nan_steps_follow_paddles_table():
    model = small_model()
    opt = graphamp.decorate(
        torch.optim.SGD(model.parameters(), lr=0.01),
        init_loss_scaling=4.0,
        incr_every_n_steps=2,
        decr_every_n_nan_or_inf=2,
        max_loss_scaling=16.0,
    )
    # (poison, scale, good steps, bad steps, skipped steps so far) after each step
    table = [
        (None, 4.0, 1, 0, 0),
        (None, 8.0, 0, 0, 0),
        (INF, 8.0, 0, 1, 1),
        (NAN, 4.0, 0, 0, 2),
        (INF, 4.0, 0, 1, 3),
        (INF, 2.0, 0, 0, 4),
        (INF, 2.0, 0, 1, 5),
        (INF, 1.0, 0, 0, 6),
        (INF, 1.0, 0, 1, 7),
        (INF, 1.0, 0, 0, 8),  # the floor: never below 1.0
        (None, 1.0, 1, 0, 8),
        (None, 2.0, 0, 0, 8),
        (None, 2.0, 1, 0, 8),
        (None, 4.0, 0, 0, 8),
        (None, 4.0, 1, 0, 8),
        (None, 8.0, 0, 0, 8),
        (None, 8.0, 1, 0, 8),
        (None, 16.0, 0, 0, 8),
        (None, 16.0, 1, 0, 8),
        (None, 16.0, 0, 0, 8),  # the cap: max_loss_scaling
    ]
    for step, (poison, *expected) in enumerate(table):
        opt.zero_grad()
        opt.minimize(loss_at(model, step, poison))
        assert opt.found_inf == (poison is not None)
        actual = [opt.get_loss_scaling(), opt.loss_scaler.good_steps, opt.loss_scaler.bad_steps, opt.skipped_steps]
        assert actual == expected, f"step {step}"


# -- skipped steps -----------------------------------------------------------------------------------------------


def assert_skipped_step_is_bit_identical(make_optimizer):
    model = small_model()
    opt = graphamp.decorate(make_optimizer(model.parameters()))
    for step in range(3):  # build up momentum buffers, Adam moments and step counts
        opt.zero_grad()
        opt.minimize(loss_at(model, step))
    before = snapshot(model, opt)
    opt.zero_grad()
    opt.minimize(loss_at(model, 3, poison=INF))
    assert opt.found_inf
    assert_bit_identical(snapshot(model, opt), before)
    opt.zero_grad()
    opt.minimize(loss_at(model, 4))
    assert not torch.equal(model[0].weight, before[0]["0.weight"])  # and a finite step moves on


def test_skipped_step_leaves_sgd_momentum_state_bit_identical():
    assert_skipped_step_is_bit_identical(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))


def test_skipped_step_leaves_adamw_state_bit_identical():
    assert_skipped_step_is_bit_identical(lambda params: torch.optim.AdamW(params, lr=1e-2))


def test_skipped_step_leaves_fused_adamw_state_bit_identical():
    assert_skipped_step_is_bit_identical(lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True))


@pytest.mark.parametrize("clip", [False, True], ids=["step_unscales", "unscale_then_clip"])
def test_fused_adamw_follows_the_trajectory_of_foreach_adamw(clip):
    params = {}
    for fused in (False, True):
        model = small_model()
        opt = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused), incr_every_n_steps=2)
        for step in range(6):
            opt.zero_grad()
            opt.backward(loss_at(model, step, poison=INF if step == 2 else None))
            if clip:
                opt.unscale_()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        params[fused] = (list(model.parameters()), opt.get_loss_scaling(), opt.skipped_steps)
    (foreach, foreach_scale, foreach_skipped), (fused, fused_scale, fused_skipped) = params[False], params[True]
    assert (foreach_scale, foreach_skipped) == (fused_scale, fused_skipped) == (2.0**17, 1)
    for a, b in zip(foreach, fused):
        torch.testing.assert_close(a, b)


# -- GradScaler's habit: backward, unscale_, clip, step ---------------------------------------------------------


def true_grads(step):
    model = small_model()
    loss_at(model, step).backward()
    return [p.grad for p in model.parameters()]


def test_unscale_gives_clip_grad_norm_the_true_gradients():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), init_loss_scaling=2.0**10)
    opt.backward(loss_at(model, 0))
    opt.unscale_()
    expected = true_grads(0)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g)
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.stack([g.norm() for g in expected])))
    opt.step()


def test_unscale_gives_a_sparse_gradient_its_true_values():
    embedding, ids = nn.Embedding(10, 4, sparse=True), torch.tensor([1, 3, 3])
    embedding(ids).sum().backward()
    expected, embedding.weight.grad = embedding.weight.grad.to_dense(), None
    opt = graphamp.decorate(torch.optim.SGD(embedding.parameters(), lr=0.1), init_loss_scaling=2.0**10)
    opt.backward(embedding(ids).sum())
    opt.unscale_()
    torch.testing.assert_close(embedding.weight.grad.to_dense(), expected)
    opt.step()


def test_gradient_accumulation_unscales_once_at_step():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), init_loss_scaling=2.0**10)
    opt.backward(loss_at(model, 0) / 2)
    opt.backward(loss_at(model, 1) / 2)
    opt.unscale_()
    for p, g0, g1 in zip(model.parameters(), true_grads(0), true_grads(1)):
        torch.testing.assert_close(p.grad, (g0 + g1) / 2)
    opt.step()
    assert opt.skipped_steps == 0


def test_step_hooks_fire_around_the_wrapped_step_and_not_on_skipped_steps():
    model = small_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = graphamp.decorate(sgd)
    seen = []
    handle = opt.register_step_post_hook(lambda optimizer, args, kwargs: seen.append(optimizer))
    for step, poison in enumerate([None, INF, None]):
        opt.zero_grad()
        opt.minimize(loss_at(model, step, poison))
    assert seen == [sgd, sgd]
    handle.remove()
    opt.minimize(loss_at(model, 3))
    assert len(seen) == 2


# -- misuse ------------------------------------------------------------------------------------------------------


def test_unscale_twice_before_step_raises():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.backward(loss_at(model, 0))
    opt.unscale_()
    with pytest.raises(LossScalingError, match="already called"):
        opt.unscale_()


def test_backward_after_unscale_raises():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.backward(loss_at(model, 0))
    opt.unscale_()
    with pytest.raises(LossScalingError, match="after unscale_"):
        opt.backward(loss_at(model, 1))


def test_step_after_plain_loss_backward_raises():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1))
    loss_at(model, 0).backward()
    with pytest.raises(LossScalingError, match=r"opt.backward\(loss\)"):
        opt.step()


def test_non_scalar_loss_raises():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1))
    x, _ = batch(0)
    with pytest.raises(LossScalingError, match=r"scalar loss, got \(8, 3\)"):
        opt.backward(model(x))


def test_half_precision_gradients_raise_and_name_the_parameter():
    model = small_model().half()
    opt = graphamp.decorate(torch.optim.SGD(model.named_parameters(), lr=0.1))
    x, y = batch(0)
    opt.backward(F.mse_loss(model(x.half()).float(), y))
    with pytest.raises(LossScalingError, match=r"parameter '0.weight' has a float16 gradient.*graphamp.rewrite"):
        opt.step()


def test_half_precision_gradients_of_unnamed_parameters_give_their_position():
    model = small_model().half()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch(0)
    opt.backward(F.mse_loss(model(x.half()).float(), y))
    with pytest.raises(LossScalingError, match=r"parameter #0 of param group 0 \(shape \(8, 4\)\)"):
        opt.unscale_()


def test_step_with_closure_runs_it_and_returns_its_loss():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1))
    before = model[0].weight.detach().clone()

    def closure():
        loss = loss_at(model, 0)
        opt.backward(loss)
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.grad_fn is not None
    assert not torch.equal(model[0].weight, before)


# -- a torch optimizer in every other respect --------------------------------------------------------------------


def test_wrapper_is_a_torch_optimizer_sharing_the_wrapped_state():
    model = small_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = graphamp.decorate(adamw)
    assert isinstance(opt, torch.optim.Optimizer)  # what LR schedulers and frameworks check
    assert opt.param_groups is adamw.param_groups
    assert opt.state is adamw.state
    assert opt.defaults is adamw.defaults
    assert opt.optimizer is adamw
    extra = nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert adamw.param_groups[-1]["params"] == [extra]


def test_zero_grad_clears_the_wrapped_gradients():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.backward(loss_at(model, 0))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_repr_shows_the_wrapped_optimizer_and_the_loss_scaling():
    opt = graphamp.decorate(torch.optim.AdamW(small_model().parameters()), init_loss_scaling=1024.0)
    text = repr(opt)
    assert text.startswith("OptimizerWithMixedPrecision(")
    assert "AdamW" in text and "loss_scaling=1024.0" in text and "dynamic" in text


def scheduled_steps(make_optimizer, make_scheduler, decorated: bool, steps: int):
    """Yields (optimizer, scheduler) after each of `steps` steps of small_model(), its optimizer decorated or not,
    each step followed by the scheduler's."""
    model = small_model()
    opt = make_optimizer(model.parameters())
    driven = graphamp.decorate(opt) if decorated else opt
    scheduler = make_scheduler(driven)
    for step in range(steps):
        opt.zero_grad()
        if decorated:
            driven.minimize(loss_at(model, step))
        else:
            loss_at(model, step).backward()
            opt.step()
        scheduler.step()
        yield opt, scheduler


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8),
    ],
    ids=["StepLR", "LambdaLR", "OneCycleLR"],
)
def test_lr_scheduler_drives_the_wrapped_optimizer(make_scheduler):
    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    lrs = {decorated: [opt.param_groups[0]["lr"] for opt, _ in scheduled_steps(sgd, make_scheduler, decorated, 6)]
           for decorated in (False, True)}
    assert lrs[True] == lrs[False]
    assert len(set(lrs[True])) > 1


def test_lr_scheduler_does_not_warn_when_the_first_step_is_skipped():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.minimize(loss_at(model, 0, poison=INF))
        scheduler.step()
    assert opt.skipped_steps == 1


def test_hf_adafactor_schedule_reads_the_learning_rate_through_the_wrapper():
    """transformers' recipe for Adafactor(relative_step=True): AdafactorSchedule(optimizer) calls the optimizer's own
    _get_lr. A private method of the wrapped optimizer's class goes through; torch's AMP flags stay unclaimed."""
    optimization = pytest.importorskip("transformers.optimization")

    def adafactor(params):
        return optimization.Adafactor(params, lr=None, relative_step=True, warmup_init=True)

    lrs = {decorated: [[float(lr) for lr in scheduler.get_last_lr()]
                       for _, scheduler in scheduled_steps(adafactor, optimization.AdafactorSchedule, decorated, 3)]
           for decorated in (False, True)}
    assert lrs[True] == lrs[False]
    fused = graphamp.decorate(torch.optim.AdamW(small_model().parameters(), fused=True))
    assert not hasattr(fused, "_step_supports_amp_scaling")  # GradScaler would hand the wrapper its scale


def test_a_compiled_optimizer_step_skips_and_updates_the_scale_as_the_eager_step():
    """torch's recipe for compiling the optimizer, torch.compile around opt.step(): dynamo took the wrapper for one of
    torch's own optimizers and lost its bookkeeping (the scale never backed off, no step counted as skipped)."""
    logs, states = {}, {}
    for compiled in (False, True):
        model = small_model()
        opt = graphamp.decorate(torch.optim.Adam(model.parameters(), lr=0.1), init_loss_scaling=2.0**10,
                                incr_every_n_steps=2)
        step = torch.compile(lambda: opt.step(), backend="eager") if compiled else opt.step
        logs[compiled] = []
        for i, poison in enumerate([None, INF, None, None, None]):
            opt.zero_grad()
            opt.backward(loss_at(model, i, poison))
            step()
            logs[compiled].append((opt.step_was_skipped, opt.get_loss_scaling()))
        states[compiled] = snapshot(model, opt)
    assert logs[False] == [(False, 1024.0), (True, 512.0), (False, 512.0), (False, 1024.0), (False, 1024.0)]
    assert logs[True] == logs[False]
    assert_bit_identical(states[True], states[False])


def test_state_dict_carries_the_loss_scaler_and_loads_into_a_plain_optimizer():
    model = small_model()
    opt = graphamp.decorate(torch.optim.AdamW(model.parameters()), init_loss_scaling=256.0)
    opt.minimize(loss_at(model, 0))
    state_dict = opt.state_dict()
    assert state_dict["loss_scaler"]["loss_scaling"] == 256.0
    assert state_dict["loss_scaler"]["good_steps"] == 1
    plain = torch.optim.AdamW(small_model().parameters())
    plain.load_state_dict(state_dict)
    assert_bit_identical(plain.state_dict()["state"], state_dict["state"])


def test_a_bfloat16_runs_fixed_scale_is_refused_by_a_float16_dynamic_scaler_which_stays_as_it_was():
    """As GradScaler refuses a disabled scaler's state: taken, the float16 run would go on with no loss scaling."""
    bf16, fp16 = AutoMixedPrecisionLists(dtype="bfloat16"), AutoMixedPrecisionLists(dtype="float16")
    bf16_model = small_model()
    bf16_opt = graphamp.decorate(torch.optim.AdamW(bf16_model.parameters(), lr=0.5), bf16)
    bf16_opt.minimize(loss_at(bf16_model, 0))
    checkpoint = bf16_opt.state_dict()
    fp16_model = small_model()
    fp16_opt = graphamp.decorate(torch.optim.AdamW(fp16_model.parameters(), lr=0.1), fp16)
    with pytest.raises(LossScalingError, match="fixed at 1.0.*state.pop\\('loss_scaler'\\)"):
        fp16_opt.load_state_dict(checkpoint)
    assert (fp16_opt.param_groups[0]["lr"], fp16_opt.state) == (0.1, {})  # nothing loaded
    assert fp16_opt.loss_scaler.use_dynamic_loss_scaling and fp16_opt.get_loss_scaling() == 2.0**16
    checkpoint.pop("loss_scaler")
    fp16_opt.load_state_dict(checkpoint)  # the fix the message names
    assert fp16_opt.param_groups[0]["lr"] == 0.5 and fp16_opt.loss_scaler.use_dynamic_loss_scaling


def test_load_state_dict_accepts_a_plain_torch_optimizer_state_dict():
    model = small_model()
    plain = torch.optim.AdamW(model.parameters(), lr=0.123)
    opt = graphamp.decorate(torch.optim.AdamW(model.parameters()), init_loss_scaling=64.0)
    opt.load_state_dict(plain.state_dict())
    assert opt.param_groups[0]["lr"] == 0.123
    assert opt.get_loss_scaling() == 64.0


def test_state_dict_round_trip_mid_run_continues_the_uninterrupted_trajectory():
    poisoned = {2: INF, 6: NAN, 7: INF}
    config = dict(init_loss_scaling=2.0**12, incr_every_n_steps=3, decr_every_n_nan_or_inf=2)

    def train(model, opt, steps):
        scales = []
        for step in steps:
            opt.zero_grad()
            opt.minimize(loss_at(model, step, poisoned.get(step)))
            scales.append((opt.get_loss_scaling(), opt.loss_scaler.good_steps, opt.loss_scaler.bad_steps))
        return scales

    model = small_model()
    opt = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-2), **config)
    uninterrupted = train(model, opt, range(12))

    first = small_model()
    first_opt = graphamp.decorate(torch.optim.AdamW(first.parameters(), lr=1e-2), **config)
    interrupted = train(first, first_opt, range(5))
    checkpoint = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, checkpoint)
    checkpoint.seek(0)
    loaded = torch.load(checkpoint)

    resumed = small_model(seed=1)
    resumed.load_state_dict(loaded["model"])
    resumed_opt = graphamp.decorate(torch.optim.AdamW(resumed.parameters(), lr=1e-2))  # default config, then loaded
    resumed_opt.load_state_dict(loaded["optimizer"])
    interrupted += train(resumed, resumed_opt, range(5, 12))

    assert interrupted == uninterrupted
    assert_bit_identical(resumed.state_dict(), model.state_dict())


def test_dcp_state_dicts_of_a_fresh_decorated_optimizer_resume_the_uninterrupted_run():
    # torch.distributed.checkpoint creates a fresh optimizer's state by a step on zero gradients at lr 0, with no
    # scaled backward before it: the wrapped optimizer takes that step alone, and the loss scaling stays as it was.
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def train(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            opt.minimize(loss_at(model, step, INF if step == 3 else None))

    config = dict(init_loss_scaling=2.0**12, incr_every_n_steps=2)
    model = small_model()
    opt = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-2), **config)
    train(model, opt, range(3))
    saved = copy.deepcopy((*get_state_dict(model, opt), opt.loss_scaler.state_dict()))
    train(model, opt, range(3, 6))

    resumed = small_model(seed=1)
    resumed_opt = graphamp.decorate(torch.optim.AdamW(resumed.parameters(), lr=1e-2), **config)
    get_state_dict(resumed, resumed_opt)  # the state to load into, as a DCP resume builds it
    assert (resumed_opt.get_loss_scaling(), resumed_opt.loss_scaler.good_steps) == (2.0**12, 0)
    set_state_dict(resumed, resumed_opt, model_state_dict=saved[0], optim_state_dict=saved[1])
    resumed_opt.loss_scaler.load_state_dict(saved[2])  # DCP keeps no loss scaler: saved beside it
    train(resumed, resumed_opt, range(3, 6))
    assert_bit_identical(resumed.state_dict(), model.state_dict())
    assert resumed_opt.loss_scaler.state_dict() == opt.loss_scaler.state_dict()


def test_deepcopy_gives_an_independent_wrapper():
    model = small_model()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), init_loss_scaling=8.0)
    opt.minimize(loss_at(model, 0, poison=INF))
    twin = copy.deepcopy(opt)
    assert twin.get_loss_scaling() == 4.0
    assert twin.loss_scaler is not opt.loss_scaler


# -- several optimizers sharing one loss scaler ------------------------------------------------------------------


def two_optimizers(**config):
    model = small_model()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    return model, graphamp.decorate([first, second], **config)


def test_a_list_of_optimizers_shares_one_loss_scaler():
    _, (a, b) = two_optimizers()
    assert a.loss_scaler is b.loss_scaler


def test_shared_loss_scaler_updates_once_per_iteration_after_every_optimizer_stepped():
    model, (a, b) = two_optimizers(init_loss_scaling=8.0, incr_every_n_steps=2)
    for step, expected_scale in enumerate([8.0, 16.0, 16.0, 32.0]):
        a.zero_grad()
        b.zero_grad()
        a.backward(loss_at(model, step))  # one loss feeds both optimizers' parameters
        a.step()
        assert a.loss_scaler.good_steps == step % 2  # not yet updated: b has not stepped
        b.step()
        assert a.get_loss_scaling() == expected_scale


def test_shared_loss_scaler_backs_off_when_any_optimizer_found_inf():
    model, (a, b) = two_optimizers(init_loss_scaling=8.0)
    a_weight, b_weight = model[0].weight.clone(), model[2].weight.clone()
    x, y = batch(0)
    loss = F.mse_loss(model(x), y) + INF * model[2].weight.sum()  # inf only in b's gradients
    a.backward(loss)
    a.step()
    b.step()
    assert (a.found_inf, b.found_inf) == (False, True)
    assert (a.skipped_steps, b.skipped_steps) == (0, 1)
    assert not torch.equal(model[0].weight, a_weight)
    assert torch.equal(model[2].weight, b_weight)
    assert a.get_loss_scaling() == 4.0


def test_shared_optimizer_stepping_twice_in_one_iteration_raises():
    model, (a, b) = two_optimizers()
    a.minimize(loss_at(model, 0))
    with pytest.raises(LossScalingError, match=r"waits for optimizer #1 \(AdamW\)"):
        a.minimize(loss_at(model, 1))


def test_shared_optimizers_may_each_run_their_own_backward():
    model, (a, b) = two_optimizers(init_loss_scaling=8.0, incr_every_n_steps=1)
    a.minimize(loss_at(model, 0))
    b.minimize(loss_at(model, 1))
    assert a.get_loss_scaling() == 16.0


# -- a real float16 training run ---------------------------------------------------------------------------------


class HalfMLP(nn.Module):
    """FP32 master weights, a genuinely float16 forward and backward (what graphamp.rewrite will automate)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        h = F.linear(x.half(), self.fc1.weight.half(), self.fc1.bias.half()).relu()
        return F.linear(h, self.fc2.weight.half(), self.fc2.bias.half()).float()


def teacher_labelled_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(256, 64, generator=generator)
    return x, (x @ torch.randn(64, 10, generator=generator)).argmax(dim=1)


def test_fp16_training_run_backs_off_grows_the_scale_and_lowers_the_loss():
    torch.manual_seed(0)
    x, y = teacher_labelled_data()
    model = HalfMLP()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = graphamp.decorate(adamw, init_loss_scaling=2.0**24, incr_every_n_steps=5)  # far too high for float16
    losses, scales = [], []
    for _ in range(40):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        opt.minimize(loss)
        losses.append(loss.item())
        scales.append(opt.get_loss_scaling())
    assert opt.skipped_steps > 0
    assert min(scales) < 2.0**24
    assert any(later > earlier for earlier, later in zip(scales, scales[1:]))  # it grew back at least once
    assert losses[-1] < 0.5 * losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- host syncs on CUDA ------------------------------------------------------------------------------------------


def cuda_model_and_loss():
    model = small_model().cuda()
    x, y = (t.cuda() for t in batch(0))  # copied before the sync checks: a host-to-device copy syncs
    return model, lambda: F.mse_loss(model(x), y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_optimizer_steps_without_host_sync_on_cuda():
    model, loss = cuda_model_and_loss()
    opt = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    opt.minimize(loss())  # optimizer state is created on the first step
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.zero_grad()
        opt.minimize(loss())
        opt.zero_grad()
        opt.backward(loss())
        opt.unscale_()
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.loss_scaler.loss_scaling.device.type == "cuda"
    assert opt.get_loss_scaling() == 2.0**16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unfused_optimizer_step_makes_exactly_one_host_sync_on_cuda():
    model, loss = cuda_model_and_loss()
    opt = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True))
    opt.minimize(loss())
    opt.zero_grad()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.minimize(loss())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def test_an_init_loss_scaling_given_with_bfloat16_lists_is_used_as_a_fixed_scale():
    """The default for bfloat16 is no scaling; a scale the user passes is not dropped in silence."""
    model = small_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = graphamp.decorate(sgd, AutoMixedPrecisionLists(dtype="bfloat16"), init_loss_scaling=256.0)
    assert opt.get_loss_scaling() == 256.0
    opt.minimize(loss_at(model, 0, poison=INF))
    assert opt.get_loss_scaling() == 256.0 and not opt.loss_scaler.use_dynamic_loss_scaling
