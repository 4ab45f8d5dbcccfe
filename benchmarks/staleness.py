"""What the never-stale check costs: graphamp's per-call module fingerprint against a training step.

A 12-layer GPT-2-shaped model (GPT2Config(n_layer=12, n_embd=768), built from its config). Reported: the
microseconds of one fingerprint (computed and compared, as every AmpModule call does), and the seconds of one
forward + backward in FP32, torch.autocast and graphamp, each with the fingerprint as a share of it. On a CPU
without native bfloat16 only the FP32 step is timed (low precision would be emulated there, not measured).

    python benchmarks/staleness.py [--batch 4] [--seq 128] [--calls 2000]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import device_name, timed  # noqa: E402

import graphamp  # noqa: E402
from graphamp.runtime.fingerprint import module_fingerprint  # noqa: E402


def fingerprint_us(model, calls: int) -> float:
    """CPU time per call: on a shared machine, wall time would count the other processes' turns too."""
    reference = module_fingerprint(model)
    started = time.process_time()
    for _ in range(calls):
        module_fingerprint(model) == reference  # noqa: B015  (the comparison is part of the per-call cost)
    return (time.process_time() - started) / calls * 1e6


def step_seconds(forward, device: str, repeats: int = 5) -> float:
    def step():
        forward().backward()
    step()  # warm-up: a graphamp capture, cuBLAS handles
    return statistics.median(timed(step, device) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    low_precision_native = device == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, use_cache=False)).to(device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    modules = sum(1 for _ in model.modules())
    tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    cost_us = fingerprint_us(model, args.calls)

    steps = {"fp32": step_seconds(lambda: model(input_ids=ids, labels=ids).loss, device)}
    if low_precision_native:
        def autocast_loss():
            with torch.autocast(device, dtype):
                return model(input_ids=ids, labels=ids).loss
        steps["autocast"] = step_seconds(autocast_loss, device)
        amp = graphamp.rewrite(
            model, (), {"input_ids": ids, "labels": ids}, amp_lists=graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
        )
        steps["graphamp"] = step_seconds(lambda: amp(input_ids=ids, labels=ids).loss, device)

    print(
        f"### Staleness check: {device_name(device)}\n\ntorch {torch.__version__}, {datetime.date.today()}; "
        f"GPT2Config(n_layer=12, n_embd=768): {modules} modules, {tensors} parameters and buffers; "
        f"batch {args.batch} x {args.seq} tokens, bfloat16.\n"
    )
    print(f"Fingerprint, computed and compared: **{cost_us:.0f} µs per call** (CPU time, mean of {args.calls}).\n")
    print("| mode | forward + backward (ms) | ratio to FP32 | fingerprint share of the step |")
    print("|---|---:|---:|---:|")
    for mode, seconds in steps.items():
        print(f"| {mode} | {seconds * 1e3:.1f} | {seconds / steps['fp32']:.2f} | {cost_us / (seconds * 1e6):.3%} |")
    if not low_precision_native:
        print("\nThis CPU has no native bfloat16: autocast and graphamp steps are not timed here.")


if __name__ == "__main__":
    main()
