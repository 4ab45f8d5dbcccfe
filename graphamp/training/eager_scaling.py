"""Linked loss scaling for the float16 ops graphamp's eager policy runs beside the graphs.

Code dynamo runs eagerly (a frame looping over blocks that break the graph, as FSDP2's per-block hooks make it;
code after a break; skipped code) runs its white ops in float16 under the eager policy, and no graph edge scales
their gradients. So the policy's casts across float16's edge are scaling edges too: a cast down to float16 hands
back the gradient times `down`, in float32; a cast up from float16 takes the gradient times `up` before casting it
low; an op that crosses the edge inside (type promotion, an in-place op into the other dtype, `dtype=float32`, a
normalization's float32 parameters) gets such a cast from the policy. The factors are the iteration's, shared with
its graphs (in_graph_scaling.py), so float16 holds every gradient scaled, between eager ops and graphs alike.
docs/loss_scaling.md, "Linked", says what stays uncovered.
"""

from __future__ import annotations

from typing import Callable

import torch

from graphamp.frontends.low_storage import LowStorageTensor, presented_as_float32, stored_values, times_of
from graphamp.torch_private import pytree
from graphamp.training.in_graph_scaling import ScalingFactors, nearest_scaling_nodes, scaled_outputs, times_present

__all__ = ["ScaledCasts", "entered_low_at"]


class ScaledCasts:
    """The scaling edges of one linked model call's eager policy; `factors_on(device)` gives the iteration's
    factors (made at its first graph run or scaled cast, whichever comes first)."""

    def __init__(self, factors_on: Callable[[torch.device], ScalingFactors], low: torch.dtype) -> None:
        self._factors_on = factors_on
        self.low = low

    def cast(self, source: torch.Tensor, convert: Callable, into_low: bool) -> torch.Tensor:
        """`convert(source)`, a cast into float16 (`into_low`) or out of it, as a scaling edge."""
        if not (source.requires_grad and torch.is_grad_enabled()):
            return convert(source)
        return _Crossing.apply(self._factors_on(source.device), into_low, convert, source)

    def returned(self, outputs):
        """A model call's float16 results from eager code, presented as float32 (as a graph's low outputs are), the
        gradient entering them times the scale: the caller's loss is not scaled."""
        def present(tensor: torch.Tensor) -> torch.Tensor:
            factors = entered_low_at(tensor) if self._scaled(tensor) else None
            if factors is None:
                return tensor
            return scaled_outputs(factors, presented_as_float32([tensor], by_itself=True))[0]

        return pytree.tree_map_only(torch.Tensor, present, outputs)

    def _scaled(self, tensor: torch.Tensor) -> bool:
        return type(tensor) is torch.Tensor and tensor.dtype == self.low and tensor.requires_grad


def entered_low_at(tensor: torch.Tensor) -> ScalingFactors | None:
    """The factors of the scaled cast into float16 that `tensor` (a float16 value) was computed from, if any: on each
    path back through autograd the nearest scaling node, past the eager ops between. Only a value made by such
    casts holds a scaled gradient; a graph reading it keeps its gradient scaled."""
    # a graph's edge or a cast out of float16 on the way back is another region's
    return next((node.factors for node in nearest_scaling_nodes([tensor]) if getattr(node, "into_low", False)), None)


class _Crossing(torch.autograd.Function):
    """A cast across float16's edge whose backward scales: into float16, the gradient leaves times `down` in float32
    (presented over the float16 one where the source is a graph's low output, which takes it as it is); out of
    float16, it comes in times `up` before its cast low."""

    @staticmethod
    def forward(ctx, factors: ScalingFactors, into_low: bool, convert: Callable, source: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.factors, ctx.into_low = factors, into_low
        ctx.source_dtype, ctx.from_graph = source.dtype, isinstance(source, LowStorageTensor)
        result = convert(source)
        return result.detach() if result is source else result

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None, None, None
        up, down = ctx.factors
        grad_enabled = torch.is_grad_enabled()  # create_graph=True: the multiply is differentiated as the identity
        if ctx.into_low:
            if ctx.from_graph and not grad_enabled:
                return None, None, None, LowStorageTensor(stored_values(grad), down)
            (grad,) = times_present(down, [stored_values(grad).float()])
        elif times_of(grad) is down and not grad_enabled:  # a graph's gradient, kept scaled in float16 already
            return None, None, None, stored_values(grad).to(ctx.source_dtype)
        else:
            (grad,) = times_present(up, [grad])
        return None, None, None, grad.to(ctx.source_dtype)
