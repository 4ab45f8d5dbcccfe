"""Activation memory with and without checkpointing: bytes saved for backward by FP32, torch.autocast and graphamp.

A GPT-2-shaped model built from its config, one training forward. Saved bytes are counted with
torch.autograd.graph.saved_tensors_hooks (distinct storages, parameters excluded): what autograd keeps alive
until backward, independent of the device. Rows: no checkpointing; HF gradient_checkpointing_enable() with
use_reentrant True and False; graphamp's own rewrite(checkpoint="transformer.h.*") on a model without any,
against FP32 and autocast with HF's non-reentrant checkpointing. Gradients are compared with autocast's in each row.
FP32 and autocast run on a copy of the model made before graphamp.rewrite converts the model in place.

    python benchmarks/activation_memory.py [--layers 12] [--width 768] [--vocab 50257] [--batch 2] [--seq 128]

Bytes saved do not depend on speed, but on a CPU without native bfloat16 the bf16 matmuls are emulated and
slow: there, a narrower model with a smaller vocabulary (--width 256 --vocab 4096) measures the same shares.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import device_name  # noqa: E402

import graphamp  # noqa: E402
from graphamp.inspection.activation_memory import saved_activation_bytes  # noqa: E402

ROWS = [
    ("no checkpointing", None, None),
    ("HF, use_reentrant=True", True, None),
    ("HF, use_reentrant=False", False, None),
    ('rewrite(checkpoint="transformer.h.*")', None, "transformer.h.*"),
]


def gradients(model, loss_fn) -> list[torch.Tensor]:
    model.zero_grad()
    loss_fn().backward()
    return [p.grad.clone() for p in model.parameters()]


def worst_relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).double().norm() / y.double().norm().clamp_min(1e-30)).item() for x, y in zip(a, b))


def measure_row(config, ids, hf_reentrant, pattern) -> dict:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.train()
    if hf_reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": hf_reentrant})

    reference = copy.deepcopy(model)  # FP32 and autocast run this copy (a copy of a rewritten model is rewritten)
    if pattern is not None:  # their reference for graphamp's checkpoint=: the same blocks checkpointed by HF
        reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def eager_loss():
        return reference(input_ids=ids, labels=ids).loss

    def autocast_loss():
        with torch.autocast(ids.device.type, torch.bfloat16):
            return eager_loss()

    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
    # Converted in place and compiled ahead on the batch, so that dynamo compiles outside the hooks that count.
    graphamp.rewrite(model, (), {"input_ids": ids, "labels": ids}, amp_lists=lists, checkpoint=pattern)
    amp_loss = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    row = {"graphamp": saved_activation_bytes(model, amp_loss), "fp32": saved_activation_bytes(reference, eager_loss)}
    amp_gradients = gradients(model, amp_loss)
    row["autocast"] = saved_activation_bytes(reference, autocast_loss)
    row["gradient_error"] = worst_relative_error(amp_gradients, gradients(reference, autocast_loss))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    from transformers import GPT2Config

    config = GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), vocab_size=args.vocab,
        bos_token_id=0, eos_token_id=0, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    rows = {name: measure_row(config, ids, reentrant, pattern) for name, reentrant, pattern in ROWS}
    baseline = rows["no checkpointing"]["autocast"]
    print(
        f"### Activation memory: {device_name('cpu')}\n\ntorch {torch.__version__}, {datetime.date.today()}; "
        f"GPT2Config(n_layer={args.layers}, n_embd={args.width}, vocab_size={args.vocab}), "
        f"batch {args.batch} x {args.seq} tokens, bfloat16. "
        f"MiB saved for backward (parameters excluded).\n"
    )
    print(
        "| checkpointing | FP32 | autocast | graphamp | graphamp / autocast | graphamp / autocast without "
        "checkpointing | gradient error vs autocast |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        mib = {key: row[key] / 2**20 for key in ("fp32", "autocast", "graphamp")}
        print(
            f"| {name} | {mib['fp32']:.1f} | {mib['autocast']:.1f} | {mib['graphamp']:.1f} | "
            f"{row['graphamp'] / row['autocast']:.3f} | {row['graphamp'] / baseline:.3f} | "
            f"{row['gradient_error']:.1e} |"
        )


if __name__ == "__main__":
    main()
