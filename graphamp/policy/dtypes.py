"""The low-precision dtypes: their names, and whether a device can run them."""

from __future__ import annotations

import warnings

import torch

from graphamp.errors import ArgumentError
from graphamp.torch_private import cpu_runs_bfloat16_natively

__all__ = ["HALF_DTYPES", "check_dtype_runs_on", "cpu_runs_bfloat16_natively", "dtype_name", "resolve_dtype"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_dtype(dtype) -> torch.dtype:
    """'float16'/'bfloat16' (or fp16/bf16/half, or the torch dtype) as a torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in HALF_DTYPES:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    raise ArgumentError(f"dtype={dtype!r} is not a low-precision float: use 'float16' or 'bfloat16'.")


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """torch.bfloat16 -> 'bfloat16', the name users write."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def check_dtype_runs_on(device: torch.device | None, dtype: torch.dtype, compile: bool) -> None:
    """A dtype the device cannot run is an error now, not a crash deep inside a kernel."""
    if device is None:
        return
    if device.type == "cuda":
        name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        named = f"{name} (sm_{capability[0]}{capability[1]})"
        if dtype == torch.float16 and capability < (5, 3):
            raise ArgumentError(f"{named} has no float16 arithmetic: train it in float32.")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ArgumentError(f"{name} cannot run bfloat16: use AutoMixedPrecisionLists(dtype='float16').")
        if dtype == torch.bfloat16 and compile and capability < (8, 0):
            raise ArgumentError(
                f"{named} cannot run inductor's bfloat16 kernels, which need sm_80: "
                f"use AutoMixedPrecisionLists(dtype='float16') or compile=False."
            )
    if device.type == "cpu" and dtype == torch.float16:
        _warn_once(
            "_warned_float16_on_cpu",
            "float16 on CPU runs but is about 100x slower than bfloat16 on this kind of CPU: "
            "use AutoMixedPrecisionLists(dtype='bfloat16') for speed.",
        )
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_runs_bfloat16_natively():
        _warn_once(
            "_warned_bfloat16_on_cpu",
            "this CPU has no native bfloat16 (no AVX512-BF16 or AMX): bfloat16 runs emulated and will be slower "
            "than float32 here. The numerics are those of a bfloat16 run; train on a GPU or a CPU with AMX for speed.",
        )


# Each warning is given once per process; the flags are module globals so that tests can reset them.
_warned_float16_on_cpu = False
_warned_bfloat16_on_cpu = False


def _warn_once(flag: str, message: str) -> None:
    if not globals()[flag]:
        globals()[flag] = True
        warnings.warn(message, stacklevel=4)
