"""Weight cache benchmark: casts executed per optimizer step with N micro-batches, and what the copies cost.

    python benchmarks/weight_cache.py                         # the three models, N = 1 and 4, a table on stdout
    python benchmarks/weight_cache.py --models gpt2 --micro-batches 1,2,8

Casts are counted by graphamp.inspection.recording.DtypeRecorder over a steady step (the second one: forward and
backward N times, then AdamW's step), for torch.autocast, graphamp without its weight cache and graphamp with it.
Counts do not depend on the device, so this runs on a CPU (the models scaled down, bench_models.py); the memory
of the copies is given for those models and for the full-size ones (the same parameters, counted on the meta
device). `--time` also times a train step with and without the cache (eager and compiled, rounds interleaved,
median): on a CPU with native bfloat16 (AVX512-BF16) the figures are real; the GPU commands are in GPU_RUNBOOK.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import re
import statistics
import sys
import time
from pathlib import Path

import torch

MODELS = ["gpt2", "bert", "resnet50"]


def casts_per_step(model_name: str, mode: str, micro_batches: int) -> tuple[int, object]:
    """Casts of the second step; the rewritten module too (None for autocast), for its weight cache."""
    import graphamp
    from bench_models import build
    from graphamp.inspection.recording import DtypeRecorder

    torch.manual_seed(0)
    workload = build(model_name, "cpu", "cpu")
    model, (inputs, target) = workload.model, _small(*workload.batches[0])
    amp_model, autocast = None, contextlib.nullcontext
    if mode == "autocast":
        net, autocast = model, (lambda: torch.autocast("cpu", torch.bfloat16))
    else:
        lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
        net = amp_model = graphamp.rewrite(model, example_kwargs=inputs, amp_lists=lists, weight_cache=mode == "cache")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    counts = []
    for _ in range(2):
        with DtypeRecorder() as recorder:
            for _ in range(micro_batches):
                with autocast():
                    loss = workload.loss(net(**inputs), target)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        counts.append(recorder.casts)
    return counts[-1], amp_model


def _small(inputs: dict, target):
    """Two items of at most 32 tokens: the casts do not depend on the batch, and the CPU steps go faster."""
    def cut(t):
        return (t[:2, :32] if t.dim() == 2 else t[:2]).contiguous()

    return {k: cut(v) for k, v in inputs.items()}, None if target is None else target[:2]


def full_size_cache_bytes(model_name: str, amp_model) -> tuple[int, int]:
    """(bytes of the copies, bytes of the FP32 master weights) for the full-size model, on the meta device.

    The cached parameters are matched by name with the layer numbers wildcarded: same architecture, more layers.
    """
    from bench_models import build

    captured = amp_model.captures[-1]
    fqns = list(captured.parameter_placeholders.values())
    cached = {_role(fqns[index]) for index, _ in captured.fed_weights}
    with torch.device("meta"):
        model = build(model_name, "gpu", "meta").model
    cache_bytes, master_bytes = 0, 0
    for name, parameter in model.named_parameters():  # tied weights are listed once
        master_bytes += parameter.numel() * 4
        cache_bytes += parameter.numel() * 2 if _role(name) in cached else 0
    return cache_bytes, master_bytes


def _role(fqn: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", fqn)


def step_seconds(model_name: str, micro_batches: int, compile: bool, rounds: int = 3, steps: int = 4) -> dict:
    """Median seconds per optimizer step of graphamp with and without its cache, timed in interleaved rounds."""
    import copy

    import graphamp
    from bench_models import build

    torch.manual_seed(0)
    workload = build(model_name, "cpu", "cpu")
    inputs, target = workload.batches[0]
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
    runs = {}
    for cache in (False, True):
        model = copy.deepcopy(workload.model)
        amp_model = graphamp.rewrite(
            model, example_kwargs=inputs, amp_lists=lists, weight_cache=cache, compile=compile, progress=False
        )
        runs[cache] = (amp_model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(cache):
        amp_model, optimizer = runs[cache]
        for _ in range(micro_batches):
            workload.loss(amp_model(**inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for cache in runs:  # warm-up: captures, compiles, optimizer state
        step(cache)
        step(cache)
    times = {cache: [] for cache in runs}
    for _ in range(rounds):
        for cache in runs:
            start = time.perf_counter()
            for _ in range(steps):
                step(cache)
            times[cache].append((time.perf_counter() - start) / steps)
    return {cache: statistics.median(t) for cache, t in times.items()}


def print_step_times(models: list[str], micro_batches: list[int]) -> None:
    print(
        "\n| model | N | compiled | no cache s/step | cache s/step | no cache / cache (>1: the cache is faster) |"
        "\n|---|---:|---|---:|---:|---:|"
    )
    for model_name in models:
        for n in micro_batches:
            for compile in (False, True):
                print(f"  timing {model_name} N={n} compile={compile} ...", file=sys.stderr, flush=True)
                t = step_seconds(model_name, n, compile)
                print(
                    f"| {model_name} | {n} | {'yes' if compile else 'no'} | {t[False]:.3f} | {t[True]:.3f} "
                    f"| {t[False] / t[True]:.2f}× |", flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--micro-batches", default="1,4", help="comma-separated N")
    parser.add_argument("--time", action="store_true", help="only time steps with and without the cache")
    args = parser.parse_args()
    if args.time:
        print(f"weight cache step time, bfloat16, {_cpu_name()}, torch {torch.__version__}, "
              f"{datetime.date.today().isoformat()}")
        print_step_times(args.models.split(","), [int(n) for n in args.micro_batches.split(",")])
        return
    import transformers

    print(
        f"weight cache, bfloat16, counted on {_cpu_name()} (counts do not depend on the device); "
        f"torch {torch.__version__}, transformers {transformers.__version__}, {datetime.date.today().isoformat()}\n"
    )
    rows = [
        "| model | N | autocast casts | graphamp, no cache | graphamp, cache | cache / no cache | cache / autocast "
        "| weights cast |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    memory = {}
    for model_name in args.models.split(","):
        for n in map(int, args.micro_batches.split(",")):
            print(f"  {model_name} N={n} ...", file=sys.stderr, flush=True)
            autocast, _ = casts_per_step(model_name, "autocast", n)
            uncached, _ = casts_per_step(model_name, "no cache", n)
            cached, amp_model = casts_per_step(model_name, "cache", n)
            weights = len(amp_model.captures[-1].fed_weights)
            rows.append(
                f"| {model_name} | {n} | {autocast} | {uncached} | {cached} | {cached / uncached:.2f}× "
                f"| {cached / autocast:.2f}× | {weights} |"
            )
            params = sum(p.numel() * 4 for p in amp_model.original_module.parameters())
            memory[model_name] = (amp_model.weight_cache.nbytes, params, *full_size_cache_bytes(model_name, amp_model))
    print("\n".join(rows))
    print(
        "\n| model | copies MiB (CPU size) | FP32 weights MiB (CPU size) | copies MiB (full size) "
        "| FP32 weights MiB (full size) | copies / weights |\n|---|---:|---:|---:|---:|---:|"
    )
    for model_name, (cache, params, full_cache, full_params) in memory.items():
        mib = 2**20
        print(
            f"| {model_name} | {cache / mib:.1f} | {params / mib:.1f} | {full_cache / mib:.1f} | "
            f"{full_params / mib:.1f} | {full_cache / full_params:.2f} |"
        )


def _cpu_name() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    match = re.search(r"model name\s*:\s*(.+)", text)
    return match.group(1).strip() if match else "this CPU"


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]  # bench_models beside this file; this checkout's graphamp
    main()
