"""Peak tensor memory of a compiled train step on HF architectures built with their configs' defaults (dropout, the
KV cache returned in training): graphamp `rewrite(compile=True)` against `torch.compile` under `torch.autocast`, in
the three loop styles of train_step.py.

bench_models.py's transformers switch dropout and the cache off; a config built with only the sizes keeps both, and
each once cost graphamp memory (the cache's empty start promoted it to float32; SDPA's math path, which a CPU takes
with dropout, saved float32 copies of q, k and v). Tensor bytes come from torch.profiler's allocation events
(tensor_memory.py): machine-independent. One child process per (architecture, loop style), both modes in it.

    python benchmarks/architecture_memory.py [--models gpt2,bert,t5] [--styles held,loss,own] [--results FILE]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import subprocess
import sys
import warnings
from pathlib import Path

import torch

VOCAB, WIDTH, LAYERS, HEADS, BATCH, SEQUENCE = 8192, 128, 2, 4, 4, 128
STYLES = ("held", "loss", "own")


def configs() -> dict:
    import transformers as hf

    sizes = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS)
    return {  # name: (config, Auto class)
        "gpt2": (hf.GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS), hf.AutoModelForCausalLM),
        "bert": (hf.BertConfig(**sizes), hf.AutoModelForMaskedLM),
        "roberta": (hf.RobertaConfig(**sizes), hf.AutoModelForMaskedLM),
        "electra": (hf.ElectraConfig(**sizes, embedding_size=WIDTH // 2), hf.AutoModelForMaskedLM),
        "llama": (hf.LlamaConfig(**sizes, num_key_value_heads=HEADS // 2), hf.AutoModelForCausalLM),
        "qwen2": (hf.Qwen2Config(**sizes, num_key_value_heads=HEADS // 2), hf.AutoModelForCausalLM),
        "mistral": (hf.MistralConfig(**sizes, num_key_value_heads=HEADS // 2), hf.AutoModelForCausalLM),
        "gemma": (hf.GemmaConfig(**sizes, head_dim=WIDTH // HEADS, num_key_value_heads=HEADS // 2),
                  hf.AutoModelForCausalLM),
        "phi3": (hf.Phi3Config(**sizes, pad_token_id=0), hf.AutoModelForCausalLM),
        "gpt_neox": (hf.GPTNeoXConfig(**sizes), hf.AutoModelForCausalLM),
        "opt": (hf.OPTConfig(vocab_size=VOCAB, hidden_size=WIDTH, ffn_dim=2 * WIDTH, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, word_embed_proj_dim=WIDTH), hf.AutoModelForCausalLM),
        "t5": (hf.T5Config(vocab_size=VOCAB, d_model=WIDTH, d_ff=2 * WIDTH, num_layers=LAYERS, num_heads=HEADS,
                           d_kv=WIDTH // HEADS, decoder_start_token_id=0), hf.AutoModelForSeq2SeqLM),
        # speech: a CTC head over the frames of 1 s of 16 kHz audio
        "wav2vec2": (hf.Wav2Vec2Config(vocab_size=32, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, conv_dim=(WIDTH,) * 7,
                                       pad_token_id=0), hf.AutoModelForCTC),
    }


def measure(name: str, style: str) -> dict:
    """Tensor MiB of one warm train step of each mode, on copies of one model and one batch."""
    torch.manual_seed(0)
    config, auto = configs()[name]
    model = auto.from_config(config).train()
    if name == "wav2vec2":
        labels = torch.randint(1, config.vocab_size, (BATCH, SEQUENCE // 4))
        batch = {"input_values": torch.randn(BATCH, 16000), "labels": labels}
        logits_only = {"input_values": batch["input_values"]}
    else:
        ids = torch.randint(1, VOCAB, (BATCH, SEQUENCE))
        batch = {"input_ids": ids, "labels": ids.clone()}
        logits_only = {"input_ids": ids, **({"decoder_input_ids": ids} if name == "t5" else {})}
    result = {"model": name, "style": style}
    for mode in ("autocast+compile", "graphamp+compile"):
        torch._dynamo.reset()
        result[mode] = _step_mib(copy.deepcopy(model), mode, style, batch, logits_only)
        gc.collect()  # the mode's model and optimizer state are gone before the next is counted
    return result


def _step_mib(model, mode: str, style: str, batch: dict, logits_only: dict) -> float:
    import graphamp
    from tensor_memory import peak_tensor_bytes

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode == "graphamp+compile":
        lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
        net = graphamp.rewrite(model, example_kwargs=batch, amp_lists=lists, compile=True)
        region = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731 (a context per step)
    else:
        net = torch.compile(model)
        region = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731

    def step():
        with region():
            if style == "own":
                logits = net(**logits_only).logits  # a class per token (per audio frame: random ones)
                seeded = torch.Generator().manual_seed(0)
                targets = torch.randint(1, logits.shape[-1], logits.shape[:-1], generator=seeded)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            elif style == "loss":
                loss = net(**batch).loss  # the output is dropped at once
            else:
                output = net(**batch)  # held through backward
                loss = output.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # the first compiles
        step()
    return peak_tensor_bytes(step) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma-separated (default: all)")
    parser.add_argument("--styles", default=",".join(STYLES))
    parser.add_argument("--results", type=Path, help="write the markdown table here")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "STYLE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        warnings.filterwarnings("ignore")
        print("RESULT " + json.dumps(measure(*args.child)), flush=True)
        return
    names = args.models.split(",") if args.models else list(configs())
    rows = ["| model | loop style | autocast+compile MiB | graphamp+compile MiB | graphamp / autocast |",
            "|---|---|---:|---:|---:|"]
    for name in names:
        for style in args.styles.split(","):
            done = subprocess.run([sys.executable, __file__, "--child", name, style], capture_output=True, text=True)
            line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
            if line is None:
                rows.append(f"| {name} | {style} | error: {done.stderr.strip().splitlines()[-1:]} | | |")
            else:
                r = json.loads(line.removeprefix("RESULT "))
                ours, theirs = r["graphamp+compile"], r["autocast+compile"]
                rows.append(f"| {name} | {style} | {theirs:.2f} | {ours:.2f} | {ours / theirs:.3f}× |")
            print(rows[-1], flush=True)
    if args.results:
        args.results.write_text(
            f"torch {torch.__version__}, bfloat16 on the CPU; {LAYERS} layers, width {WIDTH}, vocabulary {VOCAB}, "
            f"batch {BATCH} × {SEQUENCE}; each config's own defaults otherwise.\n\n" + "\n".join(rows) + "\n"
        )


if __name__ == "__main__":
    main()
