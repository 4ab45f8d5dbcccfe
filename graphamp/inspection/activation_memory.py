"""How many bytes autograd keeps for backward: the activation memory that checkpointing trades for compute."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from graphamp.frontends.low_storage import stored_values

__all__ = ["saved_activation_bytes"]


def saved_activation_bytes(model: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct tensors autograd saves for backward while `run()` computes a loss, parameters excluded.

    Counted once per storage through torch.autograd.graph.saved_tensors_hooks, so a view saved twice or a
    tensor saved by two ops counts once. Tensors a checkpoint saves and drops in its own hooks are not counted.
    Call a rewritten model once before measuring it, so that dynamo compiles outside the hooks.

    Args:
        model: the model whose parameters (the FP32 master weights, memory either way) are left out.
        run: computes the loss; its result is returned to nobody and freed.
    """
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = stored_values(tensor).untyped_storage()  # a LowStorageTensor holds its low values
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run()
    del loss
    kept = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(nbytes for pointer, nbytes in storages.items() if pointer not in kept)
