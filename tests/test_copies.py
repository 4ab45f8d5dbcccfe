"""Copies of a rewritten model (copy.deepcopy for an EMA, pickle, torch.save/torch.load) work, own their
parameters, and give the original's outputs; they recapture on first use."""

import copy
import io
import pickle

import pytest
import torch

import graphamp
from models import TwoLayer, gpt2, token_batch


def rewritten_gpt2(amp_lists):
    torch.manual_seed(0)
    model = gpt2()
    ids = token_batch()
    return graphamp.rewrite(model, (), {"input_ids": ids}, amp_lists=amp_lists), ids


def through_torch_save(amp):
    buffer = io.BytesIO()
    torch.save(amp, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda amp: pickle.loads(pickle.dumps(amp)),
    "torch_save": through_torch_save,
}


@pytest.mark.parametrize("make_copy", COPIES.values(), ids=COPIES.keys())
def test_copy_gives_the_same_logits(bf16, make_copy):
    amp, ids = rewritten_gpt2(bf16)
    twin = make_copy(amp)
    assert isinstance(twin, graphamp.AmpModule)
    assert torch.equal(twin(input_ids=ids).logits, amp(input_ids=ids).logits)


@pytest.mark.parametrize("make_copy", COPIES.values(), ids=COPIES.keys())
def test_copy_owns_its_parameters(bf16, make_copy):
    amp, ids = rewritten_gpt2(bf16)
    twin = make_copy(amp)
    originals = {id(p) for p in amp.parameters()}
    assert not originals & {id(p) for p in twin.parameters()}
    assert [id(p) for p in twin.parameters()] == [id(p) for p in twin.original_module.parameters()]


def test_training_the_deepcopy_leaves_the_original_alone(bf16):
    amp, ids = rewritten_gpt2(bf16)
    ema = copy.deepcopy(amp)
    before = amp(input_ids=ids).logits.detach()
    with torch.no_grad():
        for parameter in ema.parameters():
            parameter.mul_(0.5)
    assert not torch.equal(ema(input_ids=ids).logits, before)
    assert torch.equal(amp(input_ids=ids).logits, before)


def test_a_hooked_model_copies_and_its_hooks_run_on_the_copy(bf16):
    torch.manual_seed(0)
    model, x = TwoLayer(), torch.randn(8, 16)
    calls = []
    model.fc1.register_forward_hook(lambda module, args, output: calls.append(1))
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    copied = copy.deepcopy(amp)
    calls.clear()
    copied(x), amp(x)
    assert len(calls) == 2 and copied._regions is not None
