"""What a diagnosis costs: graphamp.doctor and graphamp.auto_mixed_precision against one FP32 training step.

The GPT-2- and BERT-shaped models of bench_models.py (scaled down on a CPU), one batch. Reported: the seconds
of an FP32 forward + backward (median of 3), of doctor(steps=1) and of auto_mixed_precision(tolerance), each as
a multiple of the FP32 step, with the auto search's run count and what it moved. Never part of the test suite.

    python benchmarks/doctor_cost.py [--dtype bfloat16] [--tolerance 1e-3] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_models  # noqa: E402
from train_step import device_name, timed, write_results  # noqa: E402

import graphamp  # noqa: E402


def measure(name: str, dtype: str, tolerance: float, device: str, size: str | None = None) -> dict:
    torch.manual_seed(0)
    workload = getattr(bench_models, name)(size or ("gpu" if device == "cuda" else "cpu"))
    model = workload.model.to(device)
    inputs, target = workload.batches[0]
    inputs = {k: v.to(device) for k, v in inputs.items()}
    loss_fn = None if target is None else (lambda out: workload.loss(out, target.to(device)))

    def fp32_step():
        loss = workload.loss(model(**inputs), None if target is None else target.to(device))
        loss.backward()
        model.zero_grad(set_to_none=True)

    fp32_step()
    step_s = statistics.median(timed(fp32_step, device) for _ in range(3))
    lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    report = None

    def diagnose():
        nonlocal report
        report = graphamp.doctor(model, (), inputs, amp_lists=lists, loss_fn=loss_fn)

    doctor_s = timed(diagnose, device)
    found = None

    def search():
        nonlocal found
        found = graphamp.auto_mixed_precision(model, (), inputs, tolerance=tolerance, amp_lists=lists, loss_fn=loss_fn)

    auto_s = timed(search, device)
    return {
        "model": name, "nodes": len(report.nodes), "step_s": step_s, "doctor_s": doctor_s, "auto_s": auto_s,
        "runs": found.evaluations, "moved": ", ".join(
            [f"{e}→white" for e in found.moved_to_white] + [f"{e}→black" for e in found.moved_to_black]
        ) or "-", "low": f"{found.start_low_nodes} → {found.low_nodes} of {found.op_nodes}",
        "error": f"{found.start_error:.2g} → {found.error:.2g}",
    }


def table(results: list[dict]) -> str:
    rows = [
        "| model | op nodes | FP32 step s | doctor s | × step | auto s | × step | auto runs | ops low | loss error | moved |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['model']} | {r['nodes']} | {r['step_s']:.3f} | {r['doctor_s']:.2f} | {r['doctor_s'] / r['step_s']:.0f}× "
            f"| {r['auto_s']:.2f} | {r['auto_s'] / r['step_s']:.0f}× | {r['runs']} | {r['low']} | {r['error']} | {r['moved']} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=bench_models.SIZES, help="bench_models.py's sizes (tiny: a check only)")
    parser.add_argument("--results", type=Path, help="write the table into this markdown file")
    args = parser.parse_args()
    results = [measure(name, args.dtype, args.tolerance, args.device, args.size) for name in args.models.split(",")]
    heading = (
        f"doctor and auto_mixed_precision ({args.dtype}, tolerance {args.tolerance:g}) on {device_name(args.device)}, "
        f"torch {torch.__version__}, {datetime.date.today()}"
    )
    block = f"{heading}\n\n{table(results)}"
    print(block)
    if args.results:
        write_results(args.results, f"doctor {args.device} {args.dtype}", block)


if __name__ == "__main__":
    main()
