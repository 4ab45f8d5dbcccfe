"""Dynamic shapes: one capture serves every batch size and sequence length (the automatic-dynamic rule)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import graphamp
from tests.models import SmallResNet, gpt2, token_batch
from tests.training import relative_error

BF16_RTOL = 2e-2
# (batch, sequence length) of an epoch of variable-length batches, the last one partial.
EPOCH = [(4, 12), (4, 7), (4, 16), (4, 9), (3, 5), (4, 14), (2, 11)]


def train_captures(amp):
    return [c for c in amp.captures if c.training]


def eval_captures(amp):
    return [c for c in amp.captures if not c.training]


def test_variable_batch_and_length_epoch_costs_two_train_captures_and_one_eval_capture(bf16, seeded):
    model = gpt2()
    amp = graphamp.rewrite(model, (), {"input_ids": token_batch(*EPOCH[0]), "labels": token_batch(*EPOCH[0])}, amp_lists=bf16)

    for seed, (batch, length) in enumerate(EPOCH):
        ids = token_batch(batch, length, seed=seed)
        amp(input_ids=ids, labels=ids).loss.backward()
    amp.eval()
    with torch.no_grad():
        for seed, (batch, length) in enumerate(EPOCH):
            amp(input_ids=token_batch(batch, length, seed=seed))

    assert len(train_captures(amp)) == 2  # the first static, then one dynamic
    assert len(eval_captures(amp)) == 1  # sizes already varied: dynamic at once


def test_losses_over_variable_lengths_match_the_fp32_original(bf16, seeded):
    model = gpt2()
    amp = graphamp.rewrite(model, (), {"input_ids": token_batch(4, 12), "labels": token_batch(4, 12)}, amp_lists=bf16)

    for seed, (batch, length) in enumerate(EPOCH):
        ids = token_batch(batch, length, seed=seed)
        loss = amp(input_ids=ids, labels=ids).loss
        assert relative_error(loss, model(input_ids=ids, labels=ids).loss) < BF16_RTOL


def test_dynamic_capture_gives_the_static_capture_outputs_and_gradients(bf16, seeded):
    model = gpt2()
    ids = token_batch(3, 10, seed=5)
    static = graphamp.rewrite(model, (), {"input_ids": ids, "labels": ids}, amp_lists=bf16, dynamic=False)
    dynamic = graphamp.rewrite(model, (), {"input_ids": ids, "labels": ids}, amp_lists=bf16, dynamic=True)

    static_loss = static(input_ids=ids, labels=ids).loss
    static_loss.backward()
    static_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    dynamic_loss = dynamic(input_ids=ids, labels=ids).loss
    dynamic_loss.backward()

    assert graphamp.runtime.shapes.is_dynamic(dynamic.graph_module) and not graphamp.runtime.shapes.is_dynamic(static.graph_module)
    assert relative_error(dynamic_loss, static_loss) < 1e-6
    for parameter, expected in zip(model.parameters(), static_grads):
        assert relative_error(parameter.grad, expected) < 1e-5


def test_cnn_last_partial_batch_and_eval_cost_three_captures(bf16, seeded):
    model = SmallResNet()
    amp = graphamp.rewrite(model, (torch.randn(8, 1, 12, 12),), amp_lists=bf16)

    for batch in (8, 8, 5, 8, 3):
        x = torch.randn(batch, 1, 12, 12)
        out = amp(x)
        out.float().pow(2).mean().backward()
    amp.eval()
    with torch.no_grad():
        for batch in (16, 7, 16):
            x = torch.randn(batch, 1, 12, 12)
            assert relative_error(amp(x), model(x)) < BF16_RTOL

    assert len(train_captures(amp)) == 2
    assert len(eval_captures(amp)) == 1


def test_dynamic_false_captures_each_shape(bf16):
    amp = graphamp.rewrite(gpt2(), (), {"input_ids": token_batch(2, 8)}, amp_lists=bf16, dynamic=False)

    for length in (9, 10, 11):
        amp(input_ids=token_batch(2, length))

    assert len(amp.captures) == 4
    assert not any(graphamp.runtime.shapes.is_dynamic(c.graph_module) for c in amp.captures)


def test_a_size_outside_the_dynamic_range_gets_a_capture_of_its_own(bf16):
    model = nn.Linear(8, 8)
    amp = graphamp.rewrite(model, (torch.randn(2, 8),), amp_lists=bf16)
    amp(torch.randn(3, 8))  # the dynamic capture: batches from 1 up

    x = torch.randn(0, 8)  # an empty batch
    out = amp(x)

    assert out.shape == model(x).shape == (0, 8)
    assert len(amp.captures) == 3


# -- keywords ----------------------------------------------------------------------------------------------------

def test_optional_keyword_that_comes_and_goes_costs_one_capture(bf16):
    amp = graphamp.rewrite(gpt2(), (), {"input_ids": token_batch(2, 8)}, amp_lists=bf16)
    amp(input_ids=token_batch(2, 12))  # sizes vary: the dynamic capture

    for length in (6, 10, 13, 7):
        ids = token_batch(2, length)
        amp(input_ids=ids, attention_mask=torch.ones_like(ids))
        amp(input_ids=ids)

    assert len(amp.captures) == 3  # static, dynamic, and one dynamic capture with attention_mask


def test_keyword_passed_at_its_default_value_reuses_the_capture(bf16):
    ids = token_batch(2, 8)
    amp = graphamp.rewrite(gpt2(), (), {"input_ids": ids}, amp_lists=bf16)

    amp(input_ids=ids, attention_mask=None)

    assert len(amp.captures) == 1


def test_overflow_warning_names_the_keyword_that_differs(bf16):
    ids = token_batch(2, 8)
    amp = graphamp.rewrite(gpt2(), (), {"input_ids": ids}, amp_lists=bf16, max_captures=1)

    with pytest.warns(UserWarning, match=r"attention_mask added"):
        amp(input_ids=ids, attention_mask=torch.ones_like(ids))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        return self.fc(x) * scale


def test_overflow_warning_names_the_value_that_differs(bf16):
    x = torch.randn(2, 4)
    amp = graphamp.rewrite(Scaled(), (x,), {"scale": 2.0}, amp_lists=bf16, max_captures=1)

    with pytest.warns(UserWarning, match=r"scale 2\.0 → 3\.0"):
        amp(x, scale=3.0)


def test_overflow_warning_names_the_shape_that_differs(bf16):
    amp = graphamp.rewrite(Scaled(), (torch.randn(2, 4),), amp_lists=bf16, max_captures=1, dynamic=False)

    with pytest.warns(UserWarning, match=r"args\[0\] shape \(2, 4\) → \(3, 4\)"):
        amp(torch.randn(3, 4))


def test_dim_that_varies_but_is_specialized_is_reported(bf16):
    amp = graphamp.rewrite(nn.Linear(8, 8), (torch.randn(5, 8),), amp_lists=bf16)

    with pytest.warns(UserWarning, match=r"args\[0\] dim 0 is static at 1: the call that made the dynamic capture had 1"):
        amp(torch.randn(1, 8))


def test_dynamic_capture_exports_its_files(bf16, tmp_path):
    amp = graphamp.rewrite(gpt2(), (), {"input_ids": token_batch(2, 8)}, amp_lists=bf16, dynamic=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphamp.export(amp, tmp_path)

    assert (tmp_path / "graph.py").read_text().count("_to_copy") > 0


# -- sizes of 1 ---------------------------------------------------------------------------------------------------

class TinyAttention(nn.Module):
    """Embedding, one attention head (views, transposes, batched matmuls, a broadcast mask), a loss."""

    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.embed, self.qkv, self.head = nn.Embedding(vocab, width), nn.Linear(width, 3 * width), nn.Linear(width, vocab)
        self.norm = nn.LayerNorm(width)

    def forward(self, ids, labels):
        batch, length = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(batch, length, 3, -1).unbind(2)
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        scores = (q @ k.transpose(1, 2) / 4).masked_fill(~causal, float("-inf"))
        logits = self.head(self.norm(scores.softmax(-1) @ v))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_batch_sizes_from_one_up_cost_one_dynamic_capture_and_match_eager(bf16, seeded):
    model = TinyAttention()
    ids = torch.randint(0, 32, (4, 8))
    amp = graphamp.rewrite(model, (ids, ids), amp_lists=bf16)

    for batch in (4, 3, 1, 5, 2, 7, 1, 6, 8):
        ids = torch.randint(0, 32, (batch, 8))
        (logits, loss), (expected_logits, expected_loss) = amp(ids, ids), model(ids, ids)
        loss.backward()
        assert logits.shape == expected_logits.shape
        assert relative_error(logits, expected_logits) < BF16_RTOL
        assert relative_error(loss, expected_loss) < BF16_RTOL

    assert len(amp.captures) == 2  # the first static, then one dynamic that serves a batch of 1 too


class SqueezesTheBatch(nn.Module):
    """`squeeze(0)` drops the batch dim only when it is 1: the graph must do what eager does at that size."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).squeeze(0)


def test_an_op_that_drops_a_dim_of_one_gives_eagers_shape_at_batch_one(bf16):
    model = SqueezesTheBatch()
    amp = graphamp.rewrite(model, (torch.randn(4, 8),), amp_lists=bf16)
    amp(torch.randn(3, 8))  # the dynamic capture

    x = torch.randn(1, 8)
    out = amp(x)

    assert out.shape == model(x).shape == (8,)
    assert relative_error(out, model(x)) < BF16_RTOL
    assert len(amp.captures) == 2


class DoublesABatchOfOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * 2 if x.shape[0] == 1 else self.fc(x)


def test_code_that_branches_on_a_batch_of_one_gets_a_capture_of_its_own(bf16):
    model = DoublesABatchOfOne()
    amp = graphamp.rewrite(model, (torch.randn(4, 8),), amp_lists=bf16)
    amp(torch.randn(3, 8))  # the dynamic capture, traced on the other branch

    x = torch.randn(1, 8)

    assert relative_error(amp(x), model(x)) < BF16_RTOL
    assert len(amp.captures) == 3


class AddsTwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.fc(x) + y


def test_a_batch_of_one_that_broadcasts_against_another_input_matches_eager(bf16):
    model = AddsTwoInputs()
    amp = graphamp.rewrite(model, (torch.randn(4, 8), torch.randn(4, 8)), amp_lists=bf16)
    amp(torch.randn(3, 8), torch.randn(3, 8))  # the dynamic capture: both batches one size

    x, y = torch.randn(1, 8), torch.randn(3, 8)  # eager broadcasts x's batch of 1
    out = amp(x, y)

    assert out.shape == model(x, y).shape == (3, 8)
    assert relative_error(out, model(x, y)) < BF16_RTOL


# -- the per-call checks -----------------------------------------------------------------------------------------

def test_signature_of_a_call_of_tensors_and_scalars_equals_pytree_s_flattening():
    """The spec and leaf names reused across calls of one shape are those pytree gives each call."""
    import torch.utils._pytree as pytree

    from graphamp.runtime.shapes import _leaf_name, signature_of

    x, mask = torch.randn(2, 3), torch.ones(2, 3)
    for args, kwargs in [((x, 3), {"mask": mask, "mode": "a"}), ((x, 3), {"mask": mask, "mode": "b"}),
                         ((), {"mode": "a", "mask": mask}), (([x, x],), {"mask": None})]:
        for _ in range(2):  # the second call of a shape takes the kept spec
            signature, flat = signature_of(True, None, args, kwargs)
            leaves_with_path, spec = pytree.tree_flatten_with_path((args, kwargs))
            assert signature.spec == spec
            assert [name for name, _ in signature.leaves] == [_leaf_name(path) for path, _ in leaves_with_path]
            assert all(a is b for a, b in zip(flat, (leaf for _, leaf in leaves_with_path), strict=True))


def test_dynamic_capture_guard_admits_and_refuses_the_sizes_its_expression_does(bf16):
    amp = graphamp.rewrite(gpt2(), (), {"input_ids": token_batch(2, 8)}, amp_lists=bf16)
    amp(input_ids=token_batch(3, 9))  # the dynamic capture
    (guard,) = [key[1] for key in amp._captures if isinstance(key, tuple)]

    for batch, length in [(2, 8), (4, 13), (1, 9), (3, 1)]:
        inputs = [token_batch(batch, length)]
        expected = guard.shape_env.evaluate_guards_expression(guard.expression, inputs)
        assert guard.fits(inputs) == expected
    assert guard.fits([token_batch(4, 13)]) and not guard.fits([token_batch(1, 9)])
