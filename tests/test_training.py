"""Mixed precision against FP32 on CPU: one forward/backward, then a few training steps per model.

Each comparison starts both runs from the same weights (a deepcopy taken before rewrite) and feeds the same data.
Errors are relative: ||a - b|| / ||b|| for tensors, |a - b| / |b| for losses. bfloat16 runs the real models;
float16 runs tiny ones only, since float16 matmuls on CPU are ~100x slower.
"""

import copy
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from models import (
    CustomOpModel,
    InputGatedRegionsModel,
    LSTMClassifier,
    SmallResNet,
    bert,
    digits,
    gpt2,
    token_batch,
)
from training import adamw, hf_loss, mean_loss_of_first_and_last_epoch, relative_error, sgd

# Measured on this CPU (torch 2.13) at the seeds the tests use, with the worst of 5 seeds (of the weights) in
# brackets; tolerances are 2x-5x the worst measured value.
# The GPT-2 figures are a two-layer model's; the tests run one-layer GPT-2 and BERT, and the one-layer GPT-2 measures
# about the same: logits 3.6e-3, gradients 4.6e-3, loss 1.9e-5, training 8.5e-5 (2026-11-28).

# One forward/backward. bfloat16 keeps 8 bits of mantissa: ~2^-8 = 4e-3 relative error per rounding, which averages
# out over long dot products rather than adding up. Measured: GPT-2 logits 3.7e-3 [3.8e-3], gradients 4.8e-3
# [5.1e-3]; SmallResNet logits 4.4e-3 [5.4e-3], head gradient 6.8e-3 [7.5e-3].
BF16_OUTPUT_RTOL = 2e-2
BF16_GRADIENT_RTOL = 2e-2
# A loss is a mean over many terms, so its rounding errors mostly cancel. Measured: GPT-2 2.5e-5 [4.8e-5],
# SmallResNet 1.9e-4 [2.2e-4].
BF16_LOSS_RTOL = 1e-3
# An output that went through bfloat16 differs from FP32 by about bfloat16's rounding: the GPT-2 logits' error is
# 3.5e-3 at least [over 5 seeds]; an all-FP32 run would give ~1e-7, a float16 one ~5e-4.
BF16_ROUNDING_FLOOR = 1e-3
# SmallResNet's gradients go back through train-mode BatchNorm on 8 samples, which subtracts the batch mean of the
# gradient: most of it cancels and the bfloat16 rounding of the convolutions is what remains. Measured 8.8e-2
# [1.0e-1]. torch.autocast(bfloat16) gives the same gradients, bit for bit, so the ratio of the two errors is 1.00.
RESNET_BF16_GRADIENT_RTOL = 0.3
AUTOCAST_ERROR_RATIO = 1.5

# float16 keeps 11 bits: ~2^-11 = 5e-4 per rounding. Measured on the tiny Tanh MLP and CNN: outputs 4.1e-4 and
# 4.9e-4 [5.7e-4], losses 5.9e-6 and 2.2e-6 [4.6e-5], gradients 1.4e-3 and 1.3e-3 in the worst single parameter
# [3.7e-3: the CNN's bias gradient, a sum over 64 positions].
FP16_OUTPUT_RTOL = 2e-3
FP16_LOSS_RTOL = 2e-4
FP16_GRADIENT_RTOL = 8e-3
# The outputs' error is 4.1e-4 at least [over 5 seeds]; an all-FP32 run would give ~1e-7.
FP16_ROUNDING_FLOOR = 1e-4

# Training: the last epoch's mean loss after TRAINING_STEPS steps, relative to the FP32 run's. The runs drift apart
# as updates compound, but a few steps keep them close. Measured, bfloat16: GPT-2 4.9e-5 [1.3e-4], BERT 9.6e-5
# [2.4e-4], SmallResNet on digits 4.3e-4 [5.6e-4], LSTM 6.6e-4 [2.2e-3], custom op 3.2e-4 [3.2e-4], regions 4.7e-5
# [2.1e-4]; float16 with loss scaling: MLP 2.6e-5 [4.6e-5], CNN 2.0e-4 [2.7e-4].
TRAINING_STEPS = 8
BF16_TRAINING_LOSS_RTOL = 5e-3
FP16_TRAINING_LOSS_RTOL = 1e-3


def one_layer_gpt2():
    """GPT-2 with one block: each block rounds alike, and dynamo's time grows with the blocks."""
    return gpt2(n_layer=1)


def gradients(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def lists(dtype):
    return graphamp.AutoMixedPrecisionLists(dtype=dtype)


def tiny_mlp():
    # Tanh, not ReLU: a ReLU whose input rounds across zero flips a whole gradient entry.
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def tiny_cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 8 * 8, 4))


TINY_MODELS = {"mlp": (tiny_mlp, (8, 16)), "cnn": (tiny_cnn, (8, 1, 8, 8))}


class Step(NamedTuple):
    """One forward/backward of a rewritten model and of its FP32 twin (`reference`, `expected`, `expected_loss`)."""

    model: nn.Module
    out: object
    loss: torch.Tensor
    reference: nn.Module
    expected: object
    expected_loss: torch.Tensor


def one_step(build, dtype, args, kwargs, loss_fn):
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, args, kwargs, amp_lists=lists(dtype))
    out, expected = model(*args, **kwargs), reference(*args, **kwargs)
    loss, expected_loss = loss_fn(out), loss_fn(expected)
    loss.backward()
    expected_loss.backward()
    return Step(model, out, loss, reference, expected, expected_loss)


# Each step is shared by the tests that read it (none changes it): one rewrite per model for the file.

@pytest.fixture(scope="module")
def gpt2_step():
    ids = token_batch(2, 16)
    return one_step(one_layer_gpt2, "bfloat16", (), {"input_ids": ids, "labels": ids}, lambda out: out.loss)


def resnet_batch():
    return torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def resnet_step():
    return one_step(SmallResNet, "bfloat16", (resnet_batch(),), {}, lambda out: F.cross_entropy(out, torch.arange(8)))


@pytest.fixture(scope="module", params=TINY_MODELS)
def tiny_step(request):
    build, shape = TINY_MODELS[request.param]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    return one_step(build, "float16", (x,), {}, lambda out: F.cross_entropy(out, torch.arange(8) % 4))


# -- one forward/backward in bfloat16 ----------------------------------------------------------------------------

def test_bf16_gpt2_logits_and_loss_match_fp32(gpt2_step):
    step = gpt2_step

    assert relative_error(step.out.logits, step.expected.logits) < BF16_OUTPUT_RTOL
    assert relative_error(step.loss, step.expected_loss) < BF16_LOSS_RTOL


def test_bf16_gpt2_logits_carry_bfloat16_rounding(gpt2_step):
    step = gpt2_step

    assert relative_error(step.out.logits, step.expected.logits) > BF16_ROUNDING_FLOOR


def test_bf16_gpt2_gradients_match_fp32(gpt2_step):
    step = gpt2_step

    assert relative_error(gradients(step.model), gradients(step.reference)) < BF16_GRADIENT_RTOL


def test_bf16_resnet_logits_and_loss_match_fp32(resnet_step):
    step = resnet_step

    assert relative_error(step.out, step.expected) < BF16_OUTPUT_RTOL
    assert relative_error(step.loss, step.expected_loss) < BF16_LOSS_RTOL


def test_bf16_resnet_gradients_match_fp32(resnet_step):
    step = resnet_step

    assert relative_error(gradients(step.model), gradients(step.reference)) < RESNET_BF16_GRADIENT_RTOL
    # The head's gradient has not gone back through any BatchNorm yet.
    assert relative_error(step.model.fc.weight.grad, step.reference.fc.weight.grad) < BF16_GRADIENT_RTOL


def test_bf16_resnet_gradient_error_is_no_larger_than_autocasts(resnet_step):
    torch.manual_seed(0)
    autocast_model = SmallResNet()  # the same weights as resnet_step's, from the same seed
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(autocast_model(resnet_batch()), torch.arange(8))
    loss.backward()
    step = resnet_step

    graphamp_error = relative_error(gradients(step.model), gradients(step.reference))
    autocast_error = relative_error(gradients(autocast_model), gradients(step.reference))

    assert graphamp_error < AUTOCAST_ERROR_RATIO * autocast_error


# -- one forward/backward in float16 -----------------------------------------------------------------------------

def test_fp16_tiny_model_output_and_loss_match_fp32(tiny_step):
    step = tiny_step

    assert relative_error(step.out, step.expected) < FP16_OUTPUT_RTOL
    assert relative_error(step.loss, step.expected_loss) < FP16_LOSS_RTOL


def test_fp16_tiny_model_output_carries_float16_rounding(tiny_step):
    step = tiny_step

    assert BF16_ROUNDING_FLOOR > relative_error(step.out, step.expected) > FP16_ROUNDING_FLOOR


def test_fp16_tiny_model_gradients_match_fp32(tiny_step):
    step = tiny_step

    for parameter, expected in zip(step.model.parameters(), step.reference.parameters()):
        assert relative_error(parameter.grad, expected.grad) < FP16_GRADIENT_RTOL


# -- a few training steps ----------------------------------------------------------------------------------------

def train(model, batches, loss_fn, make_optimizer, amp_lists=None, loss_scaling=False):
    """TRAINING_STEPS steps cycling over `batches`; the mean loss of the first and of the last epoch."""
    if amp_lists is not None:
        graphamp.rewrite(model, *batches[0][:2], amp_lists=amp_lists)
    optimizer = make_optimizer(model.parameters())
    if loss_scaling:
        optimizer = graphamp.decorate(optimizer, amp_lists=amp_lists, model=model)
    first, last = mean_loss_of_first_and_last_epoch(model, optimizer, batches, loss_fn, TRAINING_STEPS)
    return first, last, optimizer


def gpt2_training():
    ids = token_batch(4, 16)
    return one_layer_gpt2, [((), {"input_ids": ids, "labels": ids}, None)], hf_loss, adamw(1e-3)


def bert_training():
    ids = token_batch(4, 16)
    mask = torch.ones_like(ids)
    mask[:, 12:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 1])}
    return lambda: bert(num_hidden_layers=1), [((), batch, None)], hf_loss, adamw(1e-3)


def resnet_digits_training():
    images, labels = digits(256)
    batches = [((images[i : i + 64],), {}, labels[i : i + 64]) for i in range(0, 256, 64)]
    return SmallResNet, batches, F.cross_entropy, sgd(0.1, momentum=0.9)


def lstm_training():
    tokens = token_batch(16, 12, seed=3)
    return LSTMClassifier, [((tokens,), {}, tokens[:, -1] % 4)], F.cross_entropy, adamw(1e-2)


def custom_op_training():
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)
    return CustomOpModel, [((x,), {}, y)], F.mse_loss, sgd(0.1)


def regions_training():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=generator)
    x = x * x.sum().sign()  # the cond takes its true branch on x, its false branch on -x: both train
    y, y_negative = torch.randn(16, 8, generator=generator), torch.randn(16, 8, generator=generator)
    return InputGatedRegionsModel, [((x,), {}, y), ((-x,), {}, y_negative)], F.mse_loss, sgd(0.1)


BF16_TRAINING = {
    "gpt2": gpt2_training,
    "bert": bert_training,
    "resnet-digits": resnet_digits_training,
    "lstm": lstm_training,
    "custom-op": custom_op_training,
    "regions": regions_training,
}


@pytest.mark.parametrize("case", BF16_TRAINING.values(), ids=BF16_TRAINING.keys())
def test_bf16_training_loss_decreases_and_tracks_fp32(case):
    build, batches, loss_fn, make_optimizer = case()
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)

    first, last, _ = train(model, batches, loss_fn, make_optimizer, lists("bfloat16"))
    _, expected_last, _ = train(reference, batches, loss_fn, make_optimizer)

    assert last < first
    assert relative_error(last, expected_last) < BF16_TRAINING_LOSS_RTOL


@pytest.mark.parametrize("name", TINY_MODELS)
def test_fp16_training_with_loss_scaling_decreases_and_tracks_fp32(name):
    build, shape = TINY_MODELS[name]
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, *shape[1:], generator=generator), torch.randint(0, 4, (32,), generator=generator)
    batches = [((x,), {}, y)]
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)

    first, last, optimizer = train(model, batches, F.cross_entropy, sgd(0.5), lists("float16"), loss_scaling=True)
    _, expected_last, _ = train(reference, batches, F.cross_entropy, sgd(0.5))

    assert optimizer.skipped_steps == 0  # every step updated, as in the FP32 run
    assert last < first
    assert relative_error(last, expected_last) < FP16_TRAINING_LOSS_RTOL


def test_bf16_output_of_one_rewritten_model_trains_the_next_as_in_fp32(seeded):
    """A rewritten encoder's FP32 output feeds a rewritten head: both get FP32 gradients through the pair."""
    encoder, head = tiny_mlp(), nn.Linear(4, 3)
    reference_encoder, reference_head = copy.deepcopy(encoder), copy.deepcopy(head)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    graphamp.rewrite(encoder, (x,), amp_lists=lists("bfloat16"))
    graphamp.rewrite(head, (torch.randn(8, 4),), amp_lists=lists("bfloat16"))

    features = encoder(x)
    out = head(features)
    expected = reference_head(reference_encoder(x))
    out.square().mean().backward()
    expected.square().mean().backward()

    assert features.dtype == out.dtype == torch.float32
    assert relative_error(out, expected) < BF16_OUTPUT_RTOL
    for model, reference in ((encoder, reference_encoder), (head, reference_head)):
        assert relative_error(gradients(model), gradients(reference)) < BF16_GRADIENT_RTOL
