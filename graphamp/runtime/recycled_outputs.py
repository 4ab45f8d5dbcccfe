"""Outputs cast up to float32 on a CPU, written into the storage of the previous call's output once the caller has
let go of it.

fp32_outputs casts a model's low-precision outputs up after the compiled graph: for a language model the logits,
batch x sequence x vocabulary float32. On a CPU a buffer that size (32 MiB and up) is above glibc's largest mmap
threshold, so every call maps fresh pages and faults each one in: 12 ms for the 32 MiB of a CPU-size GPT-2's
logits against 0.5 ms to copy into pages already mapped (AMD EPYC, benchmarks/results/compiled_gap.md). Kept
between calls, the storage is reused when nothing else holds it: no tensor, view, saved-for-backward value or
NumPy array of the caller's. CUDA's caching allocator already reuses its blocks, so only CPU outputs are kept.
"""

from __future__ import annotations

import torch

__all__ = ["RecycledOutputs"]


class RecycledOutputs:
    """Per output index, the float32 storage of the last cast, and `cast(index, value, dtype)` that reuses it."""

    def __init__(self):
        self._storages: dict[int, torch.UntypedStorage] = {}

    def cast(self, index: int, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`value.to(dtype)`, the same values, strides and autograd graph, written into a kept storage if free."""
        if value.device.type != "cpu" or torch.is_inference_mode_enabled() or not _dense(value):
            return value.to(dtype)  # an inference tensor could not be written outside inference mode later
        storage = self._storages.get(index)
        needed = value.numel() * dtype.itemsize
        if storage is None or storage.nbytes() < needed or not _only_ours(storage):
            out = torch.empty_strided(value.size(), value.stride(), dtype=dtype)
        else:
            out = torch.empty(0, dtype=dtype).set_(storage, 0, value.size(), value.stride())
        self._storages[index] = out.untyped_storage()
        return out.copy_(value)  # differentiable: the gradient comes back to `value` in its own dtype


def _dense(value: torch.Tensor) -> bool:
    """Strides that cover exactly numel elements (contiguous in some order), so the copy fills the storage."""
    return value.is_contiguous() or value.is_contiguous(memory_format=torch.channels_last) and value.dim() == 4


def _only_ours(storage: torch.UntypedStorage) -> bool:
    """Held by this object alone: every tensor viewing it, including autograd's saved ones, is gone."""
    return torch._C._storage_Use_Count(storage._cdata) == 1
