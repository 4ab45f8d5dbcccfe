"""How many bytes autograd keeps for backward: the activation memory that checkpointing trades for compute."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["saved_activation_bytes"]


def saved_activation_bytes(model: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct tensors autograd saves for backward while `run()` computes a loss, parameters excluded.

    Counted once per storage through torch.autograd.graph.saved_tensors_hooks, so a view saved twice or a
    tensor saved by two ops counts once. Tensors a checkpoint saves and drops in its own hooks are not counted.
    Call an AmpModule once before measuring it: a capture inside `run()` would meet the hooks with fake tensors.

    Args:
        model: the model whose parameters (FP32 master weights, memory either way) are left out.
        run: computes the loss; its result is returned to nobody and freed.
    """
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run()
    del loss
    return sum(storages.values())
