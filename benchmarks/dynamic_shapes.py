"""Dynamic shapes benchmark: an epoch of variable-length batches, and generate(), measured in one run.

    PYTHONPATH=$PWD python benchmarks/dynamic_shapes.py [--batches 12] [--compile]

Epoch: a tiny GPT-2 trained on batches whose lengths are drawn from a clipped lognormal (as tokenized text is), one
forward+backward each: the graphs graphamp rewrote (graphamp.rewritten_graphs: dynamo compiles a graph per length
with dynamic=False, up to its recompile limit, and one dynamic graph once a size varies by default), the seconds
graphamp spent on them (lowering to ATen, its passes, inductor) and step time, for graphamp static-per-length
(dynamic=False), graphamp (dynamic=None, torch.compile's default), FP32 and torch.autocast (and with --compile,
their compiled forms). Generate: tokens/s of greedy generation on a tiny Llama, FP32, autocast and graphamp. Step
times and tokens/s are printed only where bfloat16 runs natively (a GPU, or a CPU with AVX512-BF16/AMX); elsewhere
bfloat16 is emulated and its speed says nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import subprocess
import time

import torch

import graphamp
from per_call_overhead import tiny_llama
from tests.models import VOCAB, gpt2


def lengths(count: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.empty(count).log_normal_(mean=3.3, std=0.5, generator=generator)  # median ~27 tokens
    return [int(n) for n in drawn.clamp(8, 64)]


def run_epoch(mode: str, batches: list[torch.Tensor], device: str) -> dict:
    torch.manual_seed(0)
    model = gpt2(n_layer=2, n_embd=128).to(device)
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = mode.endswith("+compile")
    autocast = contextlib.nullcontext
    if mode.startswith("graphamp"):
        net = graphamp.rewrite(model, amp_lists=lists, compile=compiled, dynamic=False if "static" in mode else None,
                               example_kwargs={"input_ids": batches[0], "labels": batches[0]})
    else:
        net = torch.compile(model) if compiled else model
        if mode.startswith("autocast"):
            autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731
    step_times = []
    started = time.perf_counter()
    for ids in batches:
        step_started = time.perf_counter()
        with autocast():
            loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - step_started)
    total = time.perf_counter() - started
    graphs = graphamp.rewritten_graphs(net) if mode.startswith("graphamp") else []
    captures = len(graphs)
    setup = sum(sum(graph.timings.values()) for graph in graphs)
    # Steady state: the steps after the last capture/compile (the median of the second half).
    steady = sorted(step_times[len(step_times) // 2:])[len(step_times[len(step_times) // 2:]) // 2]
    return {"mode": mode, "captures": captures, "capture_s": setup, "epoch_s": total, "step_s": steady}


def tokens_per_second(mode: str, device: str, new_tokens: int = 32) -> float:
    torch.manual_seed(0)
    model = tiny_llama(2).to(device).eval()
    ids = torch.randint(1, VOCAB, (1, 16), device=device)
    net, autocast = model, contextlib.nullcontext
    if mode == "graphamp":
        net = graphamp.rewrite(model, (), {"input_ids": ids}, amp_lists=graphamp.AutoMixedPrecisionLists(dtype="bfloat16"))
    elif mode == "autocast":
        autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731

    def generate():
        with autocast():
            return net.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)

    generate()  # captures, warm-up
    started = time.perf_counter()
    generate()
    return new_tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--compile", action="store_true", help="also autocast+compile and graphamp+compile")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    native = device == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.split(":")[-1].strip()
    print(f"device: {name} ({platform.machine()}), torch {torch.__version__}, {datetime.date.today()}, "
          f"bfloat16 {'native' if native else 'emulated: speeds not shown'}")
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(1, VOCAB, (8, n), generator=generator).to(device) for n in lengths(args.batches)]
    print(f"epoch: {len(batches)} batches of 8, lengths {[b.shape[1] for b in batches]}")
    modes = ["fp32", "autocast", "graphamp static", "graphamp"]
    if args.compile:
        modes += ["autocast+compile", "graphamp+compile"]
    rows = [run_epoch(mode, batches, device) for mode in modes]
    fp32 = next(r for r in rows if r["mode"] == "fp32")
    autocast = next(r for r in rows if r["mode"] == "autocast")
    print("| mode | graphs rewritten | graphamp s (lower, passes, inductor) | epoch s | epoch vs FP32 | step s | step vs FP32 | step vs autocast |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        speed = (f"{r['step_s']:.4f} | {fp32['step_s'] / r['step_s']:.2f}x | {autocast['step_s'] / r['step_s']:.2f}x"
                 if native else "n/a | n/a | n/a")
        print(f"| {r['mode']} | {r['captures']} | {r['capture_s']:.1f} | {r['epoch_s']:.1f} | "
              f"{r['epoch_s'] / fp32['epoch_s']:.2f}x | {speed} |")
    if native:
        rates = {mode: tokens_per_second(mode, device) for mode in ("fp32", "autocast", "graphamp")}
        print("| generate | tokens/s | vs FP32 | vs autocast |")
        print("|---|---|---|---|")
        for mode, rate in rates.items():
            print(f"| {mode} | {rate:.1f} | {rate / rates['fp32']:.2f}x | {rate / rates['autocast']:.2f}x |")
    else:
        print("generate tokens/s: not measured (bfloat16 emulated on this CPU)")


if __name__ == "__main__":
    main()
