"""Small real models the tests capture: transformers configs, a ResNet-style CNN, an LSTM, custom ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96


def gpt2(n_layer=2, n_embd=64, attn_implementation="sdpa"):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=n_layer, n_head=4, n_embd=n_embd, vocab_size=VOCAB, n_positions=64, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation=attn_implementation,
    )
    return GPT2LMHeadModel(config)


def bert(num_labels=3, num_hidden_layers=2):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, num_labels=num_labels, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )
    return BertForSequenceClassification(config)


def llama(num_hidden_layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False, pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def deberta_v2(num_labels=3, num_hidden_layers=2):
    """Relative-position attention; given labels, its loss picks a branch on the labels' values (no export)."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    config = DebertaV2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=num_labels, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0, relative_attention=True, pos_att_type=["p2c", "c2p"],
        position_buckets=8,
    )
    return DebertaV2ForSequenceClassification(config)


def token_batch(batch=2, seq=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, seq), generator=generator)


class BasicBlock(nn.Module):
    def __init__(self, channels_in, channels_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """ResNet-style: conv stem, BatchNorm, residual blocks, global pooling, linear head."""

    def __init__(self, num_classes=10, width=16, in_channels=1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class LSTMClassifier(nn.Module):
    def __init__(self, vocab=VOCAB, hidden=32, num_classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=1, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


@torch.library.custom_op("graphamp_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scaled_tanh_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * ctx.scale * (1 - torch.tanh(x) ** 2), None


def _scaled_tanh_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


class CustomOpModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.ops.graphamp_test.scaled_tanh(self.fc1(x), 2.0))


class RegionsModel(nn.Module):
    """A torch.no_grad() region and a torch.cond: higher-order sub-graphs the pass must rewrite too."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.true_branch = nn.Linear(8, 8)
        self.false_branch = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            centre = self.fc(x).mean(dim=0, keepdim=True)
        h = h - centre
        return torch.cond(h.sum() > 0, lambda t: self.true_branch(t).relu(), lambda t: self.false_branch(t), (h,))


class InputGatedRegionsModel(RegionsModel):
    """RegionsModel with the torch.cond predicate taken on the input, for comparing runs across dtypes.

    RegionsModel's predicate sums values centred over the batch: about 1e-7 in FP32, so rounding picks its branch
    and an FP32 run and a low-precision run may take different branches. The sign of the input's sum is exact.
    """

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            centre = self.fc(x).mean(dim=0, keepdim=True)
        h = h - centre
        return torch.cond(x.sum() > 0, lambda t: self.true_branch(t).relu(), lambda t: self.false_branch(t), (h,))


def digits(n=256):
    """sklearn's bundled 8x8 digits: real data, no download."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images[:n], dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(data.target[:n])


class PooledSum(nn.Module):
    """A learned sum over a long sequence (a linear layer over 256 positions, weights starting at 1): on inputs
    around 300, `pool`'s output passes float16's max (65504) though every value it adds fits."""

    def __init__(self, features=16, length=256, classes=4):
        super().__init__()
        self.proj = nn.Linear(features, features)
        self.pool = nn.Linear(length, 1, bias=False)
        nn.init.ones_(self.pool.weight)
        self.norm = nn.LayerNorm(features)
        self.head = nn.Linear(features, classes)

    def forward(self, x, target):
        pooled = self.pool(self.proj(x).transpose(1, 2)).squeeze(-1)
        return F.cross_entropy(self.head(self.norm(pooled)), target)


class SquaredEnergy(nn.Module):
    """`h * h` is gray: it follows its float16 input and, for |h| past 256, overflows float16."""

    def __init__(self, features=16, classes=4):
        super().__init__()
        self.proj = nn.Linear(features, features)
        self.head = nn.Linear(features, classes)

    def forward(self, x, target):
        h = self.proj(x)
        energy = h * h
        return F.cross_entropy(self.head(energy / energy.mean(-1, keepdim=True)), target)


def large_inputs(*shape, classes=4, seed=0):
    """(inputs around 300, class targets): unnormalised data, the usual way into float16's range limits."""
    generator = torch.Generator().manual_seed(seed)
    return 300 + 30 * torch.randn(*shape, generator=generator), torch.randint(0, classes, shape[:1], generator=generator)


class Difference(nn.Module):
    """`diff` subtracts two inputs near 1000. bfloat16 has steps of 4 there, so the difference is lost when the
    white linear casts its inputs down; `diff` kept FP32 computes it exactly."""

    def __init__(self):
        super().__init__()
        self.diff = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.diff.weight.copy_(torch.tensor([[1.0, -1.0]]))
        self.head = nn.Linear(1, 1)

    def forward(self, pairs):
        return self.head(self.diff(pairs)).square().mean()


class Cancellation(nn.Module):
    """`(h + 1000) - 1000` in bfloat16: `h` is lost where `+ 1000` rounds, and `-` only shows it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return ((self.fc(x) + 1000.0) - 1000.0).square().mean()


def pairs_near_1000(n=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.randn(n, 1, generator=generator)
    return torch.cat([1000 + offsets, torch.full_like(offsets, 1000.0)], dim=1)


class ResidualBlock(nn.Module):
    """A pre-norm MLP block with a residual, the shape of a transformer layer without attention."""

    def __init__(self, width=64):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class BlockStack(nn.Module):
    """Embedding, identical residual blocks in `blocks`, a head and the loss: what regions and FSDP2 cut apart."""

    def __init__(self, n_blocks=2, width=64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(n_blocks))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class TwoLayer(nn.Module):
    """Linear, ReLU, Linear: the smallest model with submodules to swap and hook; `use_relu` is read in forward."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.use_relu = True

    def forward(self, x):
        hidden = self.fc1(x)
        return self.fc2(torch.relu(hidden) if self.use_relu else hidden)


class LossOfCastLogits(nn.Module):
    """HF's shape: the loss reads `logits.float()`, forward returns `logits` (the same tensor in an FP32 trace)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x, labels):
        logits = self.proj(x)
        return F.cross_entropy(logits.float(), labels), logits


class Regression(nn.Module):
    """A two-layer Tanh MLP whose forward returns its MSE loss, as HF models return theirs."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


def regression_batch(step: int, poison: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Regression's inputs and targets for a step; `poison` (inf or nan) is written into one input value."""
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
    if poison is not None:
        x[0, 0] = poison
    return x, y


class BrokenGraph(nn.Module):
    """Two linear layers with a graph break between them: dynamo hands graphamp two graphs, and the activation
    between them is an input of the second."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return self.second(h)


class Broken(nn.Module):
    """Two layers with a graph break between them: dynamo compiles them in frames of Broken.forward's own code."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h)
