"""Which gray kernels can run in low precision on a given device without losing what FP32 would give.

Normalizations (a low X with FP32 parameters) and interpolations (backward accumulation) differ between devices
and torch versions, so each is asked of the kernel itself, once per (family, device type, dtype), on a few
elements: docs/numerics.md says which and why.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch
import torch.nn.functional as F

from graphamp.policy.aten_ops import NORM_OPS
from graphamp.torch_private import outside_every_mode

__all__ = ["KERNEL_FAMILIES", "rounded_once", "runs_low_on"]

# The F function each normalization op is probed with (instance_norm runs batch_norm's kernel). A norm op of no
# family here is not probed, rather than probed as some other family's kernel.
_NORM_FAMILIES = {"layer_norm": "layer_norm", "group_norm": "group_norm", "batch_norm": "batch_norm",
                  "instance_norm": "batch_norm"}
_NORMS = {op: family for op in NORM_OPS for part, family in _NORM_FAMILIES.items() if part in op}
# interpolate's mode and the number of spatial dims of each upsample op.
_INTERPOLATIONS = {
    "upsample_nearest1d": ("nearest", 1), "upsample_nearest2d": ("nearest", 2), "upsample_nearest3d": ("nearest", 3),
    "_upsample_nearest_exact1d": ("nearest-exact", 1), "_upsample_nearest_exact2d": ("nearest-exact", 2),
    "_upsample_nearest_exact3d": ("nearest-exact", 3), "upsample_linear1d": ("linear", 1),
    "upsample_bilinear2d": ("bilinear", 2), "_upsample_bilinear2d_aa": ("bilinear-aa", 2),
    "upsample_trilinear3d": ("trilinear", 3), "upsample_bicubic2d": ("bicubic", 2),
    "_upsample_bicubic2d_aa": ("bicubic-aa", 2),
}
# ATen op name (overload packet) -> the kernel family probed for it.
KERNEL_FAMILIES = {**_NORMS, **{name: f"interpolate:{mode}:{dims}" for name, (mode, dims) in _INTERPOLATIONS.items()}}


def runs_low_on(op_name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `op_name` (an ATen overload packet name) may run in `dtype` on `device` as the gray rule wants:
    True for ops of no probed family."""
    family = KERNEL_FAMILIES.get(op_name)
    return family is None or (device.type != "meta" and _probe(family, device.type, dtype))


@lru_cache(maxsize=None)
def _probe(family: str, device_type: str, dtype: torch.dtype) -> bool:
    # The answer is kept for the process, so it must not depend on where the first call came from. A thread of its
    # own leaves the caller's thread-local state behind: a torch.func transform (which refuses requires_grad_), a
    # checkpoint region's saved-tensor hooks (which would count the probe's tensors), no_grad, inference_mode.
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(_probe_here, family, device_type, dtype).result()


def _probe_here(family: str, device_type: str, dtype: torch.dtype) -> bool:
    # Dispatch modes (a recorder, a fake mode) are left too; the probe draws no random numbers.
    with outside_every_mode(), torch.inference_mode(False), torch.enable_grad():
        device = torch.device(device_type)
        try:
            if family.startswith("interpolate:"):
                _, mode, dims = family.split(":")
                return _accumulates_in_fp32(mode, int(dims), device, dtype)
            return _takes_fp32_parameters(family, device, dtype)
        except (RuntimeError, NotImplementedError):  # "expected scalar type ... but found Float", no kernel
            return False


def _takes_fp32_parameters(family: str, device: torch.device, dtype: torch.dtype) -> bool:
    x = torch.linspace(-1, 1, 16, device=device).reshape(2, 4, 2).to(dtype).requires_grad_()
    weight = torch.ones(4, device=device, requires_grad=True)
    bias = torch.zeros(4, device=device, requires_grad=True)
    if family == "layer_norm":
        y = F.layer_norm(x, (2,), weight[:2], bias[:2])
    elif family == "group_norm":
        y = F.group_norm(x, 2, weight, bias)
    else:
        y = F.batch_norm(x, torch.zeros(4, device=device), torch.ones(4, device=device), weight, bias, training=True)
    y.float().sum().backward()
    return y.dtype == dtype and x.grad is not None and x.grad.dtype == dtype


def _accumulates_in_fp32(mode: str, dims: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the low-dtype backward equals the FP32 backward rounded once (an FP32 accumulator inside)."""
    size = {1: (1, 1, 8), 2: (1, 1, 8, 8), 3: (1, 1, 4, 4, 4)}[dims]
    scale = {1: 64, 2: 8, 3: 4}[dims]  # each input element collects scale**dims gradients
    interpolate_mode = mode.removesuffix("-aa")
    kwargs = {"antialias": True} if mode.endswith("-aa") else {}
    if interpolate_mode in ("linear", "bilinear", "bicubic", "trilinear"):
        kwargs["align_corners"] = False
    out_size = tuple(s * scale for s in size[2:])
    grad = torch.sin(torch.arange(int(torch.Size(size[:2] + out_size).numel()), device=device, dtype=torch.float32))
    grad = grad.reshape(size[:2] + out_size).to(dtype).float()  # exactly representable in `dtype`
    grads = {}
    for run_dtype in (torch.float32, dtype):
        x = torch.zeros(size, device=device, dtype=run_dtype, requires_grad=True)
        F.interpolate(x, size=out_size, mode=interpolate_mode, **kwargs).backward(grad.to(run_dtype))
        grads[run_dtype] = x.grad.float()
    return rounded_once(grads[dtype], grads[torch.float32], dtype)


def rounded_once(result: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a low-precision `result` is within the error of rounding the FP32 `exact` to `dtype` once: an
    FP32 accumulator inside; one that accumulates in `dtype` rounds at every addition and lands far off."""
    rounding = (exact.to(dtype).float() - exact).norm()
    return bool((result.float() - exact).norm() <= 1.5 * rounding + 1e-6 * exact.norm())
