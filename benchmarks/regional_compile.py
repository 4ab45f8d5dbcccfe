"""Compile time: whole-model vs regional (one compile per distinct block), graphamp and torch.autocast, one run.

    python benchmarks/regional_compile.py [--layers 12] [--width 256] [--results benchmarks/results/distributed.md]

A 12-layer GPT-2-shaped model (GPT2Config, width scaled down: compile time follows the graph, not the width).
Each mode runs in a child process with a fresh inductor cache directory, so no mode reuses another's compiles.
The time is the first training step (forward and backward), where torch.compile compiles; graphamp's includes
its capture and cast pass. Ratios are against torch.compile of the FP32 model and of the autocast model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

MODES = ["fp32 compile", "autocast compile", "autocast regional compile", "graphamp compile", "graphamp regions compile"]
RESULT_PREFIX = "BENCHMARK-RESULT "


def first_step_seconds(mode: str, layers: int, width: int) -> float:
    from transformers import GPT2Config, GPT2LMHeadModel

    import graphamp

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_head=4, n_embd=width, vocab_size=512, n_positions=64, use_cache=False)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 512, (2, 64))
    autocast = torch.autocast("cpu", torch.bfloat16, enabled="autocast" in mode)
    start = time.perf_counter()
    if mode.startswith("graphamp"):
        regions = "transformer.h.*" if "regions" in mode else None
        lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
        model = graphamp.rewrite(model, (tokens,), {"labels": tokens}, amp_lists=lists, compile=True, regions=regions)
    elif "regional" in mode:
        for block in model.transformer.h:
            block.compile()
    else:
        model = torch.compile(model)
    with autocast:
        loss = model(tokens, labels=tokens).loss
    loss.backward()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--results", help="append the table to this Markdown file")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # a child process measuring one mode
    args = parser.parse_args()
    if args.mode:
        print(RESULT_PREFIX + json.dumps(first_step_seconds(args.mode, args.layers, args.width)), flush=True)
        return

    seconds = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "CUDA_VISIBLE_DEVICES": ""}
            child = subprocess.run(
                [sys.executable, __file__, "--mode", mode, "--layers", str(args.layers), "--width", str(args.width)],
                env=env, capture_output=True, text=True, check=True,
            )
        line = next(line for line in child.stdout.splitlines() if line.startswith(RESULT_PREFIX))
        seconds[mode] = json.loads(line[len(RESULT_PREFIX):])
        print(f"{mode}: {seconds[mode]:.1f} s", file=sys.stderr, flush=True)

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    lines = [
        f"Compile time of the first training step, GPT-2-shaped, {args.layers} layers, width {args.width}, batch 2x64, "
        f"bfloat16 lists; CPU ({cpu}, {os.cpu_count()} cores, shared), torch {torch.__version__}, "
        f"{datetime.date.today()}.",
        "",
        "| mode | first step (s) | vs fp32 compile | vs autocast compile |",
        "|---|---:|---:|---:|",
    ]
    for mode, value in seconds.items():
        lines.append(
            f"| {mode} | {value:.1f} | {value / seconds['fp32 compile']:.2f} | {value / seconds['autocast compile']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.results:
        with open(args.results, "a") as results:
            results.write("\n" + table + "\n")


if __name__ == "__main__":
    main()
