"""A model's `.to(device)`, `.cpu()`, `.cuda()` and `.to(other)` captured as eager code runs them: no dtype frozen.

Tracing records `x.to(device)` as `to(x, dtype=<x's traced dtype>, device)` and `x.to(other)` as a cast into other's
traced dtype. In the FP32 trace both read as a cast to float32, which the cast pass keeps as the model's own cast,
where graphamp computes x (or other) low and eager code under autocast keeps it low: wav2vec2's
`hidden_states + position_embeddings.to(hidden_states.device)` would promote the whole residual stream. Dynamo's
graphs are lowered through `move_without_a_dtype` (lowering.py), torch.export's capture under `DeviceMovesAsRun`.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["DeviceMovesAsRun", "move_without_a_dtype"]

_MOVES = {torch.Tensor.to: "to", torch.Tensor.cpu: "cpu", torch.Tensor.cuda: "cuda"}


def move_without_a_dtype(method: str, args: tuple, kwargs: dict):
    """`x.to(device)`, `x.cpu()`, `x.cuda()` or `x.to(other)` as eager code runs them: x itself where it is on that
    device already, a copy with no dtype where it is not, and `type_as(x, other)`, whose dtype the cast pass takes
    from other as the rewritten graph has it. None for a call that names a dtype, a copy or a memory format."""
    tensor, *rest = args
    options = {**dict(zip(("non_blocking", "copy"), (a for a in rest if isinstance(a, bool)))), **kwargs}
    named = [a for a in rest if not isinstance(a, bool)] + ([kwargs["device"]] if "device" in kwargs else [])
    if options.get("copy") or "memory_format" in options or "dtype" in options or len(named) > 1:
        return None
    if not isinstance(tensor, torch.Tensor) or any(isinstance(a, torch.dtype) for a in named):
        return None
    other = named[0] if named and isinstance(named[0], torch.Tensor) else None
    if other is not None:
        device = other.device
    elif method == "cpu":
        device = torch.device("cpu")
    elif named and named[0] is not None:
        device = torch.device(named[0])
    else:
        device = torch.device("cuda") if method == "cuda" else tensor.device
    moved = tensor if _with_index(device) == tensor.device else torch.ops.aten._to_copy.default(
        tensor, device=device, non_blocking=bool(options.get("non_blocking", False))
    )
    return torch.ops.aten.type_as.default(moved, other) if other is not None else moved


def _with_index(device: torch.device) -> torch.device:
    """`cuda` as `.to()` reads it: the current device."""
    if device.type == "cpu" or device.index is not None or not torch.accelerator.is_available():
        return device
    return torch.device(device.type, torch.accelerator.current_device_index())


class DeviceMovesAsRun(TorchFunctionMode):
    """While torch.export traces: the moves above lowered by `move_without_a_dtype`, every other call as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        method = _MOVES.get(func)
        if method is not None and (moved := move_without_a_dtype(method, args, kwargs)) is not None:
            return moved
        return func(*args, **kwargs)
