"""Loss scaling inside the graph: any loop's plain `loss.backward()` leaves true FP32 gradients in `.grad`.

While an AmpModule is linked to a decorated optimizer whose scale is not fixed at 1.0, each of its calls with
autograd on multiplies the gradient entering the rewritten graph (at its floating outputs) by the scale, and the
gradient leaving it into each FP32 master weight by 1/scale, both read from the LossScaler's device tensor at
forward time (no host sync). Inside, the float16 backward runs on scaled gradients, as with a scaled loss; outside,
AccumulateGrad adds true gradients, so gradient accumulation and `clip_grad_norm_` right after `backward()` are
right. The optimizer's `step()` checks those gradients for inf/NaN and updates the scale.

The link: `decorate()` links its optimizer to every AmpModule that owns one of the optimizer's parameters (found
through the parameters: rewrite the model first), or to the AmpModule given as `decorate(..., model=amp_model)`.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from graphamp.errors import LossScalingError

__all__ = [
    "amp_modules_of", "link", "register_parameters", "relink", "run_scaled", "scale_gradients", "scaling_factors",
    "times", "times_present", "unscale_gradients",
]

# parameter -> weakref to the AmpModule it belongs to (weak both ways: an AmpModule holds its parameters).
_amp_module_of_parameter = WeakIdKeyDictionary()
# parameter -> weakref to a copied decorated optimizer rebuilt before the copy of the parameter's AmpModule.
_optimizer_waiting_for_parameter = WeakIdKeyDictionary()


def times(factor: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """`grads` times a loss-scaling factor, one foreach kernel; under create_graph=True differentiable as the identity.

    Why the identity: a gradient penalty differentiates the graph's backward again. Its second-order gradient enters
    that backward where the first-order one leaves (into the master weights, an input) and reaches the graph's inputs
    through the tensors the forward saved, so it passes the 1/scale at the inputs once more. Left out of the factors
    here, it runs through the graph scaled as the first-order gradients do, and comes out true.
    """
    if torch.is_grad_enabled():
        return list(_Times.apply(factor, *grads))
    return torch._foreach_mul(grads, factor)


def times_present(factor: torch.Tensor, grads) -> list:
    """`grads` times `factor` as `times` does, in one kernel; None where a gradient is None (an unused input)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    result = [None] * len(grads)
    for i, grad in zip(present, times(factor, [grads[i] for i in present]) if present else []):
        result[i] = grad
    return result


class _Times(torch.autograd.Function):
    """`grads` times `factor`; the gradient passes back unchanged (see `times`)."""

    @staticmethod
    def forward(ctx, factor: torch.Tensor, *grads: torch.Tensor):
        return tuple(torch._foreach_mul(list(grads), factor))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


class _ScaleGradients(torch.autograd.Function):
    """Identity forward; backward multiplies every incoming gradient by `factor` (one foreach kernel)."""

    @staticmethod
    def forward(ctx, factor: torch.Tensor, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None, as in eager
        ctx.save_for_backward(factor)
        # detach(): new tensors on the same storage, not views, so that a caller may write into an output in place
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        (factor,) = ctx.saved_tensors
        return (None, *times_present(factor, grads))


class _UnscaleGradients(_ScaleGradients):
    """The gradients leaving the graph into the master weights, times 1/scale: in place, in one fused
    `_amp_foreach_non_finite_check_and_unscale_` kernel, as `unscale_()` does, where the gradient is the graph's own
    (computed by its backward, dense, sharing storage with no other gradient of this call, no double backward);
    elsewhere out of place. Its inf/NaN flag is not needed: `step()` checks every gradient of the optimizer."""

    @staticmethod
    def backward(ctx, *grads):
        (factor,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the multiply must be differentiable
            return _ScaleGradients.backward(ctx, *grads)
        result, in_place, storages = [None, *grads], {}, set()
        for i, grad in enumerate(grads, start=1):
            if grad is None:
                continue
            storage = grad.untyped_storage().data_ptr()
            if grad.is_contiguous() and grad.is_floating_point() and storage not in storages:
                in_place.setdefault((grad.device, grad.dtype), []).append(grad)
            else:  # an expanded gradient, or one an add's backward also gave another input: leave it unwritten
                result[i] = grad * factor.to(grad.device)
            storages.add(storage)
        for (device, _), same_kind in in_place.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(same_kind, found_inf, factor.to(device))
        return tuple(result)


def register_parameters(amp_module: torch.nn.Module) -> None:
    """Remember which AmpModule owns each of its parameters, so that decorate() finds it."""
    ref = weakref.ref(amp_module)
    waiting = []
    for parameter in amp_module.parameters():
        _amp_module_of_parameter[parameter] = ref
        waiting.append(_optimizer_waiting_for_parameter.pop(parameter, None))
    for optimizer in {id(o): o for o in (ref() for ref in waiting if ref is not None) if o is not None}.values():
        amp_module._link_optimizer(optimizer)


def relink(optimizer) -> None:
    """Link a copy of a decorated optimizer (deepcopy, pickle) to the copies of its AmpModules, whichever of the
    two is rebuilt first; a copy of the optimizer alone has parameters of its own, and links to nothing."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    amp_modules = amp_modules_of(parameters)
    for amp_module in amp_modules:
        linked = amp_module._linked_optimizer
        if linked is None or linked() is None:  # a copied AmpModule's; a live link (copy.copy's original) stays
            amp_module._link_optimizer(optimizer)
    if not amp_modules:
        ref = weakref.ref(optimizer)
        for parameter in parameters:
            _optimizer_waiting_for_parameter[parameter] = ref


def amp_modules_of(parameters) -> list[torch.nn.Module]:
    """The AmpModules that own these parameters (rewrite() registered them)."""
    refs = (_amp_module_of_parameter.get(p) for p in parameters)
    return list({id(m): m for m in (ref() for ref in refs if ref is not None) if m is not None}.values())


def link(optimizers: list, model: torch.nn.Module | None) -> None:
    """Link decorated optimizers (sharing one loss scaler) to the AmpModules that feed their parameters.

    Args:
        optimizers: the OptimizerWithMixedPrecision wrappers made by one decorate() call.
        model: None to find the AmpModules through the parameters; else an AmpModule, or a module holding some
            (a LightningModule, say), to link to.
    """
    parameters = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    if model is None:
        amp_modules = amp_modules_of(parameters)
    else:
        amp_modules = [m for m in model.modules() if hasattr(m, "_link_optimizer")]
        if not amp_modules:
            raise LossScalingError(
                f"decorate(model=...) got a {type(model).__name__} that holds no AmpModule: pass the module "
                "graphamp.rewrite() returned."
            )
        owned = {id(p) for m in amp_modules for p in m.parameters()}
        if not any(id(p) in owned for p in parameters):
            raise LossScalingError(
                "decorate(model=...): the optimizer holds none of that AmpModule's parameters; build the optimizer "
                "from amp_model.parameters() (they are the original model's)."
            )
    for amp_module in amp_modules:
        amp_module._link_optimizer(optimizers[0])


def scale_gradients(factor: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` as they are, except that the gradients flowing back through those requiring grad are times `factor`.

    The tensors requiring grad are replaced by new ones (same storage) whose gradients pass through one
    `_ScaleGradients` node: only what reaches them from outside is scaled, not what reaches the originals.
    """
    return _through(_ScaleGradients, factor, tensors)


def unscale_gradients(inv_scale: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """As scale_gradients(inv_scale, tensors), for the gradients the graph computes: divided in place."""
    return _through(_UnscaleGradients, inv_scale, tensors)


def _through(function: type[torch.autograd.Function], factor: torch.Tensor, tensors: list) -> list:
    """`tensors`, those requiring grad replaced by `function`'s outputs for them (one node for all)."""
    positions = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return tensors
    tensors = list(tensors)
    for i, t in zip(positions, function.apply(factor, *(tensors[i] for i in positions))):
        tensors[i] = t
    return tensors


def run_scaled(run, inputs: list, scale: torch.Tensor, weight_casts=None):
    """`run(*inputs)` with the gradient entering its floating outputs times `scale` and that leaving into each
    input requiring grad (the master weights, an `inputs_embeds`) divided by it: transparent from outside.

    weight_casts: for a weight-cache graph, `weight_casts(1/scale)` gives the low-precision weights it takes after
    `inputs`; their gradients are divided in float32, after the cast up (graphamp.runtime.weight_cache), since a division
    in float16 would flush the small gradients the scaling is there to keep.
    """
    up, down = scaling_factors(scale)
    casts = weight_casts(down) if weight_casts is not None else []
    # Outputs computed from other outputs (HF's loss from the logits): only the gradient from outside is scaled.
    return scale_gradients(up, list(run(*unscale_gradients(down, inputs), *casts)))


def scaling_factors(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) as of now: the scale's update at this iteration's step() must not reach its backward."""
    # The reciprocal in float64 (MPS has none), as GradScaler's unscale_: float32 division is inexact under some
    # compile options.
    inv_scale = scale.reciprocal() if scale.device.type == "mps" else scale.double().reciprocal().float()
    return scale.clone(), inv_scale
