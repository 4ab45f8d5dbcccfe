"""Where a train step's time goes: torch.profiler's op times grouped into casts, optimizer, loss scaling, other.

Each op's *self* time (device time on a GPU: the kernels it launched itself; CPU time on a CPU) goes to the
group of its nearest enclosing op or range that names one:

- casts: `aten::_to_copy` (autocast's casts, and graphamp's in its graphs run as fx code);
- loss scaling: `aten::_amp_*` (inf/NaN check, unscale, scale update) and the `LOSS_SCALING` range around the
  benchmark's scaler step and update, less the optimizer inside it;
- optimizer: torch's `Optimizer.step#...` ranges;
- other: the rest (forward and backward math, inductor's fused kernels, which hide the casts they fuse: in the
  compiled modes casts ms is what inductor left as kernels of their own).

`busy` is the device's summed kernel time over the wall time of the profiled steps: what is not busy is launch
overhead and host syncs (the device waiting for Python).
"""

from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

LOSS_SCALING = "benchmark: loss scaling"
GROUPS = ("casts", "optimizer", "loss scaling", "other")
_CAST_OPS = ("aten::_to_copy",)


def group_of(name: str) -> str | None:
    """The group an op or range names, or None when it names none (its parent decides)."""
    if name in _CAST_OPS:
        return "casts"
    if name.startswith("aten::_amp_") or name == LOSS_SCALING:
        return "loss scaling"
    if name.startswith("Optimizer.step#"):
        return "optimizer"
    return None


def _self_time_us(event, device: str) -> float:
    if device == "cuda":
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
    return event.self_cpu_time_total


def profile_steps(step, device: str, steps: int = 5, trace_path: str | None = None) -> dict:
    """Run `step` `steps` times under torch.profiler; milliseconds per step in each group, and `busy`.

    Args:
        step: one train step (forward, backward, optimizer and scaler), already warm.
        device: "cuda" or "cpu".
        steps: steps profiled; the figures are per step.
        trace_path: also write a Chrome trace (chrome://tracing, Perfetto) here.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as profiler:
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - started) * 1e6
    if trace_path:
        profiler.export_chrome_trace(trace_path)
    totals = dict.fromkeys(GROUPS, 0.0)
    for event in profiler.events():
        if event.device_type != DeviceType.CPU:
            continue  # kernels are counted through the op that launched them
        totals[_group_of_event(event)] += _self_time_us(event, device)
    result = {group: us / steps / 1e3 for group, us in totals.items()}
    result["busy"] = sum(totals.values()) / wall_us if device == "cuda" else None
    result["wall_ms"] = wall_us / steps / 1e3
    return result


def _group_of_event(event) -> str:
    while event is not None:
        group = group_of(event.name)
        if group is not None:
            return group
        event = event.cpu_parent
    return "other"


def loss_scaling_range():
    """The range the benchmark puts around its scaler step and update (the optimizer inside keeps its own)."""
    return record_function(LOSS_SCALING)


def table(results: list[dict]) -> str:
    """Markdown: per (model, mode), milliseconds per step in each group, their shares, and the device's busy time."""
    rows = [
        "| model | mode | step ms | casts ms | optimizer ms | loss scaling ms | other ms | device busy |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        p = r.get("profile")
        if not p:
            continue
        busy = f"{100 * p['busy']:.0f}%" if p.get("busy") is not None else "n/a (CPU)"
        rows.append(
            f"| {r['model']} | {r['mode']} | {p['wall_ms']:.2f} | "
            + " | ".join(f"{p[g]:.2f}" for g in GROUPS)
            + f" | {busy} |"
        )
    return "\n".join(rows)
