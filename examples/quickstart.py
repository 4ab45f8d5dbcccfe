"""graphamp quickstart: a small CNN on sklearn's handwritten digits, FP32 and graphamp side by side.

    python examples/quickstart.py [--epochs 3] [--device cpu|cuda] [--batch-size 64] [--fused] [--compile]

FP32, torch.autocast and graphamp train from the same weights; the table gives each one's speed against FP32.
--fused: AdamW(fused=True), whose step takes found_inf on the device (no host sync per step).
--compile [--compile-mode reduce-overhead]: inductor for all three (CUDA graphs with reduce-overhead); without it
graphamp's graphs run as fx code and the other two eagerly.

graphamp runs bfloat16 on CPU (fast on CPUs with AVX512-BF16/AMX) and float16 on CUDA, where
`graphamp.decorate` adds the dynamic loss scaling float16 needs. `graphamp.rewrite` converts the model in place
(it stays a DigitsCNN), so the training loop is the FP32 one: `loss.backward(); optimizer.step()`.
"""

import argparse
import contextlib
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import graphamp
from graphamp.policy.dtypes import cpu_runs_bfloat16_natively


class DigitsCNN(nn.Module):
    def __init__(self, width=48, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(2 * width * 64, num_classes))

    def forward(self, images, labels=None):
        logits = self.classifier(self.features(images))
        return logits if labels is None else (logits, F.cross_entropy(logits, labels))


def load_data(device):
    """The 1,797 8x8 digits bundled with scikit-learn, upsampled to 32x32; 80/20 split."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=32, mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    split = int(0.8 * len(labels))
    train, test = order[:split], order[split:]
    return (images[train].to(device), labels[train].to(device)), (images[test].to(device), labels[test].to(device))


def train(model, optimizer, train_data, epochs, batch_size, minimize=None, autocast=contextlib.nullcontext):
    """Plain epochs; returns the per-step times (seconds) after the first epoch's warm-up steps."""
    images, labels = train_data
    times = []
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(labels) - batch_size + 1, batch_size):  # full batches: one input shape
            batch = order[start:start + batch_size]
            began = time.perf_counter()
            with autocast():
                _, loss = model(images[batch], labels[batch])
            if minimize is not None:
                minimize(loss)
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad()
            if images.is_cuda:
                torch.cuda.synchronize()
            if epoch > 0 or start >= 3 * batch_size:
                times.append(time.perf_counter() - began)
    return times, loss.item()


@torch.no_grad()
def accuracy(model, test_data):
    model.eval()
    images, labels = test_data
    return (model(images).argmax(dim=1) == labels).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True): no host sync per step")
    parser.add_argument("--compile", action="store_true", help="torch.compile (inductor) for every run")
    parser.add_argument("--compile-mode", default=None, help='with --compile, e.g. "reduce-overhead"')
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = "float16" if device.type == "cuda" else "bfloat16"
    torch.manual_seed(0)
    train_data, test_data = load_data(device)
    fp32_model = DigitsCNN().to(device)
    autocast_model = copy.deepcopy(fp32_model)  # same initial weights for a fair comparison
    amp_model = copy.deepcopy(fp32_model)  # copied before rewrite(): a copy of a rewritten model is rewritten too
    compiled = (lambda m: torch.compile(m, mode=args.compile_mode)) if args.compile else (lambda m: m)

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True if args.fused else None)

    runs = {}
    fp32_optimizer = adamw(fp32_model)
    runs["FP32"] = fp32_model, train(compiled(fp32_model), fp32_optimizer, train_data, args.epochs, args.batch_size)

    low = getattr(torch, dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=low == torch.float16)
    autocast_optimizer = adamw(autocast_model)

    def scaled_step(loss):
        scaler.scale(loss).backward()
        scaler.step(autocast_optimizer)
        scaler.update()

    runs["autocast " + dtype] = autocast_model, train(
        compiled(autocast_model), autocast_optimizer, train_data, args.epochs, args.batch_size, scaled_step,
        lambda: torch.autocast(device.type, low),
    )

    amp_lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    example = (train_data[0][: args.batch_size], train_data[1][: args.batch_size])
    # In place, as nn.Module.compile: the model itself now runs mixed precision, compiled ahead on the example.
    graphamp.rewrite(amp_model, example, amp_lists=amp_lists, compile=args.compile, mode=args.compile_mode)
    # Decorated after rewrite(), the optimizer is linked to the model: float16's loss scaling runs inside its
    # graphs, so the plain loss.backward() leaves true gradients and step() skips on inf/NaN.
    optimizer = graphamp.decorate(adamw(amp_model), amp_lists)
    runs["graphamp " + dtype] = amp_model, train(amp_model, optimizer, train_data, args.epochs, args.batch_size)

    options = ", ".join(f"{flag}" for flag, on in [("fused AdamW", args.fused), ("compiled", args.compile)] if on)
    print(f"digits CNN, {args.epochs} epochs, batch {args.batch_size}, device {device}, torch {torch.__version__}"
          + (f", {options}" if options else "") + (f", mode {args.compile_mode}" if args.compile_mode else ""))
    print(f"{'run':<22}{'test accuracy':>15}{'final loss':>12}{'step (ms)':>12}{'× FP32':>10}")
    fp32_step = statistics.median(runs["FP32"][1][0])
    for name, (model, (times, loss)) in runs.items():
        step = statistics.median(times)
        print(f"{name:<22}{accuracy(model, test_data):>15.3f}{loss:>12.4f}{1e3 * step:>12.2f}{fp32_step / step:>10.2f}")
    if device.type == "cpu" and dtype == "bfloat16" and not cpu_runs_bfloat16_natively():
        print("(this CPU has no native bfloat16 (AVX512-BF16/AMX): bfloat16 runs emulated, slower than FP32 here)")
    for graph in graphamp.rewritten_graphs(amp_model):  # one per graph dynamo captured (train, eval, ...)
        print(graph.report)
    print(f"loss scale {optimizer.get_loss_scaling():g}, skipped steps {optimizer.skipped_steps}")


if __name__ == "__main__":
    main()
