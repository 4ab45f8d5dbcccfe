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

Run as a script, it diffs two modes' steps op by op (interleaved_step.py's setup: the same weights, batches, AdamW):

    PYTHONPATH=. python benchmarks/step_profile.py --diff --model llama              # default path vs eager autocast
    PYTHONPATH=. python benchmarks/step_profile.py --diff --model llama --compiled   # vs autocast+compile

per op name, per step: calls, self time (the lowest of the rounds: a shared machine's noise only adds) and bytes
allocated (the positive allocations made while the op was the innermost one running). Compiled, inductor's C++
kernels are profiled one by one (`cpp.enable_kernel_profile`) and named without their graph's number, so that the
two modes' kernels pair up. Calls and bytes do not move from round to round: they are the figures to read.
"""

from __future__ import annotations

import argparse
import collections
import re
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


# -- per-op diff of two modes' steps -------------------------------------------------------------------------------

def op_totals(step, steps: int = 1) -> dict[str, list]:
    """Profile `step` `steps` times (CPU); per op name, per step: [calls, self CPU µs, bytes allocated]."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        for _ in range(steps):
            step()
    events = [e for e in profiler.events() if e.device_type == DeviceType.CPU]
    totals = collections.defaultdict(lambda: [0, 0.0, 0])
    for event in events:
        row = totals[_paired_name(event.name)]
        row[0] += 1
        row[1] += event.self_cpu_time_total
    for name, nbytes in _allocations_by_op(profiler, events).items():
        totals[_paired_name(name)][2] += nbytes
    return {name: [calls / steps, us / steps, nbytes / steps] for name, (calls, us, nbytes) in totals.items()}


def _allocations_by_op(profiler, events) -> collections.Counter:
    """Bytes of each positive allocation, given to the innermost op running on its thread when it was made."""
    results = profiler.profiler.kineto_results
    start_ns = results.trace_start_ns()
    by_thread = collections.defaultdict(lambda: ([], []))
    for event in events:
        by_thread[event.thread][0].append(event)
    for record in results.events():
        if record.name() == "[memory]" and record.nbytes() > 0:
            by_thread[record.start_thread_id()][1].append(((record.start_ns() - start_ns) / 1e3, record.nbytes()))
    allocated = collections.Counter()
    for ops, records in by_thread.values():
        ops.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        records.sort()
        open_ops, i = [], 0
        for op in ops + [None]:
            until = op.time_range.start if op is not None else float("inf")
            while i < len(records) and records[i][0] < until:
                at, nbytes = records[i]
                while open_ops and open_ops[-1].time_range.end < at:
                    open_ops.pop()
                allocated[open_ops[-1].name if open_ops else "(no op)"] += nbytes
                i += 1
            if op is not None:
                while open_ops and open_ops[-1].time_range.end < op.time_range.start:
                    open_ops.pop()
                open_ops.append(op)
    return allocated


def _paired_name(name: str) -> str:
    """An op's name without what differs between two compiles of one model (graph numbers, hashes, frame ids)."""
    name = re.sub(r"^graph_\d+_", "graph_N_", name)
    name = re.sub(r"CompiledFxGraph \w+", "CompiledFxGraph <hash>", name)
    return re.sub(r"Torch-Compiled Region: \d+/\d+", "Torch-Compiled Region", name)


def diff_tables(rounds: dict[str, list[dict]], top: int = 25) -> str:
    """Markdown: the two modes' per-op calls, allocated MiB and self ms per step, where they differ most."""
    (a, a_rounds), (b, b_rounds) = rounds.items()
    names = sorted(set().union(*a_rounds, *b_rounds))
    zero = [0, 0.0, 0]

    def row(runs, name):  # calls and bytes of the last round, self time the lowest of the rounds
        last = runs[-1].get(name, zero)
        return last[0], min(r.get(name, zero)[1] for r in runs) / 1e3, last[2] / 2**20

    rows = [(name, row(a_rounds, name), row(b_rounds, name)) for name in names]
    total = [sum(r[k][i] for r in rows) for k in (1, 2) for i in (1, 2)]
    out = [f"per step: {a} {total[0]:.1f} ms of op self time, {total[1]:.1f} MiB allocated; "
           f"{b} {total[2]:.1f} ms, {total[3]:.1f} MiB", "",
           f"| op | {a} calls | {b} calls | {b} − {a} |", "|---|---:|---:|---:|"]
    for name, x, y in sorted(rows, key=lambda r: -abs(r[2][0] - r[1][0])):
        if x[0] != y[0]:
            out.append(f"| {name[:100]} | {x[0]:g} | {y[0]:g} | {y[0] - x[0]:+g} |")
    out += ["", f"| op | {a} MiB | {b} MiB | {b} − {a} |", "|---|---:|---:|---:|"]
    for name, x, y in sorted(rows, key=lambda r: -abs(r[2][2] - r[1][2]))[:top]:
        if abs(y[2] - x[2]) >= 0.005:
            out.append(f"| {name[:100]} | {x[2]:.2f} | {y[2]:.2f} | {y[2] - x[2]:+.2f} |")
    out += ["", f"| op | {a} calls | {a} self ms | {b} calls | {b} self ms | {b} − {a} ms |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, x, y in sorted(rows, key=lambda r: -abs(r[2][1] - r[1][1]))[:top]:
        out.append(f"| {name[:100]} | {x[0]:g} | {x[1]:.2f} | {y[0]:g} | {y[1]:.2f} | {y[1] - x[1]:+.2f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--diff", action="store_true", help="diff two modes' steps op by op (the only mode)")
    parser.add_argument("--model", default="llama")
    parser.add_argument("--size", choices=("gpu", "cpu", "tiny"), help="bench_models.py's sizes")
    parser.add_argument("--compiled", action="store_true", help="rewrite(compile=True) against autocast+compile")
    parser.add_argument("--modes", default="autocast,graphamp", help="two of interleaved_step.py's modes")
    parser.add_argument("--rounds", type=int, default=4, help="profiled steps per mode, alternating")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if not args.diff:
        parser.error("run as a script, step_profile.py only diffs: pass --diff")
    from interleaved_step import steps_for  # imported late: it imports graphamp and the models

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.compiled:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # each C++ kernel a profiler event of its own
    modes = args.modes.split(",")
    steps = {mode: step for mode, step in steps_for(args.model, args.compiled, device, args.size).items()
             if mode in modes}
    for step in steps.values():
        for _ in range(3):  # the first compiles
            step()
    rounds = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes if round_ % 2 == 0 else reversed(modes):
            rounds[mode].append(op_totals(steps[mode]))
    print(f"{args.model}, {'compiled' if args.compiled else 'eager'}, {device}; {args.rounds} profiled steps per mode\n")
    print(diff_tables(rounds, args.top))


if __name__ == "__main__":
    main()
