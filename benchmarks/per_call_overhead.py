"""Per-call overhead on tiny models: a graphamp train step against torch.autocast's, eager, where Python dominates.

    PYTHONPATH=. python benchmarks/per_call_overhead.py                      # tiny Llama, 4 and 16 layers
    PYTHONPATH=. python benchmarks/per_call_overhead.py --layers 4 --profile # and cProfile's top functions
    PYTHONPATH=. python benchmarks/per_call_overhead.py --per-op             # graphamp.auto_cast's cost per torch call

A tiny Llama (width 64, float32 weights, bfloat16 compute, batch 2 x 32 tokens) is so small that a step's time is
the Python around its kernels: the call of the model graphamp.rewrite converted (torch.compile's guards, dynamo's
frame and graphamp's check of the call; the graphs run as fx code) against autocast's dispatch. The two run in one
process, rounds round-robin, median; on a shared machine the ratio is the figure to read, the milliseconds are not.
The step is forward, backward and SGD (AdamW adds the same time to both). One intra-op thread by default
(--threads): the overhead is single-threaded Python, and a tiny kernel's OpenMP fork-join on a loaded machine is
noise in both modes.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import platform
import pstats
import statistics
import time

import torch

import graphamp

VOCAB = 256


def tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        use_cache=False,
    )
    return LlamaForCausalLM(config).train()


def steps_for(layers: int) -> dict:
    """One train-step function per mode, on models with the same weights."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 32))
    batch = {"input_ids": ids, "labels": ids}
    autocast_model = tiny_llama(layers)
    graphamp_model = tiny_llama(layers)
    graphamp_model.load_state_dict(autocast_model.state_dict())
    amp = graphamp.rewrite(
        graphamp_model, example_kwargs=batch, amp_lists=graphamp.AutoMixedPrecisionLists(dtype="bfloat16"),
    )

    def step_of(net, optimizer, autocast: bool):
        def step():
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = net(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    return {
        "autocast": step_of(autocast_model, torch.optim.SGD(autocast_model.parameters(), lr=1e-3), True),
        "graphamp": step_of(amp, torch.optim.SGD(amp.parameters(), lr=1e-3), False),
    }


def measure(layers: int, rounds: int, steps: int) -> dict:
    runs = steps_for(layers)
    for step in runs.values():
        for _ in range(3):
            step()
    times = {mode: [] for mode in runs}
    for _ in range(rounds):
        for mode, step in runs.items():
            started = time.perf_counter()
            for _ in range(steps):
                step()
            times[mode].append((time.perf_counter() - started) / steps)
    return {mode: statistics.median(t) for mode, t in times.items()}


def profile(layers: int, steps: int) -> None:
    for mode, step in steps_for(layers).items():
        for _ in range(3):
            step()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
        print(f"\n{mode}, {layers} layers, {steps} steps: cProfile's top functions by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


class _DoNothing(torch.overrides.TorchFunctionMode):
    """The floor of any Python mode: a TorchFunctionMode that calls through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def per_op_calls() -> dict:
    """One torch call of each kind the policy decides, on fixed inputs: name -> a function making it."""
    import torch.nn.functional as F

    x, low = torch.randn(4, 16), torch.randn(4, 16, dtype=torch.bfloat16)
    w, b = torch.randn(16, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    norm_w, norm_b = torch.ones(16, requires_grad=True), torch.zeros(16, requires_grad=True)
    images, mean, var = torch.randn(2, 4, 4, 4, dtype=torch.bfloat16), torch.zeros(4), torch.ones(4)
    return {
        "linear (white, casts)": lambda: F.linear(x, w, b), "add (gray)": lambda: low + 1,
        "relu (gray)": lambda: torch.relu(low), "mul (gray)": lambda: low * low, "view (left alone)": lambda: low.view(64),
        "sum (black, bf16 in)": lambda: low.sum(-1), "softmax (black, bf16 in)": lambda: torch.softmax(low, -1),
        "add fp32 + bf16 (mixed gray)": lambda: x + low,
        "layer_norm (O1, bf16)": lambda: F.layer_norm(low, (16,), norm_w, norm_b),
        "batch_norm (O1, bf16)": lambda: F.batch_norm(images, mean, var, norm_w[:4], norm_b[:4]),
    }


def per_op_contexts(lists) -> dict:
    """What each call runs under: name -> a context manager factory."""
    import contextlib

    return {"no AMP": contextlib.nullcontext, "torch.autocast": lambda: torch.autocast("cpu", torch.bfloat16),
            "empty mode": _DoNothing, "graphamp.auto_cast": lambda: graphamp.auto_cast(lists)}


def best_per_call(calls: dict, contexts: dict, rounds: int, repeat: int = 1000) -> dict:
    """Microseconds per call, call name -> context name -> the best of `rounds` rounds of `repeat` calls, the
    contexts interleaved in every round."""
    best = {}
    for name, call in calls.items():
        best[name] = dict.fromkeys(contexts, float("inf"))
        for _ in range(rounds):
            for mode, context in contexts.items():
                with context():
                    started = time.perf_counter()
                    for _ in range(repeat):
                        call()
                    best[name][mode] = min(best[name][mode], (time.perf_counter() - started) / repeat * 1e6)
    return best


def per_op_cost(rounds: int) -> None:
    """graphamp.auto_cast's cost of one torch call against torch.autocast's (C++), a mode that does nothing, and no
    AMP. Microseconds per call, the best of `rounds` interleaved rounds."""
    contexts = per_op_contexts(graphamp.AutoMixedPrecisionLists(dtype="bfloat16"))
    print("| torch call | " + " | ".join(f"{name} µs" for name in contexts) + " | auto_cast − autocast µs |")
    print("|---|" + "---:|" * (len(contexts) + 1))
    for name, times in best_per_call(per_op_calls(), contexts, rounds).items():
        print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in times.values())
              + f" | {times['graphamp.auto_cast'] - times['torch.autocast']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="4,16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--per-op", action="store_true", help="auto_cast's cost per torch call, then stop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {datetime.date.today()}; "
          f"native bf16: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}; {args.threads} thread(s)")
    if args.per_op:
        per_op_cost(max(args.rounds, 25))
        return
    print(f"median of {args.rounds} round-robin rounds of {args.steps} steps")
    print("| tiny Llama | autocast ms/step | graphamp ms/step | graphamp / autocast time |")
    print("|---|---:|---:|---:|")
    for layers in (int(n) for n in args.layers.split(",")):
        t = measure(layers, args.rounds, args.steps)
        print(f"| {layers} layers | {t['autocast'] * 1e3:.2f} | {t['graphamp'] * 1e3:.2f} | "
              f"{t['graphamp'] / t['autocast']:.2f}x |", flush=True)
        if args.profile:
            profile(layers, args.steps)


if __name__ == "__main__":
    main()
