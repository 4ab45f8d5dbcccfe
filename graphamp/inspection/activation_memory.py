"""How many bytes autograd keeps for backward: the activation memory that checkpointing trades for compute."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from graphamp.runtime.in_graph_scaling import amp_modules_of

__all__ = ["saved_activation_bytes"]


def saved_activation_bytes(model: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct tensors autograd saves for backward while `run()` computes a loss, parameters excluded.

    Counted once per storage through torch.autograd.graph.saved_tensors_hooks, so a view saved twice or a
    tensor saved by two ops counts once. Tensors a checkpoint saves and drops in its own hooks are not counted.
    Call an AmpModule once before measuring it: a capture inside `run()` would meet the hooks with fake tensors.

    Args:
        model: the model whose parameters (FP32 master weights, memory either way) are left out, with the
            low-precision copies an AmpModule's weight cache keeps between steps.
        run: computes the loss; its result is returned to nobody and freed.
    """
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run()
    del loss
    # Asked after run(): a weight cache fills on its first forward. Its low-precision weights stay between steps,
    # memory either way, like the FP32 weights.
    kept = {p.untyped_storage().data_ptr() for p in model.parameters()} | set(_weight_cache_storages(model))
    return sum(nbytes for pointer, nbytes in storages.items() if pointer not in kept)

def _weight_cache_storages(model: nn.Module):
    """Storages of the weight caches of the AmpModules that run `model`'s parameters (or are `model`)."""
    for amp_module in amp_modules_of(model.parameters()):
        if amp_module.weight_cache is not None:
            yield from (low.untyped_storage().data_ptr() for low in amp_module.weight_cache.kept_copies())
