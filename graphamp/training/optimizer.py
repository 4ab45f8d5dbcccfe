"""decorate(): wrap a torch optimizer so that it trains with loss scaling, Paddle's way or GradScaler's way."""

from __future__ import annotations

import copy
import enum
import inspect
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from graphamp.errors import ArgumentError, LossScalingError
from graphamp.frontends.rewrite import amp_states, link_copied_optimizer, rewritten_models
from graphamp.policy.dtypes import HALF_DTYPES, dtype_name, resolve_dtype
from graphamp.training.in_graph_scaling import (
    CheckedGradients, ScalingFactors, factors_read_from, run_scaled, scaling_factors,
)
from graphamp.training.eager_scaling import ScaledCasts, entered_low_at
from graphamp.training.loss_scaler import LossScaler
from graphamp.torch_private import fused_step_takes_loss_scaling, sparse_values, tensor_version

__all__ = ["OptimizerWithMixedPrecision", "decorate"]


def decorate(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], amp_lists: Any = None,
    init_loss_scaling: float | None = None, incr_every_n_steps: int = 2000, decr_every_n_nan_or_inf: int = 1,
    incr_ratio: float = 2.0, decr_ratio: float = 0.5, use_dynamic_loss_scaling: bool | None = None,
    max_loss_scaling: float | None = None, process_group: torch.distributed.ProcessGroup | None = None,
    model: torch.nn.Module | None = None,
) -> OptimizerWithMixedPrecision | list[OptimizerWithMixedPrecision]:
    """Wrap ``optimizer`` in an :class:`OptimizerWithMixedPrecision` that scales the loss (defaults: paddle.amp's).

    The rule and its arguments: docs/loss_scaling.md; training loops with and without ``model``: docs/training_loops.md.

    Args:
        optimizer: a torch optimizer, or a list of them: a list gets a list of wrappers sharing one LossScaler, whose
            scale the last of them to step updates once per iteration (every wrapper steps once per iteration).
        amp_lists: the lists the model was rewritten with; their dtype picks the loss scaling (default: float16).
        init_loss_scaling: the first scale; None is 2**16 where the scaling is dynamic and 1.0 where it is not.
        use_dynamic_loss_scaling: None is on for float16 and off for bfloat16 (bfloat16 has float32's range: a fixed
            scale, 1.0 unless ``init_loss_scaling`` is given); False keeps ``init_loss_scaling`` fixed. Either way
            inf/NaN steps are skipped.
        max_loss_scaling: caps the growth of the scale (insightface's MaxClipGradScaler).
        process_group: the ranks whose ``found_inf`` is all-reduced (MAX) at each ``unscale_()``/``step()``, so that
            they skip together; None is the default group once torch.distributed runs more than one rank.
        model: the model ``graphamp.rewrite()`` converted (or a module holding one): its graphs scale the gradients
            inside, so a plain ``loss.backward()`` leaves true gradients in ``.grad``. Without it the rewritten
            models holding the optimizer's parameters are found and linked, with a FutureWarning.
    """
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise LossScalingError("decorate() got an empty list: pass a torch optimizer or a list of them.")
    for opt in optimizers:
        if isinstance(opt, OptimizerWithMixedPrecision):
            raise LossScalingError("this optimizer is already decorated: pass the torch optimizer it wraps instead.")
        if not isinstance(opt, torch.optim.Optimizer):
            raise ArgumentError(f"decorate() takes torch.optim.Optimizer objects, got {type(opt).__name__}.")
    if len({id(opt) for opt in optimizers}) != len(optimizers):
        raise LossScalingError("decorate() got the same optimizer twice: pass each optimizer once.")

    if amp_lists is not None and not hasattr(amp_lists, "dtype"):
        dtype = f"dtype={amp_lists!r}" if isinstance(amp_lists, (str, torch.dtype)) else "..."
        raise ArgumentError(  # a wrong argument, as rewrite() says of the same mistake
            f"decorate(amp_lists=...) got a {type(amp_lists).__name__}; pass the "
            f"graphamp.AutoMixedPrecisionLists({dtype}) the model was rewritten with."
        )
    try:
        dtype = torch.float16 if amp_lists is None else resolve_dtype(amp_lists.dtype)
    except ValueError as error:
        raise ArgumentError(
            f"amp_lists.dtype is {amp_lists.dtype}: loss scaling is for torch.float16 or torch.bfloat16."
        ) from error
    _check_argument_types(use_dynamic_loss_scaling, process_group, model)
    if use_dynamic_loss_scaling is None:
        use_dynamic_loss_scaling = dtype == torch.float16
    if init_loss_scaling is None:  # a scale the user gave is used as given, fixed where the scaling is not dynamic
        init_loss_scaling = 2.0**16 if use_dynamic_loss_scaling else 1.0
    loss_scaler = LossScaler(
        init_loss_scaling, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio,
        use_dynamic_loss_scaling, max_loss_scaling, process_group,
    )
    wrappers = [OptimizerWithMixedPrecision(opt, loss_scaler) for opt in optimizers]
    iteration = wrappers[0]._iteration
    for wrapper in wrappers[1:]:
        wrapper._iteration = iteration
        iteration.members.append(wrapper)
    _link(wrappers, model, None if amp_lists is None else dtype)
    return wrappers if isinstance(optimizer, (list, tuple)) else wrappers[0]


def _check_argument_types(use_dynamic_loss_scaling: Any, process_group: Any, model: Any) -> None:
    """decorate()'s arguments that LossScaler does not check: a truthy string would turn scaling on."""
    if use_dynamic_loss_scaling is not None and not isinstance(use_dynamic_loss_scaling, bool):
        wanted = "True, False, or None (on for float16 lists, off for bfloat16)"
        raise ArgumentError(f"decorate(use_dynamic_loss_scaling={use_dynamic_loss_scaling!r}): pass {wanted}.")
    if process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise ArgumentError(f"decorate(process_group=...) got a {type(process_group).__name__}: pass a "
                            "torch.distributed ProcessGroup (dist.new_group(ranks)) or None for the default group.")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"decorate(model=...) got a {type(model).__name__}: pass the nn.Module "
                            "graphamp.rewrite() converted, or None to find it through the optimizer's parameters.")


def _link(optimizers: list[OptimizerWithMixedPrecision], model: torch.nn.Module | None, dtype: torch.dtype | None):
    """Link decorated optimizers (sharing one loss scaler) to the rewritten models that feed their parameters:
    those inside `model`, or (deprecated) those found through the parameters. `dtype`: the decorated lists' (None:
    none given)."""
    parameters = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    if model is None:
        states = [state for m in rewritten_models(parameters) for state in amp_states(m)]
    else:
        states = amp_states(model)
        if not states:
            raise LossScalingError(
                f"decorate(model=...) got a {type(model).__name__} that graphamp.rewrite() did not convert, nor any "
                "module inside it: rewrite the model first, then decorate its optimizer."
            )
        owned = {id(p) for state in states for p in state.model.parameters()}
        if not any(id(p) in owned for p in parameters):
            raise LossScalingError(
                "decorate(model=...): the optimizer holds none of that model's parameters; build the optimizer from "
                "model.parameters()."
            )
    # The loss scaling follows the decorated lists' dtype: bfloat16's (1.0) lets float16 gradients underflow to 0.
    other = next((state for state in states if dtype not in (None, state.config.lists.dtype)), None)
    if other is not None:
        raise LossScalingError(
            f"decorate() got {dtype_name(dtype)} lists, but this {type(other.model).__name__} was rewritten with "
            f"{dtype_name(other.config.lists.dtype)} lists, whose gradients need their own loss scaling. "
            f"Fix: decorate with the same AutoMixedPrecisionLists the model was rewritten with."
        )
    if model is None and states:
        names = ", ".join(sorted({type(state.model).__name__ for state in states}))
        # FutureWarning, as torch's own deprecations (torch.cuda.amp.autocast): shown to users, not only to tests.
        warnings.warn(
            f"graphamp.decorate() found the rewritten {names} through the optimizer's parameters and linked it; "
            "finding it that way is deprecated. Fix: pass the model, graphamp.decorate(optimizer, amp_lists, "
            "model=model).", FutureWarning, stacklevel=3,
        )
    for state in states:
        state.backend.link_loss_scaling(optimizers[0].run_graph_scaled)


class _Stage(enum.Enum):
    READY = "ready"  # backward() may run, any number of times (gradient accumulation)
    UNSCALED = "unscaled"  # unscale_() ran: gradients are true gradients, step() comes next
    STEPPED = "stepped"  # step() ran; waiting for the other wrappers sharing the loss scaler to step


class _Iteration:
    """The wrappers sharing one loss scaler, and whether a scaled backward ran since the scaler's last update."""

    def __init__(self, member: OptimizerWithMixedPrecision) -> None:
        self.members = [member]
        self.checks = CheckedGradients(self.owner_of)  # the gradients a linked model's graphs checked for inf/NaN
        self.restart()

    def owner_of(self, tensor: torch.Tensor) -> int | None:
        """Which member holds `tensor` (a parameter), so that each member's found_inf covers its own gradients."""
        if len(self.members) == 1:
            return None
        if self._owners is None:
            self._owners = {id(p): i for i, m in enumerate(self.members) for g in m.param_groups for p in g["params"]}
        return self._owners.get(id(tensor))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_owners": None, "scaling": {}}  # by id(): a copy's parameters are other objects

    def finish_if_all_stepped(self, loss_scaler: LossScaler) -> None:
        if any(m._stage is not _Stage.STEPPED for m in self.members):
            return
        # A wrapper without gradients stepped as a no-op (found_inf None); with none at all the scale stays.
        checked = [m._found_inf for m in self.members if m._found_inf is not None]
        if checked:
            device = checked[0].device
            loss_scaler.update(sum((other.to(device, non_blocking=True) for other in checked[1:]), checked[0]))
        self.restart()

    def restart(self) -> None:
        for member in self.members:
            member._stage = _Stage.READY
        self.loss_scaled = False
        self.scaled_in_graph = False  # a linked model scaled gradients in its graphs since the last step
        self.eager_scaled = False  # its eager policy's casts too (eager_scaling.py)
        self.checks.clear()
        self.scaling: dict[torch.device, ScalingFactors] = {}  # the graphs' factors, the same for each run
        self._owners: dict[int, int] | None = None

    def waiting_for(self) -> str:
        waiting = [f"#{i} ({type(member._optimizer).__name__})" for i, member in enumerate(self.members)
                   if member._stage is not _Stage.STEPPED]
        return "optimizer " + ", ".join(waiting) + " of the list given to decorate()"


def _wrapped(name: str) -> property:
    """The wrapped optimizer's attribute `name`, read and written through the wrapper."""
    return property(
        lambda self: getattr(self._optimizer, name), lambda self, value: setattr(self._optimizer, name, value)
    )


def _delegated(name: str) -> Callable:
    """The wrapped optimizer's method `name`, called through the wrapper."""
    def method(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._optimizer, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


class OptimizerWithMixedPrecision(torch.optim.Optimizer):
    """A torch optimizer with loss scaling; made by :func:`graphamp.decorate`. The name is Paddle's.

    Paddle's habit is ``opt.minimize(loss)``; GradScaler's, with true gradients to clip before the step, is
    ``opt.backward(loss); opt.unscale_(); clip_grad_norm_(...); opt.step()``. Anywhere a torch optimizer goes:
    ``param_groups``, ``state``, ``defaults``, hooks and other public attributes are the wrapped optimizer's. Host
    syncs, fused optimizers, closures and shared loss scalers: docs/loss_scaling.md.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, loss_scaler: LossScaler) -> None:
        # Optimizer.__init__ is not called on purpose: it would build param groups of its own.
        self._optimizer = optimizer
        self.loss_scaler = loss_scaler
        self._iteration = _Iteration(self)
        self._stage = _Stage.READY
        self._found_inf: torch.Tensor | None = None
        self._skipped_steps: torch.Tensor | None = None
        self._last_step_skipped: torch.Tensor | None = None  # the found_inf of the last step()
        # After opt.backward(loss), each gradient's version counter: an in-place change since (clip_grad_norm_ before
        # unscale_()) would clip the scaled gradients, which step() would then unscale into a wrong update.
        self._scaled_versions: dict[int, tuple[torch.Tensor, int]] = {}

    # -- the wrapped optimizer's state, in place --------------------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        return self._optimizer

    param_groups = _wrapped("param_groups")
    state = _wrapped("state")
    defaults = _wrapped("defaults")

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks. Private names stay the wrapper's own, so torch's flags such as
        # _step_supports_amp_scaling are never claimed for the wrapper; but a method the wrapped optimizer's class adds
        # goes through (transformers' AdafactorSchedule calls Adafactor._get_lr).
        optimizer = self.__dict__.get("_optimizer")
        if name.startswith("_") and not _method_of_its_own(optimizer, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        # An LR scheduler patches `step` onto the instance; like torch optimizers, leave that out of copies.
        return {k: v for k, v in self.__dict__.items() if k not in ("step", "_opt_called", "_scaled_versions")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._scaled_versions = {}
        link_copied_optimizer(self)  # a copy taken with its model trains that copy with in-graph scaling

    # The methods that keep the wrapper's state run as Python even under torch.compile (torch's recipe compiles
    # `opt.step()`): dynamo takes every torch.optim.Optimizer, the wrapper too, for one of torch's own and lost that
    # bookkeeping (found_inf read back, the scale's update), so the scale never backed off.
    @torch.compiler.disable
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)
        if self._stage is _Stage.UNSCALED:
            self._stage = _Stage.READY  # the unscaled gradients are gone; backward() may run again

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``"loss_scaler"``: scale, good/bad steps and config."""
        return {**self._optimizer.state_dict(), "loss_scaler": self.loss_scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore both; a plain torch optimizer state dict (no ``"loss_scaler"``) leaves the scaling as it is."""
        state_dict = dict(state_dict)
        loss_scaler_state = state_dict.pop("loss_scaler", None)
        if loss_scaler_state is not None:
            self.loss_scaler.check_loadable(loss_scaler_state)  # a refused state leaves the optimizer as it was
        self._optimizer.load_state_dict(state_dict)
        if loss_scaler_state is not None:
            self.loss_scaler.load_state_dict(loss_scaler_state)
        self._iteration.restart()  # a checkpoint starts a new iteration

    def __repr__(self) -> str:
        inner = "\n".join("  " + line for line in repr(self._optimizer).splitlines())
        return f"{type(self).__name__}(\n{inner}\n  {self.loss_scaler!r}\n)"

    # -- loss scaling -----------------------------------------------------------------------------------------------

    @torch.compiler.disable
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(loss * loss_scaling).backward(**kwargs)``. May run several times before ``step()``."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise LossScalingError(
                f"backward() needs a scalar loss, got {shape}: reduce it first, e.g. loss.mean() or loss.sum()."
            )
        if self._stage is _Stage.UNSCALED:
            raise LossScalingError(
                "backward() after unscale_(): new scaled gradients would add to unscaled ones; "
                "call unscale_() once, after the last backward() of the iteration."
            )
        self._check_not_waiting("backward")
        if self._iteration.scaled_in_graph:
            loss.backward(**kwargs)  # the linked model's graphs scale the gradients already
            return
        self.loss_scaler.scale(loss).backward(**kwargs)
        self._iteration.loss_scaled = True
        self._scaled_versions = {
            id(p.grad): (p.grad, tensor_version(p.grad))
            for group in self._optimizer.param_groups for p in group["params"] if p.grad is not None
        }

    @torch.compiler.disable
    def unscale_(self) -> None:
        """Divide this optimizer's gradients by the loss scaling in place, e.g. to clip them; once per step."""
        if self._stage is _Stage.UNSCALED:
            raise LossScalingError(
                "unscale_() was already called since the last step(): the gradients are already unscaled; "
                "call it once per iteration, after the last backward()."
            )
        self._check_not_waiting("unscale_")
        self._unscale(self._grads(), "unscale_")

    def _unscale(self, grads: list[torch.Tensor], what: str) -> None:
        # No gradient: nothing to unscale or check, and step() is eager's no-op; other ranks may have some.
        if grads:
            self._found_inf = self._checked_found_inf(grads, what, self.loss_scaler.unscale_)
        else:
            device = next((p.device for group in self.param_groups for p in group["params"]), torch.device("cpu"))
            self._found_inf = self.loss_scaler.found_inf_of_other_ranks(device)
        self._stage = _Stage.UNSCALED

    def _checked_found_inf(self, grads: list[torch.Tensor], what: str, check_scaled: Callable) -> torch.Tensor:
        """The found_inf of `grads` (by `check_scaled` where they hold the loss scaling), after the refusals."""
        self._check_scaled(what)
        self._check_scaled_gradients_unchanged(grads, what)
        return check_scaled(grads) if self._iteration.loss_scaled else self._check_true_gradients(grads)

    @torch.compiler.disable
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale (unless ``unscale_()`` ran), skip the update if any gradient is inf/NaN, then update the scale.

        Args:
            closure: runs forward and backward (through a linked model, or ``opt.backward(loss)``) and returns
                the loss, as Lightning's automatic optimization does; ``step`` then returns that loss. An optimizer
                that evaluates it several times per step (LBFGS) gets it: each evaluation's gradients are unscaled
                and checked, and an inf/NaN in any of them skips the whole step.
        """
        if closure is not None and _step_needs_closure(self._optimizer):
            return self._step_evaluating(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_not_waiting("step")
        optimizer = self._optimizer
        grads = self._grads() if self._stage is _Stage.READY else None
        if grads == []:
            self._unscale(grads, "step")  # joins the other ranks' found_inf all-reduce
        if self._stage is _Stage.UNSCALED and self._found_inf is None:
            result = optimizer.step()  # no gradient: eager's no-op, with nothing to unscale, check or refuse
        elif self._creates_state(grads):
            return optimizer.step()
        elif fused_step_takes_loss_scaling(optimizer):
            # GradScaler's contract with fused optimizers: they unscale by `grad_scale` and skip on `found_inf`
            # inside their kernel; `grad_scale` is None when the gradients are already unscaled.
            if self._stage is _Stage.READY:
                self._found_inf = self._checked_found_inf(grads, "step", self.loss_scaler.check_finite)
            scaled = self._stage is _Stage.READY and self._iteration.loss_scaled
            optimizer.grad_scale = self.loss_scaler.loss_scaling if scaled else None
            optimizer.found_inf = self._found_inf
            try:
                result = optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        else:
            if self._stage is _Stage.READY:
                self._unscale(grads, "step")
            result = None if self._found_inf.item() else optimizer.step()  # the one host sync, as GradScaler's
        self._finish_step()
        return loss if closure is not None else result

    def _creates_state(self, grads: list[torch.Tensor] | None) -> bool:
        """Whether this is the step torch.distributed.checkpoint's get_state_dict()/set_state_dict() take to create a
        fresh optimizer's state (all-zero gradients, lr 0, no state yet), with no scaled backward before it, which
        step() would refuse. The wrapped optimizer takes it alone: nothing to unscale, check or count. Its host sync
        runs only where step() would otherwise refuse. With no gradient to look at (None, []) it is not that step."""
        iteration, groups = self._iteration, self._optimizer.param_groups
        if not grads or self._optimizer.state or iteration.loss_scaled or iteration.scaled_in_graph:
            return False
        at_lr_0 = all(float(group.get("lr", 0.0)) == 0.0 for group in groups)
        return at_lr_0 and not self.loss_scaler.is_fixed_at_one() and not any(bool(g.any()) for g in grads)

    def _step_evaluating(self, closure: Callable[[], Any]) -> Any:
        """step(closure) of an optimizer that calls the closure itself, maybe several times (LBFGS)."""
        self._check_not_waiting("step")
        optimizer = self._optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with torch.no_grad():  # to restore if a later evaluation overflows: the optimizer moved the weights by then
            saved_params, saved_state = torch._foreach_mul(params, 1.0), copy.deepcopy(optimizer.state_dict())
        losses = []

        def evaluate():
            self._stage = _Stage.READY  # the closure's backward() may run again
            with torch.enable_grad():
                losses.append(closure())
            self._unscale(self._grads(), "step")
            if self._found_inf is not None and self._found_inf.item():  # one sync per evaluation, as float(loss)
                raise _Overflow
            return losses[-1]

        try:
            optimizer.step(evaluate)
        except _Overflow:
            with torch.no_grad():
                torch._foreach_copy_(params, saved_params)
            optimizer.load_state_dict(saved_state)
        self._finish_step()
        return losses[0] if losses else None

    def _finish_step(self) -> None:
        self._last_step_skipped = self._found_inf
        if self._found_inf is not None:
            if self._skipped_steps is None:
                self._skipped_steps = torch.zeros((), dtype=torch.float32, device=self._found_inf.device)
            self._skipped_steps.add_(self._found_inf.clamp(max=1.0))
        self._stage = _Stage.STEPPED
        self._iteration.finish_if_all_stepped(self.loss_scaler)

    def minimize(self, loss: torch.Tensor) -> Any:
        """Paddle's one call: ``backward(loss)``, then ``step()``. Zeroing the gradients is ``zero_grad()``'s job."""
        self.backward(loss)
        return self.step()

    def _check_not_waiting(self, what: str) -> None:
        if self._stage is _Stage.STEPPED:
            raise LossScalingError(
                f"{what}() after this optimizer's step() while the loss scaling update still waits for "
                f"{self._iteration.waiting_for()}: step every optimizer sharing the loss scaler once per iteration."
            )

    def _check_scaled(self, what: str) -> None:
        if not (self._iteration.loss_scaled or self._iteration.scaled_in_graph or self.loss_scaler.is_fixed_at_one()):
            linked = self._linked_models()
            taken = [name for name, owner in linked if owner is not None and owner not in self._iteration.members]
            if taken:
                raise LossScalingError(
                    f"{what}() without a scaled backward since the last step: this optimizer's {taken[0]} scales its "
                    "gradients by the loss scaling of an optimizer decorated after this one, in a decorate() call of "
                    "its own. Fix: decorate the optimizers of one model in one call, so that they share one loss "
                    "scaler: graphamp.decorate([opt_a, opt_b], amp_lists)."
                )
            own = [name for name, owner in linked if owner in self._iteration.members]
            if own:  # linked, yet none of its graphs ran with autograd on: no backward since the last step()
                raise LossScalingError(
                    f"{what}() with no backward through the linked {own[0]} since the last step(): .grad holds the "
                    "gradients the last step() took (or what zero_grad() left), with no scaled backward to check "
                    "them by. Fix: run the forward and backward before each step(); to step again on the same "
                    "gradients, as FP32 would, step the wrapped optimizer: opt.optimizer.step()."
                )
            raise LossScalingError(
                f"{what}() without a scaled backward since the last step, and the loss scaling is "
                f"{self.loss_scaler.get_loss_scaling():g}: the loss came from no model linked to this optimizer. "
                "Fix, one of: graphamp.rewrite() the model before decorate() (or pass decorate(..., model=model)); "
                "for a model you compiled with a graphamp.backend of your own, amp_backend.link_optimizer(optimizer) "
                "(one optimizer per backend: give each model its own backend); or call opt.backward(loss) or "
                "opt.minimize(loss) instead of loss.backward(), so the gradients carry the loss scaling."
            )

    def _check_scaled_gradients_unchanged(self, grads: list[torch.Tensor], what: str) -> None:
        """Refuse gradients changed in place while they still held the loss scaling (no host sync: version counters)."""
        if not self._iteration.loss_scaled or not self._scaled_versions:
            return
        recorded = self._scaled_versions
        changed = any(id(g) in recorded and recorded[id(g)][1] != tensor_version(g) for g in grads)
        self._scaled_versions = {}
        if changed:
            raise LossScalingError(
                f"{what}(): the gradients were changed in place after optimizer.backward(loss), while they still "
                f"held the loss scaling (x{self.loss_scaler.get_loss_scaling():g}): clip_grad_norm_ (or "
                "accelerator.clip_grad_norm_) clipped scaled gradients, and unscaling them now would take a wrong "
                "step. Fix: call optimizer.unscale_() before clipping (GradScaler's order), or graphamp.rewrite() the "
                "model before decorate() so that .grad holds true gradients after a plain backward. Nothing was "
                "stepped."
            )

    def _linked_models(self) -> list[tuple[str, Any]]:
        """(class name, linked optimizer) of each rewritten model holding this optimizer's parameters."""
        models = rewritten_models(p for group in self.param_groups for p in group["params"])
        return [(type(s.model).__name__, s.backend.linked_optimizer) for m in models for s in amp_states(m)]

    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for g, group in enumerate(self._optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None:
                    continue
                if grad.dtype in HALF_DTYPES:
                    names, dtype = group.get("param_names"), dtype_name(grad.dtype)
                    where = repr(names[i]) if names else f"#{i} of param group {g} (shape {tuple(param.shape)})"
                    raise LossScalingError(
                        f"parameter {where} has a {dtype} gradient: the model was cast to half precision, so there "
                        "are no FP32 master weights. Keep the model in float32 and use graphamp.rewrite(model, ...) "
                        f"to run it in {dtype}."
                    )
                grads.append(sparse_values(grad) if grad.is_sparse else grad)
        return grads

    # -- loss scaling inside a linked model's graphs ------------------------------------------------------------

    def run_graph_scaled(self, run: Callable, args: tuple) -> Any:
        """``run(*args)``, one graph of a linked model, its gradients scaled inside by this optimizer's loss scaling
        and checked for inf/NaN as they leave it: the function ``decorate(..., model=model)`` links to the model's
        backend (``AmpBackend.link_loss_scaling``)."""
        if self.loss_scaler.is_fixed_at_one():  # bfloat16's default: the gradients need no scaling
            return run(*args)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        factors = self._factors_for(args, self._scaling_factors_on(device))
        # float16 values of eager code this iteration scaled (eager_scaling.py): their gradients stay scaled
        kept = frozenset(
            i for i, a in enumerate(args) if type(a) is torch.Tensor and a.dtype == torch.float16 and a.requires_grad
            and entered_low_at(a) is factors
        ) if self._iteration.eager_scaled else frozenset()
        return run_scaled(run, list(args), factors, self._iteration.checks, kept)

    def scaled_casts(self, low: torch.dtype) -> ScaledCasts | None:
        """The scaling edges for the casts across `low`'s edge in eager code beside a linked model's graphs (its eager
        policy takes them: training/eager_scaling.py), or None where the scale is fixed at 1.0 or `low` is not
        float16 (bfloat16 needs no scaling: its eager ops stay as they are)."""
        if self.loss_scaler.is_fixed_at_one() or low != torch.float16:
            return None
        return ScaledCasts(self._eager_factors_on, low)

    def _eager_factors_on(self, device: torch.device) -> ScalingFactors:
        self._iteration.eager_scaled = True
        return self._scaling_factors_on(device)

    def _scaling_factors_on(self, device: torch.device) -> ScalingFactors:
        """The iteration's factors on `device`, as of its first scaled graph run or eager cast (the scale changes only
        at its step()); the loss is then scaled inside the model, not by backward()."""
        self._iteration.scaled_in_graph = True
        scaling = self._iteration.scaling
        if device not in scaling:
            scaling[device] = scaling_factors(self.loss_scaler.state_on(device))
        return scaling[device]

    def _factors_for(self, args: tuple, own: ScalingFactors) -> ScalingFactors:
        """The factors of a graph run that reads the outputs of a model linked to another loss scaler (a GAN's
        discriminator reading the generator's): that scaler's, so that a loss taken through this model into that
        one is scaled by that model's scale all the way, as its own GradScaler would scale it. Else its own."""
        mine = [id(f) for f in self._iteration.scaling.values()]
        others = [f for f in factors_read_from(args) if id(f) not in mine]
        if len(others) > 1:
            raise LossScalingError(
                "a graph reads the outputs of models linked to different loss scalers, so its backward has no one "
                "scale to run at. Fix: decorate their optimizers in one call, so that they share one scale: "
                'graphamp.decorate([opt_g, opt_d], lists, model=nn.ModuleDict({"G": G, "D": D})).'
            )
        return others[0] if others else own

    def _check_true_gradients(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """``found_inf`` of gradients that hold no scaling (in-graph scaling, or a scale fixed at 1.0): the graphs'
        own flags for the gradients they checked as they left them, one fused check of the others."""
        self.loss_scaler.state_on(grads[0].device)
        return self.loss_scaler.check_finite(*self._iteration.checks.split(grads))

    # -- for logging ------------------------------------------------------------------------------------------------

    def get_loss_scaling(self) -> float:
        """The current loss scaling (one host sync)."""
        return self.loss_scaler.get_loss_scaling()

    @property
    def found_inf(self) -> bool:
        """Whether this optimizer's gradients held inf/NaN at its last step or unscale_() (one host sync)."""
        return self._found_inf is not None and bool(self._found_inf.item())

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped for inf/NaN gradients (one host sync): accelerate's name, read by
        ``AppliedStepsScheduler``."""
        return self._last_step_skipped is not None and bool(self._last_step_skipped.item())

    @property
    def skipped_steps(self) -> int:
        """How many of this wrapper's steps were skipped for inf/NaN gradients (one host sync)."""
        return 0 if self._skipped_steps is None else int(self._skipped_steps.item())


# torch.optim.Optimizer defines these, so __getattr__ never reaches them: they go to the wrapped optimizer.
for _name in (
    "add_param_group", "register_step_pre_hook", "register_step_post_hook", "register_state_dict_pre_hook",
    "register_state_dict_post_hook", "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook",
):
    setattr(OptimizerWithMixedPrecision, _name, _delegated(_name))


def _method_of_its_own(optimizer: torch.optim.Optimizer | None, name: str) -> bool:
    """Whether `name` is a method `optimizer`'s class adds to torch.optim.Optimizer's (not a dunder, not a flag)."""
    if optimizer is None or name.startswith("__") or hasattr(torch.optim.Optimizer, name):
        return False
    return callable(inspect.getattr_static(type(optimizer), name, None))


class _Overflow(Exception):
    """An evaluation of a closure optimizer's step found inf/NaN gradients: the step is abandoned and undone."""


def _step_needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` requires its closure (LBFGS re-evaluates it during the step)."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty
