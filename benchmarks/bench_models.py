"""The benchmark's models and batches: GPT-2-small-, BERT-base- and ResNet-50-shaped, full size on a GPU and
scaled down on a CPU (same architecture, fewer layers and narrower, so a run takes minutes, not hours); "tiny"
checks that a script runs (seconds a step even where bfloat16 is emulated), and measures nothing.

Weights are random (built from configs); inputs are random tokens and images, a few batches in turn. Speed does
not depend on the values, but one batch over and over would be memorised within a few steps, and the tiny
gradients that follow hit float32 denormals, which are slow on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# (layers, width, heads, vocabulary, batch, sequence length) for the transformers models.
TRANSFORMER_SIZES = {
    "gpu": dict(layers=12, width=768, heads=12, vocab=50257, batch=8, seq=1024),
    "cpu": dict(layers=4, width=256, heads=4, vocab=8192, batch=8, seq=128),
    "tiny": dict(layers=1, width=64, heads=2, vocab=512, batch=2, seq=32),
}
# (batch, image side) for the ResNet-50.
RESNET_SIZES = {"gpu": dict(batch=64, side=224), "cpu": dict(batch=8, side=64), "tiny": dict(batch=2, side=32)}
SIZES = tuple(TRANSFORMER_SIZES)


@dataclass
class Workload:
    model: nn.Module
    batches: list[tuple[dict, torch.Tensor | None]]  # (model(**inputs), class labels or None if it returns .loss)
    items: int  # tokens or images per step
    unit: str  # "tokens" or "images"

    def loss(self, output, target) -> torch.Tensor:
        return output.loss if target is None else F.cross_entropy(output, target)

    def own_loss(self, net, inputs: dict, target) -> torch.Tensor:
        """The loop that computes its own loss from what the model returns (the logits, for a language model)."""
        if target is not None:
            return F.cross_entropy(net(**inputs), target)
        labels = inputs["labels"]
        logits = net(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        if "attention_mask" not in inputs:  # a decoder: each position predicts the next token
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


BATCHES = 4

# What the benchmark's configs set that HF's defaults do not: no dropout, no KV cache in training. `hf_defaults=True`
# keeps HF's defaults instead (attention and hidden dropout 0.1 in GPT-2 and BERT, the cache returned in training), as
# a config built with only the sizes has them.
QUIET = {
    "gpt2": dict(use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "llama": dict(use_cache=False),
}


def gpt2(size: str, hf_defaults: bool = False) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    s = TRANSFORMER_SIZES[size]
    config = GPT2Config(
        n_layer=s["layers"], n_embd=s["width"], n_head=s["heads"], vocab_size=s["vocab"], n_positions=s["seq"],
        attn_implementation="sdpa", **({} if hf_defaults else QUIET["gpt2"]),
    )
    batches = []
    for _ in range(BATCHES):
        ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]))
        batches.append(({"input_ids": ids, "labels": ids}, None))
    return Workload(GPT2LMHeadModel(config), batches, s["batch"] * s["seq"], "tokens")


def bert(size: str, hf_defaults: bool = False) -> Workload:
    from transformers import BertConfig, BertForMaskedLM

    s = TRANSFORMER_SIZES[size]
    seq = min(s["seq"], 512)  # BERT-base's position table
    config = BertConfig(
        num_hidden_layers=s["layers"], hidden_size=s["width"], num_attention_heads=s["heads"],
        intermediate_size=4 * s["width"], vocab_size=s["vocab"], max_position_embeddings=seq,
        attn_implementation="sdpa", **({} if hf_defaults else QUIET["bert"]),
    )
    batch = s["batch"] * s["seq"] // seq  # the same tokens per step as GPT-2
    batches = []
    for _ in range(BATCHES):
        ids = torch.randint(0, s["vocab"], (batch, seq))
        batches.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, None))
    return Workload(BertForMaskedLM(config), batches, batch * seq, "tokens")


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, channels_in, width, stride):
        super().__init__()
        channels_out = width * self.expansion
        self.conv1 = nn.Conv2d(channels_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, channels_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels_out)
        self.downsample = None
        if stride != 1 or channels_in != channels_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """torchvision's ResNet-50 layout (3, 4, 6, 3 bottleneck blocks, widths 64 to 512), without torchvision."""

    def __init__(self, num_classes=1000, blocks=(3, 4, 6, 3)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, channels = [], 64
        for stage, count in enumerate(blocks):
            width = 64 * 2**stage
            for block in range(count):
                layers.append(Bottleneck(channels, width, 2 if block == 0 and stage > 0 else 1))
                channels = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, images):
        x = self.maxpool(F.relu(self.bn1(self.conv1(images))))
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet50(size: str, hf_defaults: bool = False) -> Workload:
    s = RESNET_SIZES[size]
    batches = [
        ({"images": torch.randn(s["batch"], 3, s["side"], s["side"])}, torch.randint(0, 1000, (s["batch"],)))
        for _ in range(BATCHES)
    ]
    return Workload(ResNet50(), batches, s["batch"], "images")


def llama(size: str, hf_defaults: bool = False) -> Workload:
    """A Llama-shaped decoder (RMSNorm, rotary positions, SwiGLU) with a 32k vocabulary, as real ones have: the
    logits are then the largest activation of the step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = TRANSFORMER_SIZES[size]
    config = LlamaConfig(
        num_hidden_layers=s["layers"], hidden_size=s["width"], num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"], intermediate_size=(8 * s["width"]) // 3, vocab_size=max(s["vocab"], 32000)
        if size != "tiny" else s["vocab"], max_position_embeddings=s["seq"], attn_implementation="sdpa",
        **({} if hf_defaults else QUIET["llama"]),
    )
    batches = []
    for _ in range(BATCHES):
        ids = torch.randint(0, config.vocab_size, (s["batch"], s["seq"]))
        batches.append(({"input_ids": ids, "labels": ids}, None))
    return Workload(LlamaForCausalLM(config), batches, s["batch"] * s["seq"], "tokens")


WORKLOADS = {"gpt2": gpt2, "bert": bert, "resnet50": resnet50, "llama": llama}


def build(name: str, size: str, device: str, hf_defaults: bool = False) -> Workload:
    torch.manual_seed(0)
    workload = WORKLOADS[name](size, hf_defaults)
    workload.model.to(device).train()
    workload.batches = [
        ({k: v.to(device) for k, v in inputs.items()}, None if target is None else target.to(device))
        for inputs, target in workload.batches
    ]
    return workload
