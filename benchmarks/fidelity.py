"""Casts executed per training step (forward + backward) by graphamp and by torch.autocast, and both runs'
errors against FP32, on tiny CNN / ViT / encoder models from transformers configs (tests/encoder_models.py).

    PYTHONPATH=$PWD python benchmarks/fidelity.py [--dtype bfloat16] [--train]

Eval mode by default. --train counts in train mode (dropout, stochastic depth), with the RNG seeded the same
before each of the three runs, so that they draw the same masks. graphamp: the model converted in place by
graphamp.rewrite(compile=False) after the FP32 and autocast runs; its casts are counted in what its graphs run
(recorded_casts.py).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import graphamp  # noqa: E402
from encoder_models import ENCODERS  # noqa: E402
from recorded_casts import recording  # noqa: E402


def relative_error(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def step(model, batch):
    """Casts executed by one forward+backward, and the logits."""
    torch.manual_seed(1)  # the same dropout masks in every run
    with recording(model) as recorder:
        logits = model(**batch).logits
        logits.float().pow(2).mean().backward()
    return recorder.casts, logits.detach()


def measure(name, dtype, train=False):
    torch.manual_seed(0)
    model, batch = ENCODERS[name]()
    model.train(train)
    lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    model.zero_grad()
    _, reference = step(model, batch)
    fp32_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    with torch.autocast("cpu", dtype=lists.dtype):
        autocast_casts, autocast_out = step(model, batch)
    autocast_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    graphamp.rewrite(model, (), batch, amp_lists=lists)  # in place; compiled ahead on the batch
    amp_casts, amp_out = step(model, batch)
    amp_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    # over all gradients at once: single tiny gradients (a bias near zero) would dominate a per-tensor maximum
    flat = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
    grad_error = lambda grads: relative_error(flat(grads), flat(fp32_grads))  # noqa: E731
    return {
        "model": name, "graphamp casts": amp_casts, "autocast casts": autocast_casts,
        "graphamp out err": relative_error(amp_out, reference), "autocast out err": relative_error(autocast_out, reference),
        "graphamp grad err": grad_error(amp_grads), "autocast grad err": grad_error(autocast_grads),
    }


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--train", action="store_true", help="train mode (dropout, stochastic depth)")
    parser.add_argument("models", nargs="*", default=list(ENCODERS))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"casts per step and errors vs FP32, {args.dtype}, {'train' if args.train else 'eval'} mode, CPU, torch {torch.__version__}, "
          f"{_cpu_name()}, native bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}, {datetime.date.today()}")
    header = ("model", "graphamp casts", "autocast casts", "ratio", "graphamp out err", "autocast out err",
              "graphamp grad err", "autocast grad err")
    print(" | ".join(header))
    for name in args.models:
        row = measure(name, args.dtype, args.train)
        ratio = row["graphamp casts"] / max(row["autocast casts"], 1)
        print(" | ".join([name, str(row["graphamp casts"]), str(row["autocast casts"]), f"{ratio:.2f}",
                          *(f"{row[k]:.2e}" for k in header[4:])]))


if __name__ == "__main__":
    main()
