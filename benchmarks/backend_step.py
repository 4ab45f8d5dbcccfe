"""graphamp.backend vs torch.compile under torch.autocast: compiled train step, first-step compile, casts.

    python benchmarks/backend_step.py                                   # table on stdout
    python benchmarks/backend_step.py --results benchmarks/results/backend.md --rounds 7 --steps 10

Two small decoders built from transformers configs (GPT-2-shaped, Llama-shaped), trained in bfloat16 on the CPU
(float16 matmuls are slow on CPUs). Both variants run the same loop: forward, backward, AdamW step. They are
interleaved round by round (A, B, A, B, ...) and each reports the median step: the machine is shared, so a
burst of someone else's load hits both. Inductor's on-disk caches are off, so the first step pays the full
compile. Casts: dtype conversions executed per forward+backward, counted on the fx graphs (inductor=False)
against eager autocast; inductor fuses most of either into neighbouring kernels.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # first-step times are full compiles

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

import graphamp
from graphamp.inspection.recording import DtypeRecorder, recording_inside

VARIANTS = ("autocast+compile", "graphamp.backend")


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_head=4, n_embd=128, vocab_size=1024, n_positions=128, use_cache=False, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    ))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, use_cache=False,
    ))


MODELS = {"GPT-2-shaped": gpt2, "Llama-shaped": llama}


class Runner:
    """One (model, variant): its own copy of the model, compiled net and optimizer; `step()` is one train step."""

    def __init__(self, build, variant: str, lists, ids):
        torch.manual_seed(0)
        self.model = build().train()
        self.ids = ids
        self.variant = variant
        if variant == "graphamp.backend":
            self.net = torch.compile(self.model, backend=graphamp.backend(lists))
            self.autocast = None
        else:
            self.net = torch.compile(self.model)
            self.autocast = lists.dtype
        # bfloat16 needs no loss scaling: both use the plain optimizer (decorate's inf check would cost a host sync).
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self) -> tuple[float, float]:
        """(wall seconds, this process's CPU seconds) of one step."""
        started, cpu_started = time.perf_counter(), time.process_time()
        if self.autocast is None:
            loss = self.net(input_ids=self.ids, labels=self.ids).loss
        else:
            with torch.autocast("cpu", self.autocast):
                loss = self.net(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return time.perf_counter() - started, time.process_time() - cpu_started


def casts_per_step(build, variant: str, lists, ids) -> int:
    """dtype conversions executed by one forward+backward: graphamp's fx graphs, or eager autocast."""
    torch.manual_seed(0)
    model = build().train()
    recorder = DtypeRecorder()
    if variant == "graphamp.backend":
        torch._dynamo.reset()
        net = torch.compile(model, backend=recording_inside(graphamp.backend(lists, inductor=False), recorder))
        loss = net(input_ids=ids, labels=ids).loss
        with recorder:  # the backward runs outside dynamo: record it here
            loss.backward()
    else:
        with recorder:
            with torch.autocast("cpu", lists.dtype):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    return recorder.casts


def measure(name: str, rounds: int, steps: int, batch: int, seq: int) -> dict:
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    runners = {variant: Runner(MODELS[name], variant, lists, ids) for variant in VARIANTS}
    # The first step: dynamo, the cast pass (graphamp) and inductor, forward and backward.
    first = {variant: runner.step()[0] for variant, runner in runners.items()}
    times = {variant: [] for variant in VARIANTS}
    for _ in range(rounds):
        for variant, runner in runners.items():
            runner.step()  # one step untimed after the switch: caches warm again
            times[variant] += [runner.step() for _ in range(steps)]
    casts = {variant: casts_per_step(MODELS[name], variant, lists, ids) for variant in VARIANTS}
    return {
        "first": first,
        "median": {v: statistics.median(wall for wall, _ in t) for v, t in times.items()},
        "min": {v: min(wall for wall, _ in t) for v, t in times.items()},
        "cpu": {v: statistics.median(cpu for _, cpu in t) for v, t in times.items()},
        "casts": casts,
    }


def cpu_name() -> str:
    """'AMD EPYC (avx512_bf16)': the model name, and whether the CPU computes bfloat16 natively."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return f"{name} ({'avx512_bf16' if 'avx512_bf16' in flags else 'no native bfloat16'})"


def table(results: dict) -> str:
    rows = [
        "| model | measure | autocast+compile | graphamp.backend | ratio (graphamp / autocast) |",
        "|---|---|---:|---:|---:|",
    ]
    measures = [
        ("median", "step, median wall (ms)", 1e3, ".1f"), ("min", "step, fastest wall (ms)", 1e3, ".1f"),
        ("cpu", "step, median CPU time (ms)", 1e3, ".1f"), ("first", "first step: compile + run (s)", 1, ".1f"),
        ("casts", "casts executed / forward+backward", 1, "d"),
    ]
    for name, r in results.items():
        for key, label, unit, form in measures:
            a, g = r[key]["autocast+compile"], r[key]["graphamp.backend"]
            a, g = (a * unit, g * unit) if unit != 1 else (a, g)
            rows.append(f"| {name} | {label} | {a:{form}} | {g:{form}} | {g / a:.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round per variant")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--results", type=Path, help="write the table and its settings to this Markdown file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {name: measure(name, args.rounds, args.steps, args.batch, args.seq) for name in args.models.split(",")}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    device = f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} CPU"
    settings = (
        f"{device}; {datetime.date.today()}; {args.threads} torch thread(s); bfloat16; batch {args.batch} x "
        f"{args.seq} tokens; median of {args.rounds} interleaved rounds x {args.steps} steps (forward, backward, AdamW step); load average "
        f"{load:.1f} at the end (the machine is shared: figures are noisy)."
    )
    text = table(results)
    print(settings + "\n\n" + text)
    if args.results:
        args.results.write_text(
            "# graphamp.backend vs torch.compile under autocast: train step, compile, casts\n\n"
            f"`python benchmarks/backend_step.py --rounds {args.rounds} --steps {args.steps} --results "
            f"{args.results}`\n\n{settings}\n\n{text}\n",
            encoding="utf-8",
        )


if __name__ == "__main__":
    main()
