"""Loss-scaling overhead per train step: in-graph scaling (plain `loss.backward()`) vs the `unscale_()` path.

    python benchmarks/loss_scaling_overhead.py                 # GPT-2-shaped model, eager and compiled
    python benchmarks/loss_scaling_overhead.py --steps 30 --no-compile

Every step clips the gradients (clip_grad_norm_, max_norm 1.0) and steps AdamW, as Trainer and accelerate do:
- fp32: no mixed precision;
- autocast: torch.autocast, with GradScaler (and its unscale_) in float16;
- unscale_ path: `opt.backward(loss); opt.unscale_(); clip; opt.step()`, the optimizer decorated before the model
  is rewritten (so not linked to it: the loss is scaled by backward(loss));
- in-graph: `loss.backward(); clip; opt.step()`, the model rewritten first, so that decorate(model=) links the optimizer
  to it and its graphs scale the gradients.
On a GPU in float16; on a CPU in bfloat16 with dynamic loss scaling forced on (so that there is scaling to pay
for), and only where the CPU runs bfloat16 natively (else timings say nothing about a real run; --anyway runs it
there too, to check the script).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import graphamp  # noqa: E402
from bench_models import build  # noqa: E402
from train_step import device_name, timed  # noqa: E402

MODES = ["fp32", "autocast", "unscale_ path", "in-graph"]


def step_times(mode: str, compiled: bool, dtype: torch.dtype, device: str, steps: int, warmup: int,
               size: str | None = None) -> list[float]:
    torch.manual_seed(0)
    workload = build("gpt2", size or ("gpu" if device == "cuda" else "cpu"), device)
    model, batches = workload.model.to(device), workload.batches
    batches = [({k: v.to(device) for k, v in inputs.items()}, target) for inputs, target in batches]
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if mode.startswith(("unscale", "in-graph")):
        lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
        if mode.startswith("unscale"):  # decorated first: no rewritten model holds its parameters yet, no link
            opt = graphamp.decorate(adamw, lists, use_dynamic_loss_scaling=True)
        net = graphamp.rewrite(model, example_kwargs=batches[0][0], amp_lists=lists, compile=compiled)
        if mode.startswith("in-graph"):  # linked to the rewritten model: the graphs scale the gradients
            opt = graphamp.decorate(adamw, lists, use_dynamic_loss_scaling=True, model=net)
    else:
        net = torch.compile(model) if compiled else model
        opt = adamw
    scaler = torch.amp.GradScaler(device) if mode == "autocast" and dtype == torch.float16 else None

    def one_step(i: int) -> None:
        inputs, target = batches[i % len(batches)]
        if mode == "autocast":
            with torch.autocast(device, dtype=dtype):
                loss = workload.loss(net(**inputs), target)
        else:
            loss = workload.loss(net(**inputs), target)
        if mode == "unscale_ path":
            opt.backward(loss)
            opt.unscale_()
        elif scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if mode in ("unscale_ path", "in-graph"):  # each path is the one it is named after
            assert opt._iteration.scaled_in_graph == (mode == "in-graph"), f"{mode}: the gradients took the other path"
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    return [timed(lambda i=i: one_step(i), device) for i in range(warmup + steps)][warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--size", choices=("gpu", "cpu", "tiny"), help="bench_models.py's sizes (tiny: a check only)")
    parser.add_argument("--anyway", action="store_true",
                        help="run on a CPU without native bfloat16 (to check the script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    if device == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported() and not args.anyway:
        print(f"{device_name(device)} has no native bfloat16: CPU timings would mean nothing; run on a GPU.")
        return
    rows = []
    for compiled in [False] if args.no_compile else [False, True]:
        medians = {m: statistics.median(step_times(m, compiled, dtype, device, args.steps, args.warmup, args.size))
                   for m in MODES}
        for mode in MODES:
            rows.append((("compiled " if compiled else "eager ") + mode, medians[mode],
                         medians[mode] / medians["fp32"], medians[mode] / medians["autocast"],
                         medians[mode] / medians["unscale_ path"]))
    print(f"GPT-2-shaped train step, {str(dtype).removeprefix('torch.')}, on {device_name(device)}; "
          f"torch {torch.__version__}, Python {platform.python_version()}, {datetime.date.today()}; "
          f"median of {args.steps} steps after {args.warmup}")
    print(f"| {'mode':<24} | ms/step | vs fp32 | vs autocast | vs unscale_ path |")
    print(f"|{'-' * 26}|---------|---------|-------------|------------------|")
    for name, seconds, vs_fp32, vs_autocast, vs_unscale in rows:
        print(f"| {name:<24} | {seconds * 1e3:7.1f} | {vs_fp32:7.2f} | {vs_autocast:11.2f} | {vs_unscale:16.2f} |")


if __name__ == "__main__":
    main()
