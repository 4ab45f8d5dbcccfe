"""Loss scaling inside the graph: any loop's plain `loss.backward()` leaves true FP32 gradients in `.grad`.

While a rewritten model (its backend) is linked to a decorated optimizer whose scale is not fixed at 1.0, each
graph run with autograd on multiplies the gradient entering it at its floating outputs by the scale, and the one
leaving it into each input by 1/scale (the fused `_amp_foreach_non_finite_check_and_unscale_`, whose found_inf
`CheckedGradients` keeps for `step()`), both read from the LossScaler's device tensor: no host sync. The scale
wraps the float32 the caller sees, so a gradient is scaled before it is cast low, and a float16 gradient one graph
leaves into another's low output stays scaled between them (`LowStorageTensor(stored, times=1/scale)`).
docs/training_loops.md and docs/loss_scaling.md ("Linked", "One pass") say what follows for gradients and `step()`.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch

from graphamp.frontends.low_storage import LowStorageTensor, stored_values, times_of
from graphamp.training.loss_scaler import reciprocal_of
from graphamp.torch_private import tensor_version

__all__ = [
    "CheckedGradients", "ScalingFactors", "factors_read_from", "nearest_scaling_nodes", "run_scaled", "scaled_outputs",
    "scaling_factors", "times_present",
]


class ScalingFactors(NamedTuple):
    """One iteration's loss scaling as the graphs apply it: `up`, the scale as of the iteration's first graph run
    (a copy: step() must not reach its backward), and `down`, 1/scale. Every graph run of the iteration shares
    these very tensors, so that a graph knows a float16 gradient another graph left scaled (times `down`)."""

    up: torch.Tensor
    down: torch.Tensor


def scaling_factors(scale: torch.Tensor) -> ScalingFactors:
    return ScalingFactors(scale.clone(), reciprocal_of(scale))


def factors_read_from(inputs: list) -> list[ScalingFactors]:
    """The factors of the scaled graph runs whose outputs `inputs` were computed from: on each path back through
    autograd, the nearest such run (its `_ScaleGradients` node), past any eager ops between. Parameters and inputs
    without history cost nothing; a graph break's next graph stops at the graph before it."""
    found = {id(node.factors): node.factors for node in nearest_scaling_nodes(inputs)}
    return list(found.values())


def nearest_scaling_nodes(tensors: list):
    """The autograd nodes that carry `factors` (a graph's scaling, a scaled eager cast) nearest to `tensors`, on each
    path back through autograd, past any other nodes between."""
    seen = set()
    nodes = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(getattr(node, "factors", None), ScalingFactors):
            yield node
        else:
            nodes.extend(next_node for next_node, _ in node.next_functions)


def times_present(factor: torch.Tensor, grads) -> list:
    """`grads` times a loss-scaling factor in one foreach kernel, None where a gradient is None (an unused input);
    under create_graph=True differentiable as the identity.

    Why the identity: a gradient penalty differentiates the graph's backward again. Its second-order gradient enters
    that backward where the first-order one leaves (into the master weights, an input) and reaches the graph's inputs
    through the tensors the forward saved, so it passes the 1/scale at the inputs once more. Left out of the factors
    here, it runs through the graph scaled as the first-order gradients do, and comes out true.
    """
    given = [g for g in grads if g is not None]
    if not given:
        return list(grads)
    scaled = iter(_Times.apply(factor, *given) if torch.is_grad_enabled() else _multiplied(given, factor))
    return [None if g is None else next(scaled) for g in grads]


def _multiplied(grads: list[torch.Tensor], factor: torch.Tensor) -> list[torch.Tensor]:
    """`grads` times `factor` in float32 arithmetic, each back in its own dtype. A float16 tensor times a float32
    CUDA scalar tensor rounds the factor to float16 first, where 2**16, the first scale, is inf."""
    products = torch._foreach_mul([g.float() for g in grads], factor)
    return [p if p.dtype == g.dtype else p.to(g.dtype) for p, g in zip(products, grads)]


class _Times(torch.autograd.Function):
    """`grads` times `factor`; the gradient passes back unchanged (see `times_present`)."""

    @staticmethod
    def forward(ctx, factor: torch.Tensor, *grads: torch.Tensor):
        return tuple(_multiplied(list(grads), factor))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


class _ScaleGradients(torch.autograd.Function):
    """Identity forward; backward multiplies every incoming gradient by the scale (one foreach kernel). A float16
    gradient a graph of the same iteration left holding the scale (between two graphs) goes on as it is: no copy,
    and float16 never holds it unscaled."""

    @staticmethod
    def forward(ctx, factors: ScalingFactors, checks: CheckedGradients | None, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None, as in eager
        ctx.factors = factors
        ctx.checks = checks
        ctx.owners = [None if checks is None else checks.owner_of(t) for t in tensors]
        # detach(): new tensors on the same storage, not views, so that a caller may write into an output in place
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        up, down = ctx.factors
        # A float16 gradient another graph of this iteration left scaled goes on as it is (unless create_graph=True).
        kept = {} if torch.is_grad_enabled() else {
            i: LowStorageTensor(stored_values(g)) for i, g in enumerate(grads) if times_of(g) is down
        }
        multiplied = times_present(up, [None if i in kept else g for i, g in enumerate(grads)])
        return (None, None, *(kept.get(i, m) for i, m in enumerate(multiplied)))


class _UnscaleGradients(_ScaleGradients):
    """The gradients leaving the graph into the master weights, times 1/scale: in place, in one fused
    `_amp_foreach_non_finite_check_and_unscale_` kernel, as `unscale_()` does, where the gradient is the graph's own
    (computed by its backward, dense, sharing storage with no other gradient of this call, no double backward);
    elsewhere out of place. Each kernel's found_inf goes to `checks`, so that step() need not check those again."""

    @staticmethod
    def backward(ctx, *grads):
        factor = ctx.factors.down
        if torch.is_grad_enabled():  # create_graph=True: the multiply must be differentiable
            return (None, None, *times_present(factor, grads))
        result, in_place = [None, None, *grads], {}
        # A low output's gradient is passed on below with its storage: one sharing it (add's backward hands both its
        # inputs one tensor) is not divided in place, which would divide the low output's too, kept scaled.
        storages = {stored_values(g).untyped_storage().data_ptr() for g in grads if isinstance(g, LowStorageTensor)}
        for i, (grad, owner) in enumerate(zip(grads, ctx.owners), start=2):
            if grad is None:
                continue
            if isinstance(grad, LowStorageTensor):
                # Into another graph's low output: kept scaled in float16, presenting the true gradient (times
                # 1/scale), since float16 cannot hold it unscaled; that graph's own scaling takes it as it is.
                result[i] = LowStorageTensor(stored_values(grad), factor)
                continue
            if grad.layout != torch.strided:  # a sparse gradient (Embedding(sparse=True)) has no storage to write
                result[i] = _multiplied([grad], factor.to(grad.device))[0]
                continue
            storage = grad.untyped_storage().data_ptr()
            if grad.is_contiguous() and grad.is_floating_point() and storage not in storages:
                # One found_inf per optimizer of decorate([a, b]): each skips on its own gradients only.
                in_place.setdefault((grad.device, grad.dtype, owner), []).append(grad)
            else:  # an expanded gradient, or one an add's backward also gave another input: leave it unwritten
                result[i] = _multiplied([grad], factor.to(grad.device))[0]
            storages.add(storage)
        for (device, _, _), same_kind in in_place.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(same_kind, found_inf, factor.to(device))
            if ctx.checks is not None:
                ctx.checks.record(same_kind, found_inf)
        return tuple(result)


class _Checked(NamedTuple):
    """A gradient as the graph's backward checked it (its storage, weakly), and the found_inf of that check."""

    storage: weakref.ref
    layout: tuple
    version: int
    found_inf: torch.Tensor


class CheckedGradients:
    """The gradients the graphs divided and checked in place since the last step, each with its kernel's found_inf.

    A parameter's `.grad` counts as checked only while it is that very tensor, unchanged: the same storage, layout
    and version. Any other (summed over micro-batches, eager, copied, changed in place) `step()` checks itself:
    docs/loss_scaling.md, "One pass, linked".
    """

    def __init__(self, owner_of: Callable[[torch.Tensor], object]) -> None:
        # Which optimizer of decorate([a, b]) a graph input belongs to: each gets found_infs of its own.
        self.owner_of = owner_of
        # By id() of the storage: torch keeps one Python object per storage, as per tensor, so the weak reference
        # to it is its identity. (Were it not kept, the reference would die at once and step() check everything.)
        self._checked: dict[int, _Checked] = {}
        self._prune_at = 64

    def record(self, grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        for grad in grads:
            if type(grad) is torch.Tensor:  # a subclass (DTensor) may share no real storage: step() checks it
                storage = grad.untyped_storage()
                self._checked[id(storage)] = _Checked(weakref.ref(storage), _layout(grad), tensor_version(grad), found_inf)
        if len(self._checked) > self._prune_at:  # backward after backward with no step(): forget freed gradients
            self._checked = {key: c for key, c in self._checked.items() if c.storage() is not None}
            self._prune_at = 2 * len(self._checked) + 64

    def split(self, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the gradients still to check, the found_infs of the others): their flags count for them."""
        if not self._checked:
            return grads, []
        unchecked, found_infs = [], {}
        for grad in grads:
            storage = grad.untyped_storage() if type(grad) is torch.Tensor else None
            checked = self._checked.get(id(storage)) if storage is not None else None
            if (checked is not None and checked.storage() is storage and checked.version == tensor_version(grad)
                    and checked.layout == _layout(grad)):
                found_infs[id(checked.found_inf)] = checked.found_inf
            else:
                unchecked.append(grad)
        return unchecked, list(found_infs.values())

    def clear(self) -> None:
        self._checked.clear()

    def __reduce__(self):
        return CheckedGradients, (self.owner_of,)  # a copy's gradients are its own: none checked yet


def _layout(grad: torch.Tensor) -> tuple:
    return grad.data_ptr(), grad.stride()  # the shape is the parameter's: autograd and AccumulateGrad enforce it


def _through(function: type[_ScaleGradients], factors: ScalingFactors, tensors: list,
             checks: CheckedGradients | None, kept: frozenset = frozenset()):
    """`tensors`, those requiring grad (but the positions `kept`) replaced by new ones (same storage) whose gradients
    pass through one `function` node: only what reaches them from outside is scaled, not what reaches the originals."""
    positions = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad and i not in kept]
    if not positions:
        return tensors
    tensors = list(tensors)
    for i, t in zip(positions, function.apply(factors, checks, *(tensors[i] for i in positions))):
        tensors[i] = t
    return tensors


def scaled_outputs(factors: ScalingFactors, tensors: list) -> list:
    """`tensors` (outputs), the gradient entering each times the scale, as a graph's outputs."""
    return _through(_ScaleGradients, factors, tensors, None)


def run_scaled(run, inputs: list, factors: ScalingFactors, checks: CheckedGradients | None = None,
               kept: frozenset = frozenset()):
    """`run(*inputs)` with the gradient entering its floating outputs times the scale and that leaving into each
    input requiring grad (the master weights, an activation) divided by it, checked for inf/NaN into `checks`:
    transparent from outside. The inputs at positions `kept` (float16 values of eager code that hold scaled
    gradients: eager_scaling.py) get theirs as the graph computed it, scaled."""
    inputs = _through(_UnscaleGradients, factors, inputs, checks, kept)
    outputs = list(run(*inputs))
    # A plain float16 output beside kept inputs follows their dtype (gray ops, a view): its gradient comes scaled from
    # the eager float16 ops reading it, or from the call's presentation of it (eager_scaling.py): not scaled again.
    followed = frozenset(
        i for i, t in enumerate(outputs) if type(t) is torch.Tensor and t.dtype == torch.float16
    ) if kept else frozenset()
    # Outputs computed from other outputs (HF's loss from the logits): only the gradient from outside is scaled.
    return _through(_ScaleGradients, factors, outputs, None, followed)
