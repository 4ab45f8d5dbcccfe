"""What inductor runs for one compiled train step: graphamp+compile next to autocast+compile, counted from its code.

    PYTHONPATH=. python benchmarks/compiled_gap.py --models gpt2,bert --out /tmp/gap     # code and a table
    PYTHONPATH=. python benchmarks/compiled_gap.py --models gpt2 --layers 1 --width 64   # a quick check

Wall-clock time on a shared CPU is noise; the generated code is not. For a small GPT-2/BERT (2 layers, width 256,
bfloat16, CPU) each mode's forward and backward are compiled in a child process of its own (autocast: torch.compile
under torch.autocast; graphamp: graphamp.rewrite(model, compile=True), the model converted in place) and its output
code is counted: fused kernels, extern matmul calls (and whether an operand is a transposed view), buffers allocated
and their bytes (static sizes), the graph's inputs. The code itself is written to --out for reading side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

RESULT_PREFIX = "COMPILED-GAP "
SIZES = dict(layers=2, width=256, heads=4, vocab=8192, batch=8, seq=128)
_DTYPE_BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2, "torch.int64": 8, "torch.bool": 1,
                "torch.int32": 4, "torch.uint8": 1, "torch.int8": 1}


def build(name: str):
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_models

    bench_models.TRANSFORMER_SIZES["gap"] = SIZES
    bench_models.RESNET_SIZES["gap"] = bench_models.RESNET_SIZES["cpu"]
    return bench_models.build(name, "gap", "cpu")


def child(name: str, mode: str, out: Path) -> dict:
    from torch._inductor.utils import run_and_get_code

    import graphamp

    workload = build(name)
    model, (inputs, target) = workload.model, workload.batches[0]
    if mode == "graphamp":
        lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
        net = graphamp.rewrite(model, amp_lists=lists, compile=True)  # compiled at the step, as autocast's
        context = contextlib.nullcontext()
    else:
        net = torch.compile(model)
        context = torch.autocast("cpu", torch.bfloat16)

    def step():
        with context:
            loss = workload.loss(net(**inputs), target)
        loss.backward()

    _, codes = run_and_get_code(step)
    tag = f"{name}-{mode}"
    out.mkdir(parents=True, exist_ok=True)
    for i, code in enumerate(codes):
        (out / f"{tag}-{i}.py").write_text(code)
    return {"model": name, "mode": mode, "graphs": [summary(code) for code in codes]}


def summary(code: str) -> dict:
    """Counts from one inductor output-code module (a forward or a backward)."""
    call = code[code.index("def call(") :] if "def call(" in code else code
    externs = re.findall(r"extern_kernels\.(\w+)\(([^\n]*)\)", call)
    mkldnn = re.findall(r"torch\.ops\.(mkldnn|onednn|aten)\.(\w+)\.\w+\(", call)
    allocations = re.findall(r"empty_strided_cpu\(\(([^)]*)\), \(([^)]*)\), (torch\.\w+)\)", call)
    nbytes = 0
    for shape, _, dtype in allocations:
        n = 1
        for size in [s for s in shape.split(",") if s.strip()]:
            n *= int(size) if size.strip().isdigit() else 1
        nbytes += n * _DTYPE_BYTES.get(dtype, 4)
    args_line = re.search(r"def call\(self?,? ?args\):\n\s+(.*?) = args", call)
    return {
        "kernels": len(set(re.findall(r"\n(cpp_fused_\w+) = ", code))),
        "kernel_calls": len(re.findall(r"\n\s+cpp_fused_\w+\(", call)),
        "externs": _counts(f"{fn}" for fn, _ in externs),
        "extern_transposed_operands": sum(a.count("reinterpret_tensor") for _, a in externs),
        "other_ops": _counts(f"{ns}.{op}" for ns, op in mkldnn),
        "allocations": len(allocations),
        "allocated_mib": round(nbytes / 2**20, 1),
        "inputs": len(args_line.group(1).split(",")) if args_line else None,
    }


def _counts(items) -> dict:
    found: dict[str, int] = {}
    for item in items:
        found[item] = found.get(item, 0) + 1
    return dict(sorted(found.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--out", type=Path, default=Path("/tmp/compiled_gap"))
    parser.add_argument("--layers", type=int, default=SIZES["layers"])
    parser.add_argument("--width", type=int, default=SIZES["width"])
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    SIZES.update(layers=args.layers, width=args.width, heads=max(1, args.width // 64))
    if args.child:
        result = child(*args.child, args.out)
        print(RESULT_PREFIX + json.dumps(result))
        return
    rows = []
    for name in args.models.split(","):
        for mode in ("autocast", "graphamp"):
            command = [sys.executable, __file__, "--child", name, mode, "--out", str(args.out)]
            command += ["--layers", str(args.layers), "--width", str(args.width)]
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
            if not lines:
                sys.stderr.write(done.stderr[-3000:])
                continue
            rows.append(json.loads(lines[0].removeprefix(RESULT_PREFIX)))
    print(f"torch {torch.__version__}; code in {args.out}")
    print("Graphs in the order inductor compiled them: a forward's backward is compiled at the first backward.")
    print("| model | mode | graph | fused kernels | kernel calls | extern calls | transposed extern operands | "
          "other ATen/mkldnn calls | buffers | buffer MiB | inputs |")
    print("|---|---|---|---:|---:|---|---:|---|---:|---:|---:|")
    for row in rows:
        for i, g in enumerate(row["graphs"]):
            print(f"| {row['model']} | {row['mode']} | {i + 1} | {g['kernels']} | "
                  f"{g['kernel_calls']} | {_text(g['externs'])} | {g['extern_transposed_operands']} | "
                  f"{_text(g['other_ops'])} | {g['allocations']} | {g['allocated_mib']} | {g['inputs']} |")


def _text(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


if __name__ == "__main__":
    main()
