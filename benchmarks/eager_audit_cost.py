"""What graphamp's eager-seam audit costs: a watched forward against a normal one and against eager autocast.

    PYTHONPATH=. python benchmarks/eager_audit_cost.py                          # tiny GPT-2 and Llama, table on stdout
    PYTHONPATH=. python benchmarks/eager_audit_cost.py --calls 50 --results benchmarks/results/eager_audit_cost.md

After each new compile, the next call of a rewritten model runs under sys.setprofile
(graphamp/frontends/eager_audit.py): a profile function sees every Python and C call of that forward and notes
white-list ops run outside graphamp's graphs. Every other call pays nothing. For the tests' tiny GPT-2 and Llama
(tests/models.py, float32 weights, bfloat16 lists, forward with labels so the loss is inside) this times, each the
median of --calls calls taken in turn: (a) a normal call of the rewritten model, (b) a watched call
(`model._graphamp.audit.due = True` before it, as after a compile), (c) the same weights under eager torch.autocast.
Forward only: the audit watches the model's call, not the backward. --graphs fx (the default) is
rewrite(compile=False): the graphs run as fx code, one Python call per ATen op, the most the profile function
sees; --graphs inductor is rewrite(compile=True), inductor's code; --graphs fx,inductor both.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import graphamp  # noqa: E402
from models import VOCAB, gpt2, llama  # noqa: E402

MODELS = {"GPT-2 (tests/models.py)": gpt2, "Llama (tests/models.py)": llama}
CALLS = ("normal", "watched", "autocast")


def timed(call, device: str) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    if device == "cuda":
        torch.cuda.synchronize()
    started, cpu_started = time.perf_counter(), time.process_time()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, time.process_time() - cpu_started


def measure(build, lists, device: str, calls: int, batch: int, seq: int, compiled: bool) -> dict:
    """Median milliseconds of each kind of call, the graphs compiled, and the ops the audit reported."""
    torch.manual_seed(0)
    model = build().to(device).train()
    reference = copy.deepcopy(model)  # autocast's copy, made before rewrite() converts `model` in place
    ids = torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    inputs = {"input_ids": ids, "labels": ids}
    graphamp.rewrite(model, example_kwargs=inputs, amp_lists=lists, compile=compiled)
    audit = model._graphamp.audit

    def normal():
        model(**inputs)

    def watched():
        audit.due = True  # what a new compile leaves behind
        model(**inputs)
        assert not audit.due, "the call was not watched"

    def autocast():
        with torch.autocast(device, lists.dtype):
            reference(**inputs)

    runs = {"normal": normal, "watched": watched, "autocast": autocast}
    for _ in range(3):  # warm-up: the first call after rewrite()'s compile ahead is itself a watched one
        for run in runs.values():
            run()
    times = {name: [] for name in runs}
    for i in range(calls):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(timed(runs[name], device))
    graphs = len(graphamp.rewritten_graphs(model))
    return {
        "ms": {name: 1e3 * statistics.median(wall for wall, _ in t) for name, t in times.items()},
        "cpu_ms": {name: 1e3 * statistics.median(cpu for _, cpu in t) for name, t in times.items()},
        "graphs": graphs, "reported": sorted(audit.reported),
    }


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        name = "unknown CPU"
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    native = [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags]
    bf16 = (f"native bfloat16 ({', '.join(native)})" if native
            else "no native bfloat16 (no avx512_bf16/amx_bf16: emulated)")
    return f"{name}, {len(os.sched_getaffinity(0))} cores, {bf16}"


def table(results: dict, key: str) -> str:
    """key: "ms" (wall time) or "cpu_ms" (this process's CPU time: on a shared CPU, not others' turns)."""
    rows = [
        "| model | graphs run as | (a) normal ms | (b) watched ms | (c) autocast eager ms | watched / normal | "
        "watched / autocast | normal / autocast | graphs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (name, kind), r in results.items():
        a, b, c = (r[key][k] for k in CALLS)
        rows.append(f"| {name} | {kind} | {a:.2f} | {b:.2f} | {c:.2f} | {b / a:.2f}× | {b / c:.2f}× | "
                    f"{a / c:.2f}× | {r['graphs']} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30, help="timed calls of each kind (the median is reported)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CPU, float16 on CUDA")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--graphs", default="fx", help="fx (rewrite(compile=False)), inductor (compile=True), or both: "
                        "fx,inductor")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (1: steadier when shared)")
    parser.add_argument("--results", type=Path, help="write the table and its settings to this Markdown file")
    args = parser.parse_args()
    if sys.getprofile() is not None:
        parser.error("a profiler or debugger holds sys.setprofile: the audit would step aside; run without it.")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float16" if args.device == "cuda" else "bfloat16")
    lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    kinds = args.graphs.split(",")
    results = {
        (name, kind): measure(build, lists, args.device, args.calls, args.batch, args.seq, kind == "inductor")
        for kind in kinds for name, build in MODELS.items()
    }
    device = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    threads = f", {args.threads} torch thread(s)" if args.device == "cpu" else ""
    settings = (
        f"{device}{threads}; torch {torch.__version__}, graphamp {graphamp.__version__}, {datetime.date.today()}. "
        f"{dtype} lists, graphs run as {' and as '.join(kinds)} (rewrite(compile=False / True)), train mode, batch "
        f"{args.batch} x {args.seq} tokens with "
        f"labels; forward only, median of {args.calls} calls of each kind, taken in turn (order alternating)."
    )
    how_often = (
        "How often (b) happens: once after each new compile, that is, after each call that made dynamo compile "
        "(the graphs column: a graph break makes two): the first call after rewrite()'s compile ahead, then once "
        "after each recompile (a new shape while sizes are static, train/eval, a changed Python argument). A "
        "training run of fixed shapes is watched once; every other call is (a)."
    )
    reported = {f"{name}, {kind}": r["reported"] for (name, kind), r in results.items() if r["reported"]}
    found = f"\n\nOps the audit reported (ran outside the graphs): {reported}" if reported else ""
    tables = f"Wall time:\n\n{table(results, 'ms')}"
    if args.device == "cpu":  # CUDA's CPU time leaves out the device's; on a shared CPU, wall time counts others' turns
        tables = f"This process's CPU time:\n\n{table(results, 'cpu_ms')}\n\n{tables}"
    text = f"{settings}\n\n{tables}\n\n{how_often}{found}"
    print(text)
    if args.results:
        command = " ".join(["python benchmarks/eager_audit_cost.py", *sys.argv[1:]])
        args.results.write_text(
            "# What the eager-seam audit costs (graphamp/frontends/eager_audit.py)\n\n"
            f"`PYTHONPATH=. {command}`\n\n{text}\n",
            encoding="utf-8",
        )


if __name__ == "__main__":
    main()
