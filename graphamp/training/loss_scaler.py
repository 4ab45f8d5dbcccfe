"""Loss scaling: the scale, Paddle's good/bad step counters and their update rule, as tensors on the device.

The rule (Paddle's ``update_loss_scaling``) is written once, in docs/loss_scaling.md; the all-reduce of ``found_inf``
that keeps ranks together, in docs/distributed.md. As ``torch.amp.GradScaler``, nothing here reads a value back to
the host except the getters that say they do.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import torch
import torch.distributed as dist

from graphamp.errors import ArgumentError, LossScalingError
from graphamp.policy.dtypes import HALF_DTYPES
from graphamp.torch_private import group_by_device_and_dtype

__all__ = ["LossScaler", "reciprocal_of"]


# The configuration: LossScaler's arguments, attributes and state_dict() keys, beside the scale and the counters.
_CONFIG_KEYS = (
    "init_loss_scaling", "incr_every_n_steps", "decr_every_n_nan_or_inf", "incr_ratio", "decr_ratio",
    "use_dynamic_loss_scaling", "max_loss_scaling",
)
_STATE_KEYS = ("loss_scaling", "good_steps", "bad_steps", *_CONFIG_KEYS)


def _as_float32(x: float) -> float:
    """The float32 value nearest ``x``: Paddle keeps the ratios as float32 attributes, so the products match."""
    return torch.tensor(x, dtype=torch.float32).item()


def reciprocal_of(scale: torch.Tensor) -> torch.Tensor:
    """1/scale, what unscaling multiplies gradients by: computed in float64 (MPS has none), as GradScaler does, since
    float32 division is inexact under some compile options."""
    return scale.reciprocal() if scale.device.type == "mps" else scale.double().reciprocal().float()


class LossScaler:
    """The loss scaling, its good/bad step counters and Paddle's rule for updating them (docs/loss_scaling.md).

    With ``use_dynamic_loss_scaling=False`` the scale stays at ``init_loss_scaling`` and the counters at 0, but
    gradients are still unscaled and checked, so a step with inf/NaN gradients is still skipped (as Paddle's
    GradScaler does with static scaling).

    ``process_group``: the ranks that must agree on ``found_inf``. None means torch.distributed's default group
    when it is initialised with more than one rank (looked up at each check, so the scaler may be built before
    ``init_process_group``), else no reduction. A group of one rank reduces nothing.
    """

    def __init__(
        self,
        init_loss_scaling: float = 2.0**16,
        incr_every_n_steps: int = 2000,
        decr_every_n_nan_or_inf: int = 1,
        incr_ratio: float = 2.0,
        decr_ratio: float = 0.5,
        use_dynamic_loss_scaling: bool = True,
        max_loss_scaling: float | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._configure(
            init_loss_scaling, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio,
            use_dynamic_loss_scaling, max_loss_scaling,
        )
        # Created by the first scale(), on the loss's device; until then these Python values stand in.
        self._scale: torch.Tensor | None = None
        self._good_steps: torch.Tensor | None = None
        self._bad_steps: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None
        self._initial = (_as_float32(init_loss_scaling), 0, 0)
        self._choose_update(self._initial[0], 0)
        self.process_group = process_group

    def _configure(
        self, init_loss_scaling: float, incr_every_n_steps: int, decr_every_n_nan_or_inf: int, incr_ratio: float,
        decr_ratio: float, use_dynamic_loss_scaling: bool, max_loss_scaling: float | None,
    ) -> None:
        def bad(name: str, value: Any, wanted: str) -> LossScalingError:
            return LossScalingError(f"{name}={value!r}: {wanted}.")

        # Types first: a string would fail the comparisons below with a bare TypeError, and a bool would pass them.
        for name, value in (("init_loss_scaling", init_loss_scaling), ("incr_ratio", incr_ratio),
                            ("decr_ratio", decr_ratio), ("max_loss_scaling", max_loss_scaling)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise ArgumentError(f"{name}={value!r} is a {type(value).__name__}: pass a number, e.g. 2.0.")
        if not isinstance(use_dynamic_loss_scaling, bool):
            wanted = "pass True (the scale adapts) or False (it stays at init_loss_scaling)"
            raise ArgumentError(f"use_dynamic_loss_scaling={use_dynamic_loss_scaling!r}: {wanted}.")
        if not (0 < init_loss_scaling <= torch.finfo(torch.float32).max):
            raise bad("init_loss_scaling", init_loss_scaling, "pass a number > 0 that float32 holds, e.g. 2.**16")
        counts = (("incr_every_n_steps", incr_every_n_steps), ("decr_every_n_nan_or_inf", decr_every_n_nan_or_inf))
        for name, value in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, value, "pass an int >= 1")
        if not (math.isfinite(incr_ratio) and incr_ratio >= 1.0):
            raise bad("incr_ratio", incr_ratio, "pass a finite number >= 1, e.g. 2.0")
        if not (0.0 < decr_ratio <= 1.0):
            raise bad("decr_ratio", decr_ratio, "pass a number in (0, 1], e.g. 0.5")
        if max_loss_scaling is not None and not (max_loss_scaling >= init_loss_scaling):
            wanted = f"pass None or a number >= init_loss_scaling ({init_loss_scaling})"
            raise bad("max_loss_scaling", max_loss_scaling, wanted)
        self.init_loss_scaling = float(init_loss_scaling)
        self.incr_every_n_steps = incr_every_n_steps
        self.decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
        self.incr_ratio = _as_float32(incr_ratio)
        self.decr_ratio = _as_float32(decr_ratio)
        self.use_dynamic_loss_scaling = bool(use_dynamic_loss_scaling)
        self.max_loss_scaling = None if max_loss_scaling is None else float(max_loss_scaling)
        # A cap beyond float32's range caps nothing, and clamp() would refuse it.
        self._cap = None if max_loss_scaling is None else min(float(max_loss_scaling), torch.finfo(torch.float32).max)

    def _choose_update(self, scale: float, bad_steps: int) -> None:
        # torch._amp_update_scale_ is GradScaler's rule: no bad-step counter and no floor. It equals Paddle's rule
        # exactly when a single bad step decreases the scale and the scale starts (hence stays) >= 1, so that a
        # clamp to [1, max] after it is the floor on decrease and a no-op otherwise. Two kernels instead of a dozen.
        within_cap = self._cap is None or scale <= self._cap
        self._fused_update = self.decr_every_n_nan_or_inf == 1 and 1.0 <= scale and within_cap and bad_steps == 0

    # -- state ----------------------------------------------------------------------------------------------------

    @property
    def loss_scaling(self) -> torch.Tensor | None:
        """The scale as a live float32 device tensor (no host sync), or None before the first ``scale()``."""
        return self._scale

    def get_loss_scaling(self) -> float:
        """The current scale as a Python float. Reads it back from the device (one host sync)."""
        return self._initial[0] if self._scale is None else self._scale.item()

    @property
    def good_steps(self) -> int:
        """Consecutive finite steps since the last increase or bad step (one host sync)."""
        return self._initial[1] if self._good_steps is None else int(self._good_steps.item())

    @property
    def bad_steps(self) -> int:
        """Bad steps since the last decrease or finite step (one host sync)."""
        return self._initial[2] if self._bad_steps is None else int(self._bad_steps.item())

    @property
    def found_inf(self) -> bool:
        """Whether the gradients given to the last ``update()`` held inf or NaN (one host sync)."""
        return self._found_inf is not None and bool(self._found_inf.item())

    def is_fixed_at_one(self) -> bool:
        """Whether the scale is 1.0 and static (bfloat16's default): gradients need no scaling at all."""
        return not self.use_dynamic_loss_scaling and self._initial[0] == 1.0

    def state_on(self, device: torch.device) -> torch.Tensor:
        """The scale tensor, created on ``device`` if no loss was scaled yet (in-graph scaling has no loss)."""
        if self._scale is None:
            scale, good, bad = self._initial
            self._scale = torch.full((), scale, dtype=torch.float32, device=device)
            self._good_steps = torch.full((), good, dtype=torch.int32, device=device)
            self._bad_steps = torch.full((), bad, dtype=torch.int32, device=device)
        return self._scale

    # -- scale, unscale, check ------------------------------------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale. A float16/bfloat16 loss is scaled in float32 so the product cannot overflow."""
        scale = self.state_on(loss.device)
        if loss.dtype in HALF_DTYPES:
            loss = loss.float()
        return loss * scale.to(loss.device, non_blocking=True)

    def unscale_(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` by the scale in place; return ``found_inf``, a float32 0-dim tensor (1.0 if any inf/NaN)."""
        return self._check_and_unscale(grads, reciprocal_of(self._require_scale("unscale_")))

    def check_finite(self, grads: Sequence[torch.Tensor], checked: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """``found_inf`` for ``grads`` without unscaling them (fused optimizers unscale inside their own kernel).
        ``checked``: the found_inf tensors of gradients checked already (inside the graphs), counted in."""
        scale = self._require_scale("check_finite")
        return self._check_and_unscale(grads, torch.ones((), dtype=torch.float32, device=scale.device), checked)

    def _require_scale(self, what: str) -> torch.Tensor:
        if self._scale is None:
            raise LossScalingError(
                f"{what}() before any loss was scaled: call backward(loss) through the optimizer wrapper first."
            )
        return self._scale

    def _check_and_unscale(self, grads: Sequence[torch.Tensor], inv_scale: torch.Tensor,
                           checked: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        found_inf = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
        per_device = {inv_scale.device: (found_inf, inv_scale)}
        with torch.no_grad():
            for other in checked:
                found_inf.add_(other.to(found_inf.device, non_blocking=True))
            grouped = group_by_device_and_dtype(list(grads)).items() if grads else ()
            for (device, _), ([same_device_and_dtype], _) in grouped:
                if device not in per_device:
                    device_found_inf = torch.zeros((), dtype=torch.float32, device=device)
                    per_device[device] = (device_found_inf, inv_scale.to(device, non_blocking=True))
                torch._amp_foreach_non_finite_check_and_unscale_(same_device_and_dtype, *per_device[device])
            for device_found_inf, _ in list(per_device.values())[1:]:
                found_inf.add_(device_found_inf.to(found_inf.device, non_blocking=True))
        self._agree_across_ranks(found_inf)  # 4 bytes on the device, before anyone reads it: no host sync of its own
        return found_inf

    def found_inf_of_other_ranks(self, device: torch.device) -> torch.Tensor | None:
        """A step with no gradient here: join the other ranks' found_inf all-reduce with -1 (MAX keeps theirs), so that
        collectives stay paired and all skip alike; None if no rank had a gradient, or no group (one host sync)."""
        found_inf = torch.full((), -1.0, dtype=torch.float32, device=device)
        if not self._agree_across_ranks(found_inf):
            return None
        return None if found_inf.item() < 0 else found_inf

    def _agree_across_ranks(self, found_inf: torch.Tensor) -> bool:
        """The ranks' largest found_inf, in place (MAX), where ranks must agree; False where there is no such group."""
        group = self._group_that_must_agree()
        if group is not None:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return group is not None

    def _group_that_must_agree(self) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    # -- update ---------------------------------------------------------------------------------------------------

    def update(self, found_inf: torch.Tensor) -> None:
        """Apply Paddle's rule for one iteration whose gradients did (``found_inf`` > 0) or did not hold inf/NaN."""
        scale = self._require_scale("update")
        found_inf = found_inf.to(scale.device, non_blocking=True)
        self._found_inf = found_inf
        if not self.use_dynamic_loss_scaling:
            return
        with torch.no_grad():
            if self._fused_update:
                torch._amp_update_scale_(
                    scale, self._good_steps, found_inf, self.incr_ratio, self.decr_ratio, self.incr_every_n_steps
                )
                scale.clamp_(min=1.0, max=self._cap)
            else:
                self._update_by_paddle_rule(found_inf > 0)

    def _update_by_paddle_rule(self, found: torch.Tensor) -> None:
        scale, good, bad = self._scale, self._good_steps, self._bad_steps
        bad_next = torch.where(found, bad + 1, 0)
        good_next = torch.where(found, 0, good + 1)
        decrease = bad_next == self.decr_every_n_nan_or_inf
        increase = good_next == self.incr_every_n_steps
        lowered = (scale * self.decr_ratio).clamp_(min=1.0)
        raised = scale * self.incr_ratio
        raised = torch.where(torch.isfinite(raised), raised, scale)
        if self._cap is not None:
            raised.clamp_(max=self._cap)
        scale.copy_(torch.where(decrease, lowered, torch.where(increase, raised, scale)))
        bad.copy_(bad_next.masked_fill_(decrease, 0))
        good.copy_(good_next.masked_fill_(increase, 0))

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scale, the counters and the config, as Python numbers (three host syncs)."""
        return {
            "loss_scaling": self.get_loss_scaling(), "good_steps": self.good_steps, "bad_steps": self.bad_steps,
            **{key: getattr(self, key) for key in _CONFIG_KEYS},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` returned: config, scale and counters, into the existing device tensors (or
        kept until the first ``scale()`` creates them on the loss's device)."""
        self.check_loadable(state_dict)
        self._configure(**{key: state_dict[key] for key in _CONFIG_KEYS})
        scale = _as_float32(state_dict["loss_scaling"])
        good, bad = int(state_dict["good_steps"]), int(state_dict["bad_steps"])
        self._initial = (scale, good, bad)
        if self._scale is not None:
            for tensor, value in zip((self._scale, self._good_steps, self._bad_steps), self._initial):
                tensor.fill_(value)
        self._found_inf = None
        self._choose_update(scale, bad)

    def check_loadable(self, state_dict: dict[str, Any]) -> None:
        """Raise LossScalingError, changing nothing, where ``load_state_dict(state_dict)`` would not restore a scaler:
        keys missing, or a fixed scale (a bfloat16 run's) that would turn this dynamic scaling off."""
        missing = sorted(set(_STATE_KEYS) - set(state_dict))
        if missing:
            raise LossScalingError(
                f"loss scaler state dict lacks {', '.join(missing)}: pass what LossScaler.state_dict() returned."
            )
        if self.use_dynamic_loss_scaling and not state_dict["use_dynamic_loss_scaling"]:
            # GradScaler refuses a disabled scaler's state too: taken as it is, a float16 run would go on unscaled.
            raise LossScalingError(
                f"this checkpoint's loss scaling is fixed at {state_dict['loss_scaling']} (a bfloat16 run, or "
                "use_dynamic_loss_scaling=False); loading it would turn this optimizer's dynamic loss scaling off. "
                "Drop its 'loss_scaler' entry to keep the scaling decorate() set (state.pop('loss_scaler')), or "
                "pass decorate(..., use_dynamic_loss_scaling=False) to keep the fixed scale."
            )

    def __repr__(self) -> str:
        mode = "dynamic" if self.use_dynamic_loss_scaling else "static"
        config = (
            f"incr_every_n_steps={self.incr_every_n_steps}, decr_every_n_nan_or_inf={self.decr_every_n_nan_or_inf}, "
            f"incr_ratio={self.incr_ratio}, decr_ratio={self.decr_ratio}, max_loss_scaling={self.max_loss_scaling}"
        )
        return f"LossScaler({mode}, loss_scaling={self.get_loss_scaling()}, {config})"
