"""Bytes saved for backward with the user's own torch.utils.checkpoint around residual MLP blocks: FP32, torch.autocast
(eager and under torch.compile) and graphamp (rewrite's default path and compile=True), with use_reentrant False
and True.

Counted with torch.autograd.graph.saved_tensors_hooks (graphamp.inspection.activation_memory: distinct storages,
parameters excluded), one training forward after two warm-up steps: machine-independent. Dynamo turns either kind of
checkpoint into its own non-reentrant region (tag_activation_checkpoint), so every compiled row, torch.compile's
under autocast included, saves what a non-reentrant checkpoint saves; eager autocast with use_reentrant=True saves
only the blocks' inputs.

    PYTHONPATH=. python benchmarks/checkpoint_memory.py [--blocks 4] [--width 256] [--batch 256]
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphamp
from graphamp.inspection.activation_memory import saved_activation_bytes

MODES = ("fp32", "autocast", "autocast+compile", "graphamp", "graphamp+compile")


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


class Checkpointed(nn.Module):
    def __init__(self, blocks: int, width: int, reentrant: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head, self.reentrant = nn.Linear(width, 10), reentrant

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def saved_kib(mode: str, model: nn.Module, x: torch.Tensor) -> float:
    model = copy.deepcopy(model)
    net, region = model, contextlib.nullcontext
    if mode.startswith("graphamp"):
        lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
        net = graphamp.rewrite(model, (x,), amp_lists=lists, compile=mode.endswith("compile"))
    else:
        net = torch.compile(model) if mode.endswith("compile") else model
        if mode.startswith("autocast"):
            region = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731

    def loss():
        with region():
            return net(x).float().pow(2).mean()

    for _ in range(2):
        loss().backward()
    return saved_activation_bytes(model, loss) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.width)
    print(f"torch {torch.__version__}; {args.blocks} checkpointed blocks, width {args.width}, batch {args.batch}; "
          f"KiB saved for backward in one forward\n")
    print("| use_reentrant | " + " | ".join(MODES) + " | graphamp+compile / autocast+compile |")
    print("|---|" + "---:|" * (len(MODES) + 1))
    for reentrant in (False, True):
        model = Checkpointed(args.blocks, args.width, reentrant)
        kib = {mode: saved_kib(mode, model, x) for mode in MODES}
        ratio = kib["graphamp+compile"] / kib["autocast+compile"]
        print(f"| {reentrant} | " + " | ".join(f"{kib[m]:,.0f}" for m in MODES) + f" | {ratio:.2f}× |")


if __name__ == "__main__":
    main()
