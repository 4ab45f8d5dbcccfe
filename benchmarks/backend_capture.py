"""Which models each front end runs: graphamp.export_program (torch.export) vs graphamp.rewrite (torch.compile).

    python benchmarks/backend_capture.py                                  # table on stdout
    python benchmarks/backend_capture.py --results benchmarks/results/backend_capture.md

Each model (the tests' tiny encoders and decoders, and models whose Python reads a tensor's value: HF
DeBERTa-v2, wav2vec2 and HuBERT given labels, an `if x.mean() > t:` branch) runs one forward and backward in
bfloat16 through each front end, without inductor (what is measured is capture, not kernels): the whole model as
one ExportedProgram (`export_program(...).module()`), and the model converted in place by
`rewrite(compile=False)`, where dynamo splits at what it cannot trace. The loss is compared with eager
torch.autocast's on the same weights and batch.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import graphamp  # noqa: E402
from encoder_models import ENCODERS  # noqa: E402
from models import bert, deberta_v2, gpt2, llama, token_batch  # noqa: E402


def _speech(kind):
    import transformers as tf

    config = getattr(tf, f"{kind}Config")(
        vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, do_stable_layer_norm=True, feat_extract_norm="layer",
        mask_time_prob=0.0,
    )
    generator = torch.Generator().manual_seed(0)
    batch = {"input_values": torch.randn(2, 800, generator=generator),
             "labels": torch.randint(1, 16, (2, 6), generator=generator)}
    return getattr(tf, f"{kind}ForCTC")(config), batch


class Branch(torch.nn.Module):
    """`if h.abs().mean() > t:`, Python control flow on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.inp, self.up, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.inp(x))
        if h.abs().mean() > 0.1:
            h = h + self.up(h).relu()
        return self.head(h)


def _with_labels(build):
    def made():
        model, batch = build()
        return model, {**batch, "labels": torch.tensor([0, 1])}
    return made


MODELS = {
    **{name: build for name, build in ENCODERS.items()},
    "bert + labels": _with_labels(lambda: (bert(), {"input_ids": token_batch()})),
    "gpt2 + labels": lambda: (gpt2(), {"input_ids": token_batch(), "labels": token_batch()}),
    "llama + labels": lambda: (llama(), {"input_ids": token_batch(), "labels": token_batch()}),
    "deberta-v2 + labels": lambda: (deberta_v2(), {"input_ids": token_batch(), "labels": torch.tensor([0, 2])}),
    "wav2vec2 + labels (CTC)": lambda: _speech("Wav2Vec2"),
    "hubert + labels (CTC)": lambda: _speech("Hubert"),
    "if x.mean() > t": lambda: (Branch(), {"x": torch.randn(4, 16)}),
}


def loss_of(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output.float().square().mean()
    loss = getattr(output, "loss", None)
    return loss if loss is not None else output.logits.float().square().mean()


def run(front_end: str, build, lists) -> str:
    torch.manual_seed(0)
    model, batch = build()
    model.train()
    reference = copy.deepcopy(model)  # before rewrite(): a copy of a rewritten model is rewritten too
    try:
        if front_end == "export_program":
            net = graphamp.export_program(model, example_kwargs=batch, amp_lists=lists).module()
        else:
            net = graphamp.rewrite(model, amp_lists=lists, compile=False)
        torch.manual_seed(1)
        loss = loss_of(net(**batch))
        loss.backward()
    except Exception as error:  # the table reports the failure
        first = (str(error).strip().splitlines() or [""])[0].split(" at /")[0]  # the message, not the path
        return f"fails: {type(error).__name__}: {first[:110]}"
    torch.manual_seed(1)
    with torch.autocast("cpu", lists.dtype):
        expected = loss_of(reference(**batch))
    difference = abs(loss.item() - expected.item()) / max(abs(expected.item()), 1e-6)
    graphs = "" if front_end == "export_program" else f", {len(graphamp.rewritten_graphs(model))} graph(s)"
    return f"runs (loss within {difference:.1e} of autocast's{graphs})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path)
    parser.add_argument("--models", help=f"comma-separated, from: {', '.join(MODELS)} (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
    rows = ["| model | graphamp.export_program (torch.export) | graphamp.rewrite (torch.compile) |", "|---|---|---|"]
    for name in args.models.split(",") if args.models else MODELS:
        build = MODELS[name]
        rows.append(f"| {name} | {run('export_program', build, lists)} | {run('rewrite', build, lists)} |")
        print(rows[-1], flush=True)
    text = "\n".join(rows)
    if args.results:
        args.results.write_text(
            "# Which models each front end captures\n\n`python benchmarks/backend_capture.py --results "
            f"{args.results}`\n\ntorch {torch.__version__}, {datetime.date.today()}; bfloat16, one forward and "
            f"backward in train mode, fx code (no inductor); loss compared with eager torch.autocast's.\n\n{text}\n",
            encoding="utf-8",
        )


if __name__ == "__main__":
    main()
