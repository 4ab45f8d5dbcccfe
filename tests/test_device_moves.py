"""A model's `.to(device)`, `.cpu()` and `.to(other)`: moves, not casts, in the rewritten graphs as in eager code.

The FP32 trace records `x.to(device)` as `to(x, dtype=float32, device)`. Kept as the model's own cast, it held the
value in float32 where autocast keeps it low: wav2vec2's `position_embeddings.to(hidden_states.device)` ran the
residual stream and every LayerNorm after it in float32. Every dtype here is one a kernel ran in.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphamp
from graphamp.inspection.recording import DtypeRecorder
from training import relative_error

MOVES = {
    "to(device)": lambda p, h: p.to(h.device),
    "to(str)": lambda p, h: p.to("cpu"),
    "to(device=)": lambda p, h: p.to(device=h.device),
    "to(device, non_blocking)": lambda p, h: p.to(h.device, non_blocking=True),
    "cpu()": lambda p, h: p.cpu(),
    "to(other)": lambda p, h: p.to(h),
}


class MovesABranch(nn.Module):
    """h + branch(h).<move> into a LayerNorm: the add and the norm run in the dtype the move leaves the branch in."""

    def __init__(self, move, fp32_branch=False):
        super().__init__()
        self.fc, self.branch, self.norm, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)
        self.move, self.fp32_branch = move, fp32_branch

    def forward(self, x):
        h = self.fc(x)
        branch = self.branch(h)
        if self.fp32_branch:  # the model computes it in float32 on purpose and hands it back in h's dtype
            branch = torch.softmax(branch, -1, dtype=torch.float32)
        return self.head(self.norm(h + self.move(branch, h))).sum()


def kernel_dtypes(recorder, ops=("add", "native_layer_norm", "native_layer_norm_backward")) -> list:
    return [(call.op, call.in_dtypes) for call in recorder.calls if call.op in ops]


@pytest.mark.parametrize("move", sorted(MOVES))
def test_a_move_to_the_device_the_value_is_on_keeps_its_low_dtype_as_under_autocast(bf16, rewritten, move):
    torch.manual_seed(0)
    model, x = MovesABranch(MOVES[move], fp32_branch=move == "to(other)"), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    with DtypeRecorder() as autocast:
        with torch.autocast("cpu", torch.bfloat16):
            loss = reference(x)
        loss.backward()
    amp = rewritten.convert(model, (x,), amp_lists=bf16)

    with amp.recording() as ours:
        amp.run(x).backward()

    assert kernel_dtypes(ours) == kernel_dtypes(autocast)
    assert ("add", (torch.bfloat16, torch.bfloat16)) in kernel_dtypes(ours)


def test_a_named_dtype_stays_the_models_cast(bf16, rewritten):
    """`.to(device, torch.float32)` names its dtype: kept float32 as the model wrote it, as under autocast."""
    torch.manual_seed(0)
    model, x = MovesABranch(lambda p, h: p.to(h.device, torch.float32)), torch.randn(4, 8)
    amp = rewritten.convert(model, (x,), amp_lists=bf16)

    with amp.recording() as ours:
        amp.run(x)

    assert ("add", (torch.bfloat16, torch.float32)) in kernel_dtypes(ours)
    assert ("native_layer_norm", (torch.float32,) * 3) in kernel_dtypes(ours)


def test_a_move_on_the_same_device_is_the_value_itself_as_in_eager_code(bf16):
    """Eager `.to(x.device)` returns x itself: an in-place write through it reaches x in the rewritten graph too."""

    class WritesThroughAMove(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            h.to(x.device).mul_(2)
            return h

    torch.manual_seed(0)
    model, x = WritesThroughAMove(), torch.randn(4, 8)
    expected = model(x)
    graphamp.rewrite(model, (x,), amp_lists=bf16)

    assert relative_error(model(x), expected) < 1e-2


def test_wav2vec2_keeps_its_residual_stream_low_as_under_autocast(bf16):
    """transformers' wav2vec2 adds `position_embeddings.to(hidden_states.device)` before its encoder."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config)
    batch = {"input_values": torch.randn(2, 400), "labels": torch.randint(1, 12, (2, 5))}
    reference = copy.deepcopy(model)
    with DtypeRecorder() as autocast, torch.autocast("cpu", torch.bfloat16):
        reference(**batch)
    graphamp.rewrite(model, amp_lists=bf16)

    from conftest import CompiledCodeRecorder
    with CompiledCodeRecorder() as ours:
        model(**batch)

    norms = lambda recorder: [c.in_dtypes[0] for c in recorder.calls_of("native_layer_norm")]  # noqa: E731
    assert norms(ours) == norms(autocast) and torch.bfloat16 in norms(ours)
