"""The weight cache: low-precision copies of the FP32 master weights, cast once per optimizer step.

The cast pass casts each parameter inside the graph, so every forward casts every weight again: with gradient
accumulation over N micro-batches each weight is cast N times per optimizer step. `feed_weight_casts` makes
the graph take those casts as inputs instead, and a `WeightCache` keeps them between forwards. A copy is made
once by `weight.to(dtype)` outside the graph; its autograd node (ToCopyBackward0, which saves no tensor)
carries every later backward's gradient to the master weight, cast to FP32, exactly as the cast inside the
graph did; under loss scaling in the graph one node per forward does that instead, dividing by that forward's
scale (`_CastGradientsUp`). When a weight changes, its copy is recast in place at the next forward, all stale
copies in one `torch._foreach_copy_`.

A weight has changed when
- any torch optimizer stepped (a global step post-hook): every weight that requires grad may have changed, not
  only the optimizer's own (fused optimizers write without bumping `_version`; FSDP2 gathers its unsharded
  weights from the stepped shards, into the same storage, without bumping it either);
- its `_version` moved (in-place writes under no_grad, `load_state_dict`, foreach optimizers);
- it is held in another storage or device (`.to()`, `param.data = t`), or its requires_grad changed.
Writes through `param.data` (`p.data.copy_(t)`, `p.data.mul_(c)`) move no counter and are not seen: call
`amp_model.weight_cache.clear()` after them, or rewrite with `weight_cache=False`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch import nn
from torch._ops import OpOverload
from torch.fx import GraphModule
from torch.utils.weak import WeakIdKeyDictionary

from graphamp.aten_ops import written_inputs
from graphamp.dtypes import HALF_DTYPES
from graphamp.runtime.in_graph_scaling import times_present

__all__ = ["WeightCache", "feed_weight_casts"]

_CAST_OP = torch.ops.aten._to_copy.default
_caches: weakref.WeakSet[WeightCache] = weakref.WeakSet()
_step_hook = None


def feed_weight_casts(graph_module: GraphModule, weight_placeholders: list[str]) -> list:
    """Edit `graph_module` in place: its casts of weights to float16/bfloat16 become inputs, appended after the others.

    Args:
        graph_module: a rewritten graph (a copy of the cast pass's output).
        weight_placeholders: names of the placeholders that are parameters.

    Returns:
        [(index of the weight among the graph's placeholders, dtype), ...], one entry per new input, in order: call
        the graph with the original inputs followed by those weights' casts.
    """
    graph = graph_module.graph
    placeholders = graph.find_nodes(op="placeholder")
    index_of = {node: i for i, node in enumerate(placeholders)}
    # A weight the graph writes into would need its cast made after the write: leave those inside.
    written = {n for node in graph.nodes if isinstance(node.target, OpOverload) for n in written_inputs(node)}
    weight_names = set(weight_placeholders)
    weights = [n for n in placeholders if n.name in weight_names and n not in written]
    fed = []
    for weight in weights:
        for cast in [u for u in weight.users if _is_plain_cast_down(u)]:
            with graph.inserting_after(placeholders[-1]):
                placeholder = graph.placeholder(f"{weight.name}_{str(cast.kwargs['dtype']).removeprefix('torch.')}")
            placeholder.meta = dict(cast.meta)
            cast.replace_all_uses_with(placeholder)
            graph.erase_node(cast)
            placeholders.append(placeholder)
            fed.append((index_of[weight], cast.kwargs["dtype"]))
    graph.lint()
    graph_module.recompile()
    return fed


def _is_plain_cast_down(node) -> bool:
    return node.target is _CAST_OP and set(node.kwargs) == {"dtype"} and node.kwargs["dtype"] in HALF_DTYPES


class _CastGradientsUp(torch.autograd.Function):
    """One forward's kept copies, as its inputs; backward takes their gradients to the master weights: cast up to
    float32, then times `factor`, this forward's 1/scale (in float32: in float16 the division would flush the small
    gradients the scaling is there to keep). One node per forward, so each backward divides by its own forward's
    scale, even after a skipped step changed the scale while the copies stayed.
    """

    @staticmethod
    def forward(ctx, factor: torch.Tensor, static: bool, copies: list[torch.Tensor], *weights: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(factor)
        copies = tuple([low.detach() for low in copies])  # new tensors on their storage: the kept keep their history
        if static:
            for low in copies:
                torch._dynamo.mark_static_address(low)
        return copies

    @staticmethod
    def backward(ctx, *grads):
        (factor,) = ctx.saved_tensors
        # float32 whatever the master weight's dtype (FP32, or float64): autograd casts to it on the way in.
        up = times_present(factor, [None if g is None else g.float() for g in grads])
        return (None, None, None, *up)


@dataclass
class _Copy:
    """One weight's low-precision copy and what the weight was when it was cast."""

    low: torch.Tensor
    version: int
    data_ptr: int
    requires_grad: bool
    stale: bool = False

    @classmethod
    def of(cls, weight: torch.Tensor, dtype: torch.dtype) -> _Copy:
        # Outside inference mode and with grad on: the copy serves every later forward and backward.
        with torch.inference_mode(False), torch.enable_grad():
            low = weight.to(dtype)
        return cls(low, weight._version, weight.data_ptr(), weight.requires_grad)

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether the copy can be recast in place: same storage, device, shape and requires_grad."""
        return (
            self.data_ptr == weight.data_ptr()
            and self.requires_grad == weight.requires_grad
            and self.low.device == weight.device
            and self.low.shape == weight.shape
        )


class WeightCache:
    """Low-precision copies of parameters, keyed by parameter and dtype, recast when a parameter changes.

    Only `nn.Parameter` objects are cached; other tensors (`torch.func.functional_call`'s) are cast afresh.
    """

    def __init__(self) -> None:
        self._copies = WeakIdKeyDictionary()  # parameter -> {dtype: _Copy}
        self._last: tuple[list, list[_Copy]] = ([], [])  # the last request's (weights, copies): calls repeat it
        self.static_addresses = False  # mark copies for CUDA graphs (compile mode "reduce-overhead")
        _install_step_hook()
        _caches.add(self)

    def casts_of(
        self, weights: list[tuple[torch.Tensor, torch.dtype]], gradient_factor: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Each weight cast to its dtype: the kept copy, recast first if the weight changed since.

        Args:
            weights: (parameter, dtype) pairs, as the graph takes them.
            gradient_factor: under loss scaling in the graph, 1/scale of this forward: the copies' gradients
                are multiplied by it in float32, on their way back to the master weights.
        """
        if gradient_factor is None:
            fresh = self._fresh_copies_of_last(weights)
            if fresh is not None:
                return fresh
        casts, stale, trained, trained_weights, copies_used = [], {}, [], [], []
        for weight, dtype in weights:
            if gradient_factor is not None and weight.requires_grad:
                trained.append(len(casts))
                trained_weights.append(weight)
            if type(weight) is not nn.Parameter:
                casts.append(weight.to(dtype))
                continue
            copies = self._copies.get(weight)
            if copies is None:
                copies = self._copies[weight] = {}
            kept = copies.get(dtype)
            if kept is None or not kept.holds(weight):
                kept = copies[dtype] = _Copy.of(weight, dtype)
                if self.static_addresses:
                    torch._dynamo.mark_static_address(kept.low)
            elif kept.stale or kept.version != weight._version:
                stale[id(kept)] = (kept, weight)
            casts.append(kept.low)
            copies_used.append(kept)
        if stale:
            _recast([kept for kept, _ in stale.values()], [weight for _, weight in stale.values()])
        if len(copies_used) == len(weights):
            self._last = ([weight for weight, _ in weights], copies_used)
        if trained and len(trained) == len(casts):  # this forward's own node between the copies and the master weights
            return list(_CastGradientsUp.apply(gradient_factor, self.static_addresses, casts, *trained_weights))
        if trained:
            through = _CastGradientsUp.apply(
                gradient_factor, self.static_addresses, [casts[i] for i in trained], *trained_weights
            )
            for i, cast in zip(trained, through):
                casts[i] = cast
        return casts

    def _fresh_copies_of_last(self, weights: list[tuple[torch.Tensor, torch.dtype]]) -> list[torch.Tensor] | None:
        """The copies of the last request if this one asks for the same weights and dtypes and none changed since:
        a decode step's forward, every token. Saves the per-weight dictionary lookups; None if anything differs."""
        last_weights, last_copies = self._last
        if len(last_weights) != len(weights):
            return None
        for (weight, dtype), last, kept in zip(weights, last_weights, last_copies):
            if (
                weight is not last or kept.low.dtype != dtype or kept.stale or kept.version != weight._version
                or not kept.holds(weight)
            ):
                return None
        return [kept.low for kept in last_copies]

    def mark_trained_stale(self) -> None:
        """Recast the copies of weights that require grad at their next use (an optimizer stepped)."""
        for copies in self._copies.values():
            for kept in copies.values():
                kept.stale = kept.stale or kept.requires_grad

    def clear(self) -> None:
        """Drop every copy; the next forward casts afresh (after writes through `param.data`)."""
        self._copies = WeakIdKeyDictionary()
        self._last = ([], [])

    def kept_copies(self) -> list[torch.Tensor]:
        """The low-precision copies held now."""
        return [kept.low for copies in self._copies.values() for kept in copies.values()]

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies: what the cache costs in memory between forwards."""
        return sum(low.nbytes for low in self.kept_copies())

    def __len__(self) -> int:
        return sum(len(copies) for copies in self._copies.values())

    def __getstate__(self) -> dict:
        return {"static_addresses": self.static_addresses}  # copies are not state: a copy recasts

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.static_addresses = state["static_addresses"]


def _recast(copies: list[_Copy], weights: list[torch.Tensor]) -> None:
    """Copy the weights into their low copies in place, one foreach kernel per device and dtype."""
    with torch.inference_mode(False), torch.no_grad():
        torch._foreach_copy_([kept.low for kept in copies], weights)
    for kept, weight in zip(copies, weights):
        kept.version = weight._version
        kept.stale = False


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for cache in list(_caches):
        cache.mark_trained_stale()


def _install_step_hook() -> None:
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_after_optimizer_step)
