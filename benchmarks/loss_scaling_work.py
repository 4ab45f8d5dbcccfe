"""The gradient work each loss-scaling path adds to a train step, alone: in-graph scaling vs the `unscale_()` path.

    PYTHONPATH=$PWD python benchmarks/loss_scaling_work.py [--model gpt2|bert|resnet50] [--repeats 7]

Both paths leave the same FP32 gradients; what differs is the work over them after the backward pass proper:
- `unscale_()` path: the backward runs on a scaled loss and leaves scaled gradients; `unscale_()` divides them in
  place and checks them for inf/NaN in one fused kernel (`_amp_foreach_non_finite_check_and_unscale_`);
- in-graph scaling: the graph's gradient node divides the outgoing gradients by the scale
  (`_UnscaleGradients`'s backward, through autograd), and `step()` checks the resulting `.grad` for inf/NaN.
This times the backward from the low-precision weight copies into the master weights (the cast's backward, which
both paths run) plus that work, on the model's full-size (GPU) parameter shapes: memory-bound elementwise work
with no GEMM, so it can be timed on a CPU without native bfloat16. The whole step's overhead (eager and compiled)
is loss_scaling_overhead.py's, on a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_models import build  # noqa: E402
from graphamp.training.in_graph_scaling import unscale_gradients  # noqa: E402
from graphamp.training.loss_scaler import LossScaler  # noqa: E402
from train_step import device_name  # noqa: E402


def synchronized(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def backward_through_the_weight_casts(shapes, device, scaler: LossScaler, in_graph: bool) -> float:
    """One backward from the low-precision weight copies into the FP32 master weights, then the path's work.

    The graph's backward hands each master weight its gradient through the cast of the weight (ToCopyBackward):
    a fresh FP32 tensor, which AccumulateGrad takes as `.grad`. Both paths pay that; in-graph scaling adds its
    node between the cast and AccumulateGrad, the `unscale_()` path its fused kernel after the backward."""
    leaves = [torch.zeros(s, device=device, requires_grad=True) for s in shapes]  # the master weights
    inputs = unscale_gradients(scaler.loss_scaling.double().reciprocal().float(), leaves) if in_graph else leaves
    low_copies = [w.to(torch.bfloat16) for w in inputs]
    grads = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]  # scaled, as the GEMMs give them
    synchronized(device)
    start = time.perf_counter()
    torch.autograd.backward(low_copies, grads)
    if in_graph:
        scaler.check_finite([leaf.grad for leaf in leaves])  # step()'s check
    else:
        scaler.unscale_([leaf.grad for leaf in leaves])
    synchronized(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "bert", "resnet50"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [tuple(p.shape) for p in build(args.model, "gpu", "cpu").model.parameters()]
    numel = sum(torch.Size(s).numel() for s in shapes)
    scaler = LossScaler(init_loss_scaling=2.0**15)
    scaler.state_on(torch.device(device))
    times = {"unscale_ path": [], "in-graph": []}
    for _ in range(args.repeats + 1):  # the first round warms the allocator up and is dropped
        for mode in times:
            times[mode].append(backward_through_the_weight_casts(shapes, device, scaler, mode == "in-graph"))
    medians = {mode: statistics.median(values[1:]) for mode, values in times.items()}
    print(f"{args.model} (full size: {len(shapes)} tensors, {numel / 1e6:.1f} M parameters, FP32 gradients) on "
          f"{device_name(device)}; torch {torch.__version__}, Python {platform.python_version()}, "
          f"{datetime.date.today()}; median of {args.repeats} rounds")
    print("| path | ms / step (weight-cast backward + scaling work) | vs unscale_ path |")
    print("|---|---:|---:|")
    for mode, seconds in medians.items():
        print(f"| {mode} | {seconds * 1e3:.1f} | {seconds / medians['unscale_ path']:.2f}× |")


if __name__ == "__main__":
    main()
