"""Train-step benchmark: FP32, torch.autocast and graphamp, eager and compiled, measured in one run.

    python benchmarks/train_step.py                                  # every model and mode, a table on stdout
    python benchmarks/train_step.py --results benchmarks/RESULTS.md  # and the table into RESULTS.md
    python benchmarks/train_step.py --models gpt2 --dtypes bfloat16 --steps 30
    python benchmarks/train_step.py --models gpt2 --modes autocast,graphamp --profile --trace-dir traces/
    python benchmarks/train_step.py --micro-batches 4 --fused --compile-mode reduce-overhead

The six modes: FP32 eager; torch.autocast eager; torch.autocast + torch.compile; graphamp.auto_cast eager (graphamp's
lists as an eager policy, no compile); graphamp, the model converted
in place by graphamp.rewrite(model, compile=False) (dynamo captures, graphamp's passes cast, each graph runs as fx
code); graphamp + compile, rewrite(model, compile=True) (the same graphs compiled by inductor). --compile-mode is
torch.compile's mode= for both compiled modes. On a CPU the models are scaled down and run in bfloat16; on a GPU
they are full size and run in float16 (with loss scaling: GradScaler for autocast, graphamp.decorate for graphamp,
which scales the gradients inside the rewritten model's graphs) and bfloat16. Each (model, mode, dtype) runs in a
child process of its own, so that its peak memory and its compile caches are its own.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib
import itertools
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

MODES = ["fp32", "autocast", "autocast+compile", "auto_cast", "graphamp", "graphamp+compile"]
MODELS = ["gpt2", "bert", "resnet50", "llama"]
RESULT_PREFIX = "BENCHMARK-RESULT "
LOOP_STYLES = ("held", "loss", "own")
# Dense bf16 tensor-core peaks from the vendors' data sheets, for model-FLOPs utilisation (first match wins).
BF16_PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L4", 121e12)]


# ---------------------------------------------------------------- one (model, mode, dtype), in a child process


def measure(model_name: str, mode: str, dtype_name: str, device: str, steps: int, warmup: int, options=None) -> dict:
    """One (model, mode, dtype): step time, peak memory, casts per step; options: the parent's flags."""
    options = options or {}
    micro_batches = options.get("micro_batches", 1)
    importlib.import_module("transformers")  # loaded before the memory baseline, as in every mode

    import graphamp
    from bench_models import build
    from recorded_casts import recording
    from step_profile import loss_scaling_range, profile_steps
    from tensor_memory import peak_tensor_bytes

    # On a CPU, where peak memory is resident memory: torch's capture and compile stacks are libraries too, loaded
    # (and export run once) in every mode before the baseline, so that the peak counts what training holds, not
    # which of torch's code a mode happened to run first. CUDA counts tensors only: no need, and seconds saved.
    before_stacks_mib = _resident_mib("VmRSS")
    if device != "cuda":
        for stack in ("torch._dynamo", "torch._inductor.compile_fx", "torch.export._trace"):
            importlib.import_module(stack)  # not `import torch.x`: that would make `torch` local to measure()

        _first_use_of_export()
    stacks_mib = _resident_mib("VmRSS") - before_stacks_mib
    baseline_mib = 0.0 if device == "cuda" else _resident_mib("VmRSS")  # torch's own libraries, on a CPU
    workload = build(model_name, options.get("size") or ("gpu" if device == "cuda" else "cpu"), device,
                     options.get("hf_defaults", False))
    model, batches = workload.model, workload.batches
    low = getattr(torch, dtype_name)
    compiled = mode.endswith("+compile")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if options.get("fused") else None)
    scaler = None
    result = {
        "model": model_name, "mode": mode, "dtype": dtype_name, "items": workload.items * micro_batches,
        "unit": workload.unit, "stacks_mib": stacks_mib,
    }

    if mode == "auto_cast":
        lists = graphamp.AutoMixedPrecisionLists(dtype=dtype_name)
        net = model
        if low == torch.float16:
            optimizer = graphamp.decorate(optimizer, lists)  # optimizer.backward(loss) scales the loss
        autocast = lambda: graphamp.auto_cast(lists, model=model)  # noqa: E731
    elif mode.startswith("graphamp"):
        lists = graphamp.AutoMixedPrecisionLists(dtype=dtype_name)
        started = time.perf_counter()
        # Converts `model` in place and compiles it ahead on the first batch: rewrite_s is dynamo's capture and
        # graphamp's passes (and inductor's compile of the forward, for graphamp+compile).
        net = graphamp.rewrite(
            model, example_kwargs=batches[0][0], amp_lists=lists, compile=compiled,
            mode=options.get("compile_mode") if compiled else None,
        )
        result["rewrite_s"] = time.perf_counter() - started
        if low == torch.float16:
            optimizer = graphamp.decorate(optimizer, lists, model=net)  # linked: scaled inside the graphs
        autocast = contextlib.nullcontext
    else:
        net = torch.compile(model, mode=options.get("compile_mode")) if compiled else model
        if mode.startswith("autocast") and low == torch.float16:
            scaler = torch.amp.GradScaler(device)
        autocast = (lambda: torch.autocast(device, low)) if mode.startswith("autocast") else contextlib.nullcontext

    next_batch = itertools.cycle(batches).__next__

    loop_style = options.get("loop_style", "held")

    def forward_backward():
        inputs, target = next_batch()
        with autocast():
            if loop_style == "own":
                loss = workload.own_loss(net, inputs, target)
            elif loop_style == "loss" and target is None:
                loss = net(**inputs).loss  # the output is dropped at once: only the loss is kept
            else:
                output = net(**inputs)  # held until backward is done, as `out = model(**batch)` is
                loss = workload.loss(output, target)
        if isinstance(optimizer, graphamp.OptimizerWithMixedPrecision):
            optimizer.backward(loss)
        else:
            (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss

    def step():
        for _ in range(micro_batches):  # gradient accumulation: one optimizer step for them all
            forward_backward()
        with loss_scaling_range() if profiling else contextlib.nullcontext():
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    profiling = False

    result["first_step_s"] = timed(step, device)
    for _ in range(warmup - 1):
        step()
    _reset_peak_memory(device)
    times = [timed(step, device) for _ in range(steps)]
    result["peak_mib"] = _peak_memory_mib(device) - baseline_mib
    result["step_s"] = statistics.median(times)
    if device != "cuda":  # resident memory moves with glibc's heap; the bytes of live tensors do not
        result["tensor_mib"] = peak_tensor_bytes(step) / 2**20
    result["compile_s"] = result["first_step_s"] - result["step_s"] if compiled else None

    if not compiled:  # inductor fuses casts into its kernels: no cast runs as a kernel of its own there
        try:
            with recording(net) as recorder:  # recorded_casts.py: graphamp's graphs included
                step()  # a whole step: forward, backward, loss scaling and optimizer
            result["casts"] = recorder.casts
        except RuntimeError as error:
            result["casts"] = "n/a"
            print(f"casts not counted: {error}", file=sys.stderr)
    if options.get("profile"):
        profiling = True
        trace_dir = options.get("trace_dir")
        trace = f"{trace_dir}/{model_name}-{mode}-{dtype_name}.json" if trace_dir else None
        result["profile"] = profile_steps(step, device, steps=min(steps, 5), trace_path=trace)
    if mode == "fp32":
        result["flops"] = _flops_of(forward_backward)
        optimizer.zero_grad(set_to_none=True)
    return result


def _first_use_of_export() -> None:
    """One torch.export of a tiny module, in every mode. The first export reads in the pages of torch's own code it
    runs (16 MiB on the EPYC, file-backed: RssFile) and fills its caches, whatever the model; counted with the
    libraries, not with the memory a mode's training holds."""
    torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),), strict=False)


def timed(step, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        # Hand memory freed by capture and compile back to the OS first (glibc keeps it otherwise), so that
        # the peak counts what the steps use; then Linux's peak RSS (VmHWM) starts again from now.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")


def _peak_memory_mib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else _resident_mib("VmHWM")


def _resident_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, from Linux's /proc."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) / 1024


def _flops_of(forward_backward) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        forward_backward()
    return counter.get_total_flops()


# ---------------------------------------------------------------- the parent: run every child, make the table


def run_child(args, model_name: str, mode: str, dtype_name: str) -> dict:
    command = [
        sys.executable, __file__, "--child", model_name, mode, dtype_name,
        "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--micro-batches", str(args.micro_batches),
    ]
    command += ["--size", args.size] if args.size else []
    command += ["--loop-style", args.loop_style] + ["--hf-defaults"] * args.hf_defaults
    command += ["--fused"] * args.fused + ["--profile"] * args.profile
    command += ["--compile-mode", args.compile_mode] if args.compile_mode else []
    command += ["--trace-dir", str(args.trace_dir)] if args.trace_dir else []
    print(f"  {model_name:9s} {mode:17s} {dtype_name} ...", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model_name, "mode": mode, "dtype": dtype_name, "error": [f"timed out after {args.timeout} s"]}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line.removeprefix(RESULT_PREFIX))
    sys.stderr.write(done.stderr[-4000:])
    return {"model": model_name, "mode": mode, "dtype": dtype_name, "error": done.stderr.strip().splitlines()[-1:]}


def median_round(same_run: list[dict]) -> dict:
    """The round with the median step time, and how far the rounds spread."""
    done = sorted((r for r in same_run if "error" not in r), key=lambda r: r["step_s"])
    if not done:
        return same_run[0]
    chosen = dict(done[len(done) // 2])
    chosen["spread"] = (done[-1]["step_s"] - done[0]["step_s"]) / chosen["step_s"]
    chosen["rounds_step_s"] = [r["step_s"] for r in done]
    return chosen


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpu_info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    match = re.search(r"model name\s*:\s*(.+)", cpu_info)
    cores = len(__import__("os").sched_getaffinity(0))
    return f"{match.group(1).strip() if match else platform.processor()}, {cores} cores"


def bf16_peak(name: str) -> float | None:
    return next((flops for key, flops in BF16_PEAK_FLOPS if key in name), None)


def table(results: list[dict], device: str, name: str) -> str:
    """One markdown table: each mode against FP32 and graphamp against autocast in the same mode."""
    peak = bf16_peak(name) if device == "cuda" else None
    by_key = {(r["model"], r["mode"]): r for r in results}
    tensors = any("tensor_mib" in r for r in results)
    unit = {r["model"]: r["unit"] for r in results if "unit" in r}
    rows = [
        "| model | mode | step ms | spread | × FP32 speed | × autocast speed | items/s | peak MiB | memory / autocast "
        + ("| tensor MiB | tensors / autocast " if tensors else "")
        + "| casts / step | rewrite s | compile s |" + (" MFU |" if peak else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if tensors else "") + "---:|---:|---:|"
        + ("---:|" if peak else ""),
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['model']} | {r['mode']} | failed: {' '.join(r['error'])} |")
            continue
        fp32 = by_key.get((r["model"], "fp32"), {})
        # graphamp's modes against autocast in the same mode; auto_cast (eager) against eager autocast.
        autocast = by_key.get((r["model"], r["mode"].replace("graphamp", "autocast").replace("auto_cast", "autocast")),
                              {})
        is_graphamp = r["mode"].startswith("graphamp") or r["mode"] == "auto_cast"
        cells = [
            r["model"], r["mode"], f"{1e3 * r['step_s']:.1f}", f"{100 * r.get('spread', 0):.0f}%",
            _ratio(fp32.get("step_s"), r["step_s"]),
            _ratio(autocast.get("step_s"), r["step_s"]) if is_graphamp else "",
            f"{r['items'] / r['step_s']:,.0f} {unit[r['model']]}",
            f"{r['peak_mib']:,.0f}",
            _ratio(r["peak_mib"], autocast.get("peak_mib")) if is_graphamp else "",
        ]
        if tensors:
            cells += [
                f"{r['tensor_mib']:,.0f}" if "tensor_mib" in r else "",
                _ratio(r.get("tensor_mib"), autocast.get("tensor_mib")) if is_graphamp else "",
            ]
        cells += [
            str(r["casts"]) if r.get("casts") is not None else "fused",
            f"{r['rewrite_s']:.1f}" if r.get("rewrite_s") is not None else "",
            f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "",
        ]
        if peak:
            flops = fp32.get("flops")
            cells.append(f"{100 * flops / r['step_s'] / peak:.1f}%" if flops else "")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _options_line(args) -> str:
    """The flags that change what a step is, in words, for the table's heading."""
    said = [f"{args.micro_batches} micro-batches per step" if args.micro_batches > 1 else ""]
    said += ["fused AdamW" if args.fused else ""]
    said += [f"compile mode {args.compile_mode}" if args.compile_mode else ""]
    said += [{"held": "", "loss": "loop keeps only the loss", "own": "loop computes its own loss"}[args.loop_style]]
    said += ["HF's default dropout and KV cache" if args.hf_defaults else ""]
    said = [s for s in said if s]
    return f"Options: {', '.join(said)}. " if said else ""


def _stacks(results: list[dict]) -> str:
    sizes = [r["stacks_mib"] for r in results if "stacks_mib" in r]
    return f"{min(sizes):.0f}-{max(sizes):.0f}" if sizes else "?"


def _ratio(numerator, denominator) -> str:
    return f"{numerator / denominator:.2f}×" if numerator and denominator else ""


def write_results(path: Path, key: str, block: str) -> None:
    """Replace this device and dtype's block in RESULTS.md (or add it); the prose around the blocks stays."""
    start, end = f"<!-- benchmark: {key} -->", f"<!-- end benchmark: {key} -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    new = f"{start}\n{block}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: new, text) if pattern.search(text) else text.rstrip("\n") + f"\n\n{new}\n"
    path.write_text(text)


def main() -> None:
    from bench_models import SIZES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {MODELS}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
    parser.add_argument("--dtypes", default=None, help="default: bfloat16 on CPU; float16,bfloat16 on CUDA")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=SIZES, help="model sizes (bench_models.py): default gpu on CUDA, else cpu; "
                        "tiny checks that the script runs and measures nothing")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after warm-up (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first; the first one compiles")
    parser.add_argument(
        "--repeats", type=int, default=3,
        help="rounds over every model and mode (a shared machine drifts; the median round is reported)",
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per (model, mode, dtype)")
    parser.add_argument("--results", type=Path, help="write the tables into this markdown file")
    parser.add_argument("--micro-batches", type=int, default=1, help="backwards accumulated per optimizer step")
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True): found_inf stays on the device")
    parser.add_argument("--weight-cache", "--low-outputs", dest="gone", action="append_const", const=True,
                        help=argparse.SUPPRESS)
    parser.add_argument("--compile-mode", help='torch.compile mode= of the +compile modes, e.g. "reduce-overhead"')
    parser.add_argument("--loop-style", choices=LOOP_STYLES, default="held",
                        help="held: `out = model(**batch)` kept through backward; loss: `model(**batch).loss` only; "
                             "own: the loop's own cross_entropy on the logits the model returns")
    parser.add_argument("--hf-defaults", action="store_true",
                        help="keep HF's default dropout and KV cache in the transformers (bench_models.QUIET)")
    parser.add_argument("--profile", action="store_true", help="also a table of where the time goes (torch.profiler)")
    parser.add_argument("--trace-dir", type=Path, help="with --profile: a Chrome trace per (model, mode, dtype) here")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gone:
        parser.error("--weight-cache and --low-outputs are gone since graphamp 0.3: rewrite() runs the model under "
                     "torch.compile, where inductor fuses the weight casts into its kernels and each graph returns "
                     "the dtypes the model's own code gives.")

    if args.child:
        options = {
            "micro_batches": args.micro_batches, "fused": args.fused, "compile_mode": args.compile_mode,
            "profile": args.profile, "trace_dir": args.trace_dir, "size": args.size, "loop_style": args.loop_style,
            "hf_defaults": args.hf_defaults,
        }
        if args.trace_dir:
            args.trace_dir.mkdir(parents=True, exist_ok=True)
        result = measure(*args.child, args.device, args.steps, args.warmup, options)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return

    dtypes = (args.dtypes or ("float16,bfloat16" if args.device == "cuda" else "bfloat16")).split(",")
    name = device_name(args.device)
    for dtype_name in dtypes:
        runs = [(model_name, mode) for model_name in args.models.split(",") for mode in args.modes.split(",")]
        done = {run: [] for run in runs}
        for _ in range(args.repeats):
            for model_name, mode in runs:
                done[(model_name, mode)].append(run_child(args, model_name, mode, dtype_name))
                results = [median_round(done[run]) for run in runs if done[run]]
                if args.results:  # after every child: a run cut short (an outer timeout) keeps what it measured
                    missing = sum(args.repeats - len(rounds) for rounds in done.values())
                    write_results(args.results, f"{args.device} {dtype_name}",
                                  _block(args, name, dtype_name, results, missing, raw=True))
        print("\n" + _block(args, name, dtype_name, results, 0) + "\n")


def _block(args, name: str, dtype_name: str, results: list[dict], missing: int, raw: bool = False) -> str:
    """The markdown for one device and dtype: heading, table, profile table, and the raw results if asked."""
    import transformers

    heading = (
        f"### {name}: {dtype_name}\n\ntorch {torch.__version__}, transformers {transformers.__version__}, "
        f"{datetime.date.today().isoformat()}. Step time: median of {args.steps} train steps (forward, backward, "
        f"AdamW) after {args.warmup} warm-up steps, in a child process per mode; the modes ran round-robin "
        f"{args.repeats} times and the median round is shown, with the spread of the rounds (max − min, "
        f"relative) next to it. graphamp: `graphamp.rewrite(model, compile=False)`, graphamp + compile: "
        f"`rewrite(model, compile=True)`. {_options_line(args)}Peak memory: "
        + ("`torch.cuda.max_memory_allocated`." if args.device == "cuda" else
           "the process's peak resident memory during the timed steps (after freed memory is handed back to the "
           "OS), less its resident memory before the model was built: torch's libraries, with its capture and "
           f"compile stacks (dynamo, torch.export, inductor: {_stacks(results)} MiB, imported, and export run once on "
           "a tiny module, in every mode first). Tensor MiB: CPU tensor storage alive when a step starts plus "
           "the most the step allocates beyond that at once, from torch.profiler's allocation events "
           "(benchmarks/tensor_memory.py); it does not move with glibc's heap as resident memory does.")
        + "\n"
    )
    block = heading + "\n" + table(results, args.device, name)
    if args.size == "tiny":
        block = "(tiny models: a check that the script runs, not a measurement)\n\n" + block
    if missing:
        block = f"(incomplete: {missing} (model, mode) run(s) still to come when this was written)\n\n" + block
    if args.profile:
        from step_profile import table as profile_table

        block += "\n\nWhere the time goes (torch.profiler, per step; see benchmarks/step_profile.py):\n\n"
        block += profile_table(results)
    if raw:
        raw_json = json.dumps(results, indent=1)
        block += f"\n\n<details><summary>raw</summary>\n\n```json\n{raw_json}\n```\n</details>"
    return block

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]  # bench_models beside this file; this checkout's graphamp
    main()
