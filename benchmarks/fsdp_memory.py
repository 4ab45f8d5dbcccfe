"""Per-rank peak memory of training under FSDP2: graphamp vs FSDP2's MixedPrecisionPolicy, 1 and 2 ranks.

    python benchmarks/fsdp_memory.py [--ranks 1 2] [--layers 6] [--width 512] [--results benchmarks/results/distributed.md]

Each (mode, ranks) is a torchrun job of its own. Both modes shard every GPT-2 block and then the root and train with
AdamW in bfloat16: "graphamp" converts the sharded model in place with graphamp.rewrite (torch.compile runs FSDP2's
hooks inside the whole model's capture) and decorates the optimizer; "mixed precision policy" passes
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) to fully_shard. On a GPU the peak is
torch.cuda.max_memory_allocated; on a CPU (gloo) it is the process's peak resident memory (VmHWM, reset with
/proc/self/clear_refs) above its resident memory when training starts, which also counts the allocator's caching:
compare within one table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch

MODES = ["graphamp", "mixed precision policy"]
RESULT_PREFIX = "BENCHMARK-RESULT "
STEPS = 3


def _status_mib(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def worker(mode: str, layers: int, width: int) -> None:
    """One rank of a torchrun job: build, shard, train STEPS steps, print this rank's peak."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    import graphamp

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_head=8, n_embd=width, vocab_size=1024, n_positions=128, use_cache=False)
    model = GPT2LMHeadModel(config).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = {"mp_policy": policy} if mode == "mixed precision policy" else {}
    for block in model.transformer.h:
        fully_shard(block, **options)
    fully_shard(model, **options)
    tokens = torch.randint(0, 1024, (4, 128), device=device)
    if mode == "graphamp":
        lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
        graphamp.rewrite(model, (tokens,), {"labels": tokens}, amp_lists=lists)
        optimizer = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-4), lists, model=model)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    else:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # VmHWM := VmRSS
        start = _status_mib("VmRSS")
    for _ in range(STEPS):
        loss = model(tokens, labels=tokens).loss
        optimizer.zero_grad()
        if mode == "graphamp":
            optimizer.minimize(loss)
        else:
            loss.backward()
            optimizer.step()
    if cuda:
        peak = (torch.cuda.max_memory_allocated(device) - start) / 2**20 + start / 2**20
    else:
        peak = _status_mib("VmHWM")
    parameters_mib = sum(p.to_local().numel() for p in model.parameters()) * 4 / 2**20
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, {"peak_mib": peak, "start_mib": start if not cuda else start / 2**20,
                                     "local_parameters_mib": parameters_mib})
    if dist.get_rank() == 0:
        print(RESULT_PREFIX + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--results", help="append the table to this Markdown file")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # a torchrun worker
    args = parser.parse_args()
    if args.mode:
        worker(args.mode, args.layers, args.width)
        return

    rows = []
    for ranks in args.ranks:
        for mode in MODES:
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__,
                "--mode", mode, "--layers", str(args.layers), "--width", str(args.width),
            ]
            child = subprocess.run(command, capture_output=True, text=True, check=True)
            line = next(line for line in child.stdout.splitlines() if line.startswith(RESULT_PREFIX))
            per_rank = json.loads(line[len(RESULT_PREFIX):])
            rows.append((ranks, mode, max(r["peak_mib"] - r["start_mib"] for r in per_rank),
                         max(r["peak_mib"] for r in per_rank), per_rank[0]["local_parameters_mib"]))
            print(rows[-1], file=sys.stderr, flush=True)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    baseline = {ranks: extra for ranks, mode, extra, _, _ in rows if mode == "mixed precision policy"}
    lines = [
        f"Per-rank peak memory over {STEPS} training steps, GPT-2-shaped, {args.layers} layers, width {args.width}, "
        f"batch 4x128 per rank, bfloat16, AdamW; {device}, torch {torch.__version__}, {datetime.date.today()}.",
        "",
        "| ranks | mode | FP32 parameters held per rank (MiB) | peak above start (MiB) | vs policy, same ranks |",
        "|---:|---|---:|---:|---:|",
    ]
    for ranks, mode, extra, _, parameters in rows:
        lines.append(f"| {ranks} | {mode} | {parameters:.1f} | {extra:.1f} | {extra / baseline[ranks]:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.results:
        with open(args.results, "a") as results:
            results.write("\n" + table + "\n")


if __name__ == "__main__":
    main()
