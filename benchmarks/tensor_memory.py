"""Peak bytes of live tensors over one train step on a CPU, counted from torch.profiler's allocation events.

A process's peak resident memory (what train_step.py reports on a CPU) also counts what glibc keeps after a free
and how its heap happens to fragment: on the 2-core EPYC used so far the same mode's peak moved by 15-20 MiB from
one process to the next. The bytes torch's CPU allocator hands out do not move. This is what CUDA's
`max_memory_allocated` is on a GPU: tensors alive when the step starts (weights, optimizer state, anything a mode
keeps between steps), plus the highest running sum of the step's allocations less its frees.
"""

from __future__ import annotations

import gc
import warnings

import torch
from torch.profiler import ProfilerActivity, profile


def peak_tensor_bytes(step) -> int:
    """Bytes of CPU tensor storage alive when `step()` starts, plus the most it allocates beyond that at once."""
    gc.collect()
    alive = _alive_cpu_storage_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    events = [e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return alive + peak


def _alive_cpu_storage_bytes() -> int:
    """Each CPU storage reachable from Python once: tensors' (parameters, gradients, optimizer state, buffers) and
    storages held on their own."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, (torch.Tensor, torch.UntypedStorage))]
    for obj in objects:
        try:
            if isinstance(obj, torch.Tensor):
                if obj.device.type != "cpu" or isinstance(obj, torch._subclasses.FakeTensor) or obj.is_sparse:
                    continue
                storage = obj.untyped_storage()
            elif isinstance(obj, torch.UntypedStorage):
                if obj.device.type != "cpu":
                    continue
                storage = obj
            else:
                continue
            if storage.data_ptr():
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (functional wrappers and the like)
            continue
    return sum(seen.values())
