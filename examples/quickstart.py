"""graphamp quickstart: a small CNN on sklearn's handwritten digits, FP32 and graphamp side by side.

    python examples/quickstart.py [--epochs 3] [--device cpu|cuda]

graphamp runs bfloat16 on CPU (fast on CPUs with AVX512-BF16/AMX) and float16 on CUDA, where
`graphamp.decorate` adds the dynamic loss scaling float16 needs.
"""

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import graphamp
from graphamp.dtypes import cpu_runs_bfloat16_natively


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


def train(model, optimizer, train_data, epochs, batch_size, minimize=None):
    """Plain epochs; returns the per-step times (seconds) after the first epoch's warm-up steps."""
    images, labels = train_data
    times = []
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(labels) - batch_size + 1, batch_size):  # full batches: one input shape
            batch = order[start:start + batch_size]
            began = time.perf_counter()
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
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = "float16" if device.type == "cuda" else "bfloat16"
    torch.manual_seed(0)
    train_data, test_data = load_data(device)
    fp32_model = DigitsCNN().to(device)
    amp_model_source = copy.deepcopy(fp32_model)  # same initial weights for a fair comparison

    fp32_optimizer = torch.optim.AdamW(fp32_model.parameters(), lr=2e-3)
    fp32_times, fp32_loss = train(fp32_model, fp32_optimizer, train_data, args.epochs, args.batch_size)

    amp_lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    example = (train_data[0][: args.batch_size], train_data[1][: args.batch_size])
    amp_model = graphamp.rewrite(amp_model_source, example, amp_lists=amp_lists)
    optimizer = graphamp.decorate(torch.optim.AdamW(amp_model.parameters(), lr=2e-3), amp_lists)
    amp_times, amp_loss = train(amp_model, optimizer, train_data, args.epochs, args.batch_size, optimizer.minimize)

    fp32_step, amp_step = statistics.median(fp32_times), statistics.median(amp_times)
    print(f"digits CNN, {args.epochs} epochs, batch {args.batch_size}, device {device}, torch {torch.__version__}")
    print(f"{'run':<22}{'test accuracy':>15}{'final loss':>12}{'step (ms)':>12}{'speed-up':>10}")
    print(f"{'FP32':<22}{accuracy(fp32_model, test_data):>15.3f}{fp32_loss:>12.4f}{1e3 * fp32_step:>12.2f}{1.0:>10.2f}")
    print(
        f"{'graphamp ' + dtype:<22}{accuracy(amp_model, test_data):>15.3f}{amp_loss:>12.4f}"
        f"{1e3 * amp_step:>12.2f}{fp32_step / amp_step:>10.2f}"
    )
    if device.type == "cpu" and dtype == "bfloat16" and not cpu_runs_bfloat16_natively():
        print("(this CPU has no native bfloat16 (AVX512-BF16/AMX): bfloat16 runs emulated, slower than FP32 here)")
    print(amp_model.report)
    print(f"loss scale {optimizer.get_loss_scaling():g}, skipped steps {optimizer.skipped_steps}")


if __name__ == "__main__":
    main()
