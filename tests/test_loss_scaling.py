"""The loss-scaling state machine: Paddle's update_loss_scaling rule, unscaling, checkpoints."""

import random

import pytest
import torch

from graphamp import LossScalingError
from graphamp.training.loss_scaler import LossScaler

INF = float("inf")
NAN = float("nan")


def started(**config):
    """A LossScaler whose device state exists, as after the first scaled loss."""
    scaler = LossScaler(**config)
    scaler.scale(torch.ones(()))
    return scaler


def run(scaler, script):
    """Feed one found_inf per entry of ``script`` ("inf" or "ok"); return (scale, good, bad) after each."""
    rows = []
    for event in script:
        scaler.update(torch.tensor(1.0 if event == "inf" else 0.0))
        rows.append((scaler.get_loss_scaling(), scaler.good_steps, scaler.bad_steps))
    return rows


def test_paddle_rule_with_two_bad_steps_per_decrease():
    scaler = started(init_loss_scaling=1024.0, incr_every_n_steps=3, decr_every_n_nan_or_inf=2)
    script = ["ok", "ok", "inf", "ok", "inf", "inf", "ok", "ok", "ok", "inf", "ok"]
    expected = [
        (1024.0, 1, 0),
        (1024.0, 2, 0),
        (1024.0, 0, 1),  # a bad step resets good steps, no decrease yet
        (1024.0, 1, 0),  # a good step resets bad steps
        (1024.0, 0, 1),
        (512.0, 0, 0),  # the second bad step in a row halves the scale
        (512.0, 1, 0),
        (512.0, 2, 0),
        (1024.0, 0, 0),  # the third good step in a row doubles it
        (1024.0, 0, 1),
        (1024.0, 1, 0),
    ]
    assert run(scaler, script) == expected


def test_paddle_rule_with_one_bad_step_per_decrease():
    scaler = started(init_loss_scaling=8.0, incr_every_n_steps=2, decr_every_n_nan_or_inf=1)
    script = ["inf", "ok", "ok", "ok", "inf", "inf", "ok"]
    expected = [(4.0, 0, 0), (4.0, 1, 0), (8.0, 0, 0), (8.0, 1, 0), (4.0, 0, 0), (2.0, 0, 0), (2.0, 1, 0)]
    assert run(scaler, script) == expected


@pytest.mark.parametrize("decr_every_n_nan_or_inf", [1, 2])
def test_scale_never_decreases_below_one(decr_every_n_nan_or_inf):
    scaler = started(init_loss_scaling=3.0, decr_every_n_nan_or_inf=decr_every_n_nan_or_inf, decr_ratio=0.5)
    scales = [scale for scale, _, _ in run(scaler, ["inf"] * 6 * decr_every_n_nan_or_inf)]
    assert scales[-1] == 1.0
    assert min(scales) == 1.0
    assert scales[decr_every_n_nan_or_inf - 1] == 1.5


@pytest.mark.parametrize("decr_every_n_nan_or_inf", [1, 2])
def test_growth_is_blocked_when_the_grown_scale_is_not_finite(decr_every_n_nan_or_inf):
    float32_max = torch.finfo(torch.float32).max
    scaler = started(
        init_loss_scaling=float32_max, incr_every_n_steps=2, decr_every_n_nan_or_inf=decr_every_n_nan_or_inf
    )
    assert run(scaler, ["ok", "ok", "ok"]) == [(float32_max, 1, 0), (float32_max, 0, 0), (float32_max, 1, 0)]


@pytest.mark.parametrize("decr_every_n_nan_or_inf", [1, 2])
def test_max_loss_scaling_caps_growth(decr_every_n_nan_or_inf):
    scaler = started(
        init_loss_scaling=4.0,
        incr_every_n_steps=1,
        max_loss_scaling=10.0,
        decr_every_n_nan_or_inf=decr_every_n_nan_or_inf,
    )
    assert [scale for scale, _, _ in run(scaler, ["ok", "ok", "ok"])] == [8.0, 10.0, 10.0]


def test_static_scaling_keeps_the_scale_and_counters():
    scaler = started(init_loss_scaling=128.0, incr_every_n_steps=1, use_dynamic_loss_scaling=False)
    assert run(scaler, ["ok", "inf", "inf", "ok"]) == [(128.0, 0, 0)] * 4
    assert scaler.found_inf is False
    run(scaler, ["inf"])
    assert scaler.found_inf is True


def test_fused_update_kernel_path_matches_the_paddle_rule_path():
    # With one bad step per decrease the update runs on torch._amp_update_scale_; compare it with the general path.
    rng = random.Random(0)
    for _ in range(100):
        init = rng.choice([1.0, 3.0, 12345.678, 2.0**16, 2.0**126, 1.7e38])
        config = dict(
            init_loss_scaling=init,
            incr_every_n_steps=rng.randint(1, 4),
            incr_ratio=rng.choice([1.0, 1.1, 2.0, 3.3]),
            decr_ratio=rng.choice([0.3, 0.5, 0.7, 1.0]),
            max_loss_scaling=rng.choice([None, init, 4 * init]),
        )
        fused, general = started(**config), started(**config)
        assert fused._fused_update
        general._fused_update = False
        script = [rng.choice(["ok", "ok", "inf"]) for _ in range(40)]
        assert run(fused, script) == run(general, script), config


def test_unscale_divides_gradients_of_every_dtype_and_finds_no_inf():
    scaler = started(init_loss_scaling=4.0)
    grads = [torch.full((3,), 8.0), torch.full((2,), 8.0, dtype=torch.float64)]
    found_inf = scaler.unscale_(grads)
    assert found_inf.item() == 0.0
    assert torch.equal(grads[0], torch.full((3,), 2.0))
    assert torch.equal(grads[1], torch.full((2,), 2.0, dtype=torch.float64))


@pytest.mark.parametrize("bad_value", [INF, -INF, NAN])
def test_unscale_reports_inf_or_nan_in_any_gradient(bad_value):
    scaler = started(init_loss_scaling=4.0)
    found_inf = scaler.unscale_([torch.ones(3), torch.tensor([1.0, bad_value])])
    assert found_inf.item() == 1.0


def test_check_finite_leaves_the_gradients_scaled():
    scaler = started(init_loss_scaling=4.0)
    grads = [torch.full((3,), 8.0)]
    assert scaler.check_finite(grads).item() == 0.0
    assert torch.equal(grads[0], torch.full((3,), 8.0))
    assert scaler.check_finite([torch.tensor([INF])]).item() == 1.0


def test_state_lives_on_the_loss_device_from_the_first_scale():
    scaler = LossScaler(init_loss_scaling=2.0**10)
    assert scaler.loss_scaling is None
    assert scaler.get_loss_scaling() == 2.0**10
    scaled = scaler.scale(torch.tensor(3.0))
    assert scaled.item() == 3.0 * 2**10
    assert scaler.loss_scaling.dtype == torch.float32
    assert scaler.loss_scaling.device == torch.device("cpu")


def test_a_half_precision_loss_is_scaled_in_float32():
    scaler = LossScaler(init_loss_scaling=2.0**16)
    scaled = scaler.scale(torch.tensor(2.0, dtype=torch.float16))
    assert scaled.dtype == torch.float32
    assert scaled.item() == 2.0**17


def test_unscale_before_any_scaled_loss_raises():
    with pytest.raises(LossScalingError, match="backward"):
        LossScaler().unscale_([torch.ones(1)])


def test_state_dict_round_trip_restores_scale_counters_and_config():
    source = started(init_loss_scaling=64.0, incr_every_n_steps=5, decr_every_n_nan_or_inf=3, max_loss_scaling=1e6)
    run(source, ["inf", "inf", "inf", "ok", "ok", "inf"])
    target = started()
    target.load_state_dict(source.state_dict())
    assert target.state_dict() == source.state_dict()
    script = ["inf", "inf", "ok", "ok", "ok", "ok", "ok", "ok"]
    assert run(target, script) == run(source, script)


def test_load_state_dict_writes_into_the_existing_device_tensors():
    scaler = started(init_loss_scaling=2.0)
    scale_tensor = scaler.loss_scaling
    scaler.load_state_dict({**scaler.state_dict(), "loss_scaling": 512.0, "good_steps": 7})
    assert scaler.loss_scaling is scale_tensor
    assert (scaler.get_loss_scaling(), scaler.good_steps) == (512.0, 7)


def test_load_state_dict_before_the_first_scale_takes_effect_at_the_first_scale():
    scaler = LossScaler()
    scaler.load_state_dict({**scaler.state_dict(), "loss_scaling": 512.0, "bad_steps": 1})
    scaler.scale(torch.ones(()))
    assert (scaler.get_loss_scaling(), scaler.good_steps, scaler.bad_steps) == (512.0, 0, 1)


def test_load_state_dict_without_scaler_entries_raises():
    with pytest.raises(LossScalingError, match="loss_scaling"):
        LossScaler().load_state_dict({"good_steps": 0})


@pytest.mark.parametrize(
    "config",
    [
        {"init_loss_scaling": 0.0},
        {"init_loss_scaling": INF},
        {"incr_every_n_steps": 0},
        {"decr_every_n_nan_or_inf": 1.5},
        {"incr_ratio": 0.5},
        {"decr_ratio": 0.0},
        {"decr_ratio": 2.0},
        {"init_loss_scaling": 1024.0, "max_loss_scaling": 512.0},
    ],
)
def test_invalid_config_raises(config):
    with pytest.raises(LossScalingError, match=next(iter(config))):
        LossScaler(**config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scale_unscale_and_update_make_no_host_sync_on_cuda():
    for decr_every_n_nan_or_inf in (1, 2):
        scaler = LossScaler(decr_every_n_nan_or_inf=decr_every_n_nan_or_inf, max_loss_scaling=2.0**20)
        loss = torch.ones((), device="cuda")
        grads = [torch.ones(4, device="cuda"), torch.ones(2, device="cuda", dtype=torch.float64)]
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.scale(loss)
            scaler.update(scaler.unscale_(grads))
            scaler.update(scaler.check_finite(grads))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert scaler.loss_scaling.device.type == "cuda"
