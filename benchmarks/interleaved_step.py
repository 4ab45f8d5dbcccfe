"""FP32, torch.autocast and graphamp train steps interleaved in one process: the speed ratio without the
process-to-process spread. Eager rows also time graphamp.auto_cast (the lists as an eager policy, no compile).

    PYTHONPATH=. python benchmarks/interleaved_step.py                       # GPT-2, BERT, ResNet-50; eager and compiled
    PYTHONPATH=. python benchmarks/interleaved_step.py --models gpt2 --compiled-only --rounds 20

benchmarks/train_step.py runs each mode in a child process of its own, so that its peak memory is its own; on the
2-core CPU used so far the same mode moved by up to 10-20% from one process to the next (memory placement), more
than the differences measured. Here the three modes train copies of one model in one process, a few steps each in
turn (the order alternating every round), and the median step time of each mode is compared: wall time and the
process's CPU time. graphamp is graphamp.rewrite(copy, compile=...) of its copy; the compiled FP32 and autocast
copies are torch.compile'd. Memory is not measured here (train_step.py does that). Sizes from bench_models.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import itertools
import statistics
import time

import torch

import graphamp
from bench_models import build
from train_step import device_name

MODES = ("fp32", "autocast", "graphamp")
EAGER_ONLY_MODES = ("auto_cast",)


def steps_for(model_name: str, compiled: bool, device: str, size: str | None = None,
              hf_defaults: bool = False) -> dict:
    """One train-step function per mode, each on its own copy of the same weights."""
    torch.manual_seed(0)
    workload = build(model_name, size or ("gpu" if device == "cuda" else "cpu"), device, hf_defaults)
    low = torch.bfloat16
    steps = {}
    for mode in MODES + (() if compiled else EAGER_ONLY_MODES):
        model = copy.deepcopy(workload.model)  # before any rewrite: a copy of a rewritten model is rewritten too
        if mode == "auto_cast":
            lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
            steps[mode] = _step(workload, model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                lambda model=model, lists=lists: graphamp.auto_cast(lists, model=model))
            continue
        if mode == "graphamp":
            net = graphamp.rewrite(
                model, example_kwargs=workload.batches[0][0], compile=compiled,
                amp_lists=graphamp.AutoMixedPrecisionLists(dtype="bfloat16"),
            )
        else:
            net = torch.compile(model) if compiled else model
        autocast = (lambda: torch.autocast(device, low)) if mode == "autocast" else contextlib.nullcontext
        steps[mode] = _step(workload, net, torch.optim.AdamW(model.parameters(), lr=1e-4), autocast)
    return steps


def _step(workload, net, optimizer, autocast):
    next_batch = itertools.cycle(workload.batches).__next__

    def step():
        inputs, target = next_batch()
        with autocast():
            loss = workload.loss(net(**inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(steps: dict, rounds: int, per_round: int, device: str) -> dict:
    for step in steps.values():
        for _ in range(3):  # the first compiles
            step()
    wall = {mode: [] for mode in steps}
    cpu = {mode: [] for mode in steps}
    for round_ in range(rounds):
        order = list(steps) if round_ % 2 == 0 else list(reversed(steps))
        for mode in order:
            _sync(device)
            started, started_cpu = time.perf_counter(), time.process_time()
            for _ in range(per_round):
                steps[mode]()
            _sync(device)
            wall[mode].append((time.perf_counter() - started) / per_round)
            cpu[mode].append((time.process_time() - started_cpu) / per_round)
    return {mode: (statistics.median(wall[mode]), statistics.median(cpu[mode]), wall[mode]) for mode in steps}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,bert,resnet50")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    parser.add_argument("--compiled-only", action="store_true")
    parser.add_argument("--eager-only", action="store_true")
    parser.add_argument("--hf-defaults", action="store_true", help="HF's default dropout and KV cache (bench_models.py)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=("gpu", "cpu", "tiny"), help="bench_models.py's sizes (tiny: a check only)")
    args = parser.parse_args()
    kinds = [False] * (not args.compiled_only) + [True] * (not args.eager_only)
    print(f"{device_name(args.device)}, torch {torch.__version__}, {datetime.date.today()}; bfloat16; median of "
          f"{args.rounds} interleaved rounds of {args.steps} steps per mode\n")
    print("| model | mode | FP32 ms | autocast ms | graphamp ms | graphamp × autocast speed (wall; rounds' range) "
          "| (CPU time) "
          "| auto_cast ms | auto_cast × autocast speed (wall; rounds' range) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model_name in args.models.split(","):
        for compiled in kinds:
            steps = steps_for(model_name, compiled, args.device, args.size, args.hf_defaults)
            t = measure(steps, args.rounds, args.steps, args.device)
            (fp32, _, _), (autocast, autocast_cpu, autocast_rounds), (amp, amp_cpu, amp_rounds) = (
                t[mode] for mode in MODES
            )
            amp_ratios = [a / b for a, b in zip(autocast_rounds, amp_rounds)]  # the same round's pair
            eager_policy = ["", ""]
            if "auto_cast" in t:
                ratios = [a / b for a, b in zip(autocast_rounds, t["auto_cast"][2])]  # the same round's pair
                eager_policy = [f"{1e3 * t['auto_cast'][0]:.1f}", f"{statistics.median(ratios):.3f}× "
                                f"({min(ratios):.2f}-{max(ratios):.2f})"]
            print(f"| {model_name} | {'compiled' if compiled else 'eager'} | {1e3 * fp32:.1f} | {1e3 * autocast:.1f} | "
                  f"{1e3 * amp:.1f} | {autocast / amp:.3f}× ({min(amp_ratios):.2f}-{max(amp_ratios):.2f}) | "
                  f"{autocast_cpu / amp_cpu:.3f}× | "
                  + " | ".join(eager_policy) + " |", flush=True)


if __name__ == "__main__":
    main()
