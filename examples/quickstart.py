"""graphamp quickstart: a small CNN on sklearn's handwritten digits, FP32 and graphamp side by side.

    python examples/quickstart.py [--epochs 2] [--device cpu|cuda] [--batch-size 64] [--fused] [--compile]

FP32, torch.autocast, graphamp.auto_cast (graphamp's lists applied eagerly) and graphamp.rewrite (the model
converted in place, run under torch.compile) train from the same weights; the table gives each one's test
accuracy and speed against FP32, and the lines under it say what each row is.
--fused: AdamW(fused=True), whose step takes found_inf on the device (no host sync per step).
--compile [--compile-mode reduce-overhead]: inductor for FP32, autocast and rewrite (CUDA graphs with
reduce-overhead); without it rewrite's graphs run as fx code and FP32 and autocast eagerly. auto_cast is eager.

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
def accuracy(model, test_data, autocast=contextlib.nullcontext):
    model.eval()
    images, labels = test_data
    with autocast():
        return (model(images).argmax(dim=1) == labels).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
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
    auto_cast_model = copy.deepcopy(fp32_model)
    amp_model = copy.deepcopy(fp32_model)  # copied before rewrite(): a copy of a rewritten model is rewritten too
    compiled = (lambda m: torch.compile(m, mode=args.compile_mode)) if args.compile else (lambda m: m)

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True if args.fused else None)

    steps = len(train_data[1]) // args.batch_size
    started = time.perf_counter()

    def phase(text):
        print(f"[{time.perf_counter() - started:4.0f} s] {text}", flush=True)

    options = ", ".join(f"{flag}" for flag, on in [("fused AdamW", args.fused), ("compiled", args.compile)] if on)
    print(f"digits CNN, {args.epochs} epochs of {steps} steps at batch {args.batch_size}, device {device}, "
          f"torch {torch.__version__}" + (f", {options}" if options else "")
          + (f", mode {args.compile_mode}" if args.compile_mode else ""), flush=True)
    runs = {}  # row name -> (model, (step times, final loss), test accuracy)
    phase("training FP32 ...")
    fp32_optimizer = adamw(fp32_model)
    fp32_run = train(compiled(fp32_model), fp32_optimizer, train_data, args.epochs, args.batch_size)
    runs["FP32"] = fp32_model, fp32_run, accuracy(fp32_model, test_data)

    low = getattr(torch, dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=low == torch.float16)
    autocast_optimizer = adamw(autocast_model)

    def scaled_step(loss):
        scaler.scale(loss).backward()
        scaler.step(autocast_optimizer)
        scaler.update()

    def autocast():
        return torch.autocast(device.type, low)

    phase(f"training torch.autocast {dtype} ...")
    autocast_run = train(compiled(autocast_model), autocast_optimizer, train_data, args.epochs, args.batch_size,
                         scaled_step, autocast)
    runs[f"torch.autocast {dtype}"] = autocast_model, autocast_run, accuracy(autocast_model, test_data, autocast)

    amp_lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)

    def auto_cast():
        return graphamp.auto_cast(amp_lists)

    phase(f"training graphamp.auto_cast {dtype} (eager) ...")
    # Not linked to a rewritten model: minimize(loss) scales the loss (float16), backward, step.
    auto_cast_optimizer = graphamp.decorate(adamw(auto_cast_model), amp_lists)
    auto_cast_run = train(auto_cast_model, auto_cast_optimizer, train_data, args.epochs, args.batch_size,
                          auto_cast_optimizer.minimize, auto_cast)
    auto_cast_correct = accuracy(auto_cast_model, test_data, auto_cast)
    runs[f"graphamp.auto_cast {dtype}"] = auto_cast_model, auto_cast_run, auto_cast_correct

    phase("graphamp.rewrite: capturing and rewriting the model on one batch" + (" (inductor)" if args.compile else "")
          + " ...")
    example = (train_data[0][: args.batch_size], train_data[1][: args.batch_size])
    rewrite_began = time.perf_counter()
    # In place, as nn.Module.compile: the model itself now runs mixed precision, compiled ahead on the example.
    graphamp.rewrite(amp_model, example, amp_lists=amp_lists, compile=args.compile, mode=args.compile_mode)
    rewrite_s = time.perf_counter() - rewrite_began
    captured = [len(graphamp.rewritten_graphs(amp_model))]
    # Linked to the rewritten model: float16's loss scaling runs inside its graphs, so the plain loss.backward()
    # leaves true gradients and step() skips on inf/NaN.
    optimizer = graphamp.decorate(adamw(amp_model), amp_lists, model=amp_model)
    phase(f"training graphamp.rewrite {dtype} ...")
    amp_run = train(amp_model, optimizer, train_data, args.epochs, args.batch_size)
    captured.append(len(graphamp.rewritten_graphs(amp_model)))
    runs[f"graphamp.rewrite {dtype}"] = amp_model, amp_run, accuracy(amp_model, test_data)
    phase("done")

    print(f"\n{'run':<29}{'test accuracy':>14}{'final loss':>12}{'step (ms)':>11}{'× FP32':>8}")
    fp32_step = statistics.median(runs["FP32"][1][0])
    for name, (_, (times, loss), correct) in runs.items():
        step = statistics.median(times)
        print(f"{name:<29}{correct:>14.3f}{loss:>12.4f}{1e3 * step:>11.2f}{fp32_step / step:>8.2f}")

    eager = "torch.compile'd (inductor)" if args.compile else "eager"
    rewritten = "compiled by inductor" if args.compile else "run as fx code"
    print(f"""
FP32                the model as written, float32 throughout; {eager}.
torch.autocast      torch.autocast("{device.type}", torch.{dtype}) around each forward (PyTorch's op lists); {eager}.
graphamp.auto_cast  `with graphamp.auto_cast(lists):` around each forward: graphamp's lists, op by op; eager.
graphamp.rewrite    graphamp.rewrite(model): dynamo captures the model, graphamp's cast pass rewrites each graph,
                    {rewritten}; that took {rewrite_s:.1f} s, ahead on one batch, not counted in the step time.
step (ms): the median train step (forward, backward, AdamW) after the first 3; × FP32: FP32's step over the row's.""")
    if low == torch.float16:
        print("float16 adds loss scaling: GradScaler for autocast, graphamp.decorate for graphamp.")
    if device.type == "cpu" and dtype == "bfloat16" and not cpu_runs_bfloat16_natively():
        print("This CPU has no native bfloat16 (torch.ops.mkldnn._is_mkldnn_bf16_supported() is False): bfloat16 is\n"
              "emulated here, so the bfloat16 rows' speed is not meaningful; their accuracy and loss are.")

    print("\ngraphamp.rewrite's graphs, in the order dynamo captured them:")
    for index, graph in enumerate(graphamp.rewritten_graphs(amp_model)):
        when = ("captured by rewrite() on the example batch: the training call" if index < captured[0] else
                "captured during training" if index < captured[1] else
                "captured by the test-accuracy call: eval mode, images only")
        print(f"graph {index} ({when})")
        print("  " + str(graph.report).replace("\n", "\n  "))
    print(f"graphamp.rewrite's optimizer: loss scale {optimizer.get_loss_scaling():g}, "
          f"skipped steps {optimizer.skipped_steps}")


if __name__ == "__main__":
    main()
