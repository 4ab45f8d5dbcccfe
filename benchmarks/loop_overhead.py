"""A tiny Llama's steady-state step inside the loops people use: HF Trainer, Lightning, and `generate()` per token.

    PYTHONPATH=. python benchmarks/loop_overhead.py
    PYTHONPATH=. python benchmarks/loop_overhead.py --loops generate --rounds 5   # runs on the CPU, also on a GPU machine

Each loop runs its mixed precision the way its users turn it on: autocast through `Trainer(bf16=True)`, Lightning's
`precision="bf16-mixed"` and `torch.autocast` around `generate()`; graphamp as the model `graphamp.rewrite`
converted in place, in FP32 settings. The model is the tiny Llama of per_call_overhead.py (width 64, 4 layers,
bfloat16, batch 2 x 32 tokens, one thread), so a step is the Python around its kernels: what each loop and each AMP
adds per call. The two modes alternate in one process (rounds), and the median of the steps after the first few is
compared; the ratio is the figure to read on a shared machine, the milliseconds are not.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import statistics
import tempfile
import time
import warnings

import torch

import graphamp
from per_call_overhead import VOCAB, tiny_llama

BATCH, SEQ = 2, 32
LISTS = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _models(layers: int):
    """Two models with the same weights: one for autocast, one for graphamp.rewrite to convert in place."""
    torch.manual_seed(0)
    autocast_model = tiny_llama(layers)
    graphamp_model = tiny_llama(layers)
    graphamp_model.load_state_dict(autocast_model.state_dict())
    return autocast_model, graphamp_model


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        ids = _tokens(index)[0]
        return {"input_ids": ids, "labels": ids}


def trainer_step_times(model, bf16: bool, steps: int) -> list[float]:
    """Seconds between the ends of consecutive optimizer steps of `transformers.Trainer`."""
    import transformers

    ends = []

    class StepEnds(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as output_dir:
        arguments = transformers.TrainingArguments(
            output_dir=output_dir, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=1e-4,
            logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, bf16=bf16,
            dataloader_num_workers=0, disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model, args=arguments, train_dataset=_Tokens(), callbacks=[StepEnds()])
        trainer.train()
    return [b - a for a, b in zip(ends, ends[1:])]


def lightning_step_times(model, precision: str, steps: int) -> list[float]:
    """Seconds between the ends of consecutive training batches of `lightning.Trainer`."""
    import lightning

    ends = []

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_index):
            return self.model(**batch).loss

        def on_train_batch_end(self, outputs, batch, batch_index):
            ends.append(time.perf_counter())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=BATCH)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, precision=precision, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Module(), loader)
    return [b - a for a, b in zip(ends, ends[1:])]


def generate_token_times(model, autocast: bool, calls: int, new_tokens: int) -> list[float]:
    """Seconds per generated token of greedy `generate()` with a KV cache, one call per sample."""
    prompt = _tokens()[:, :8]
    times = []
    model.eval()
    for _ in range(calls):
        started = time.perf_counter()
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = model.generate(
                prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                pad_token_id=0,
            )
        assert out.shape[1] == prompt.shape[1] + new_tokens
        times.append((time.perf_counter() - started) / new_tokens)
    return times


def measure(loop: str, layers: int, rounds: int, steps: int) -> dict[str, float]:
    autocast_model, graphamp_model = _models(layers)
    example = {"input_ids": _tokens(), "labels": _tokens()}
    if loop == "trainer":  # the Trainer passes num_items_in_batch to a forward taking **kwargs
        example["num_items_in_batch"] = torch.tensor(float(BATCH * SEQ))
    amp = graphamp.rewrite(graphamp_model, example_kwargs=example, amp_lists=LISTS)  # graphamp_model, converted
    runs = {
        "trainer": {
            "autocast": lambda: trainer_step_times(autocast_model, True, steps),
            "graphamp": lambda: trainer_step_times(amp, False, steps),
        },
        "lightning": {
            "autocast": lambda: lightning_step_times(autocast_model, "bf16-mixed", steps),
            "graphamp": lambda: lightning_step_times(amp, "32-true", steps),
        },
        "generate": {
            "autocast": lambda: generate_token_times(autocast_model, True, 3, steps),
            "graphamp": lambda: generate_token_times(amp, False, 3, steps),
        },
    }[loop]
    for run in runs.values():
        run()  # first steps: capture, compile, the loop's own warm-up
    times = {mode: [] for mode in runs}
    for round_ in range(rounds):
        for mode in runs if round_ % 2 == 0 else reversed(list(runs)):
            times[mode] += runs[mode]()[2:]  # the first steps of each run set up the loop
    return {mode: statistics.median(t) for mode, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loops", default="trainer,lightning,generate")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="train steps per run; new tokens per generate() call")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {datetime.date.today()}; "
          f"tiny Llama, {args.layers} layers, {args.threads} thread(s); median over {args.rounds} alternating rounds")
    print("| loop | autocast ms | graphamp ms | graphamp / autocast time |")
    print("|---|---:|---:|---:|")
    for loop in args.loops.split(","):
        t = measure(loop, args.layers, args.rounds, args.steps)
        unit = "per token" if loop == "generate" else "per step"
        print(f"| {loop} ({unit}) | {t['autocast'] * 1e3:.2f} | {t['graphamp'] * 1e3:.2f} | "
              f"{t['graphamp'] / t['autocast']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
