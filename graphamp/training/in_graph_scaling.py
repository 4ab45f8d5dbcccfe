"""Loss scaling inside the graph: any loop's plain `loss.backward()` leaves true FP32 gradients in `.grad`.

While a rewritten model (its backend) is linked to a decorated optimizer whose scale is not fixed at 1.0, each
graph run with autograd on multiplies the gradient entering the graph (at its floating outputs) by the scale, and
the gradient leaving it into each input (the FP32 master weights, activations from the graph before a graph break)
by 1/scale, both read from the LossScaler's device tensor at forward time (no host sync). Inside, the float16
backward runs on scaled gradients, as with a scaled loss; outside, AccumulateGrad adds true gradients, so gradient
accumulation and `clip_grad_norm_` right after `backward()` are right. The optimizer's `step()` checks those gradients for inf/NaN and updates the scale.

The link: `decorate()` links its optimizer to the rewritten models holding its parameters (rewrite the model first),
or to the model given as `decorate(..., model=model)`; a model compiled with a graphamp.backend of one's own is
linked with `amp_backend.link_optimizer(optimizer)`.
"""

from __future__ import annotations

import torch

from graphamp.training.loss_scaler import reciprocal_of

__all__ = ["run_scaled", "scale_gradients", "scaling_factors", "times_present", "unscale_gradients"]


def times_present(factor: torch.Tensor, grads) -> list:
    """`grads` times a loss-scaling factor in one foreach kernel, None where a gradient is None (an unused input);
    under create_graph=True differentiable as the identity.

    Why the identity: a gradient penalty differentiates the graph's backward again. Its second-order gradient enters
    that backward where the first-order one leaves (into the master weights, an input) and reaches the graph's inputs
    through the tensors the forward saved, so it passes the 1/scale at the inputs once more. Left out of the factors
    here, it runs through the graph scaled as the first-order gradients do, and comes out true.
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    given = [grads[i] for i in present]
    scaled = (list(_Times.apply(factor, *given)) if torch.is_grad_enabled() else torch._foreach_mul(given, factor)) \
        if given else []
    result = [None] * len(grads)
    for i, grad in zip(present, scaled):
        result[i] = grad
    return result


class _Times(torch.autograd.Function):
    """`grads` times `factor`; the gradient passes back unchanged (see `times_present`)."""

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


def run_scaled(run, inputs: list, scale: torch.Tensor):
    """`run(*inputs)` with the gradient entering its floating outputs times `scale` and that leaving into each
    input requiring grad (the master weights, an activation) divided by it: transparent from outside."""
    up, down = scaling_factors(scale)
    # Outputs computed from other outputs (HF's loss from the logits): only the gradient from outside is scaled.
    return scale_gradients(up, list(run(*unscale_gradients(down, inputs))))


def scaling_factors(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) as of now: the scale's update at this iteration's step() must not reach its backward."""
    return scale.clone(), reciprocal_of(scale)
