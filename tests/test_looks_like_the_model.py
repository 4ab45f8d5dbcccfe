"""A rewritten model is the model: rewrite() returns the same object, its class, forward's signature, state_dict
keys, saving and hooks unchanged, so frameworks that inspect it (HF Trainer, save_pretrained) see no difference."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

import graphamp
from models import gpt2, token_batch


@pytest.fixture(scope="module")
def rewritten_gpt2():
    """(a rewritten GPT-2 the tests only read, an FP32 copy of it made before rewrite)."""
    torch.manual_seed(0)
    model = gpt2(n_layer=1, n_embd=32)
    fp32 = copy.deepcopy(model)
    ids = token_batch()
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
    return graphamp.rewrite(model, (), dict(input_ids=ids, labels=ids), amp_lists=lists), fp32


def test_rewrite_returns_the_same_object_of_the_same_class(bf16):
    torch.manual_seed(0)
    model = gpt2(n_layer=1, n_embd=32)
    original_class = type(model)
    assert graphamp.rewrite(model, amp_lists=bf16) is model
    assert type(model) is original_class


def test_forward_signature_is_the_originals(rewritten_gpt2):
    model, fp32 = rewritten_gpt2
    assert inspect.signature(model.forward) == inspect.signature(fp32.forward)


def test_state_dict_keys_are_the_originals(rewritten_gpt2):
    """No `_orig_mod.` prefix as torch.compile(model)'s wrapper gives: checkpoints load into the FP32 class."""
    model, fp32 = rewritten_gpt2
    assert list(model.state_dict()) == list(fp32.state_dict())
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in fp32.named_parameters()]


def test_trainer_finds_the_labels_from_the_class(rewritten_gpt2):
    from transformers.utils import find_labels

    model, _ = rewritten_gpt2
    assert find_labels(type(model)) == ["labels"]


def test_save_pretrained_loads_into_the_original_class(tmp_path, rewritten_gpt2):
    model, _ = rewritten_gpt2
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists()
    assert not graphamp.is_rewritten(loaded)  # a plain FP32 model: rewrite it to train it in mixed precision
    for (name, a), b in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_torch_save_of_the_state_dict_loads_into_the_original(tmp_path, rewritten_gpt2):
    model, _ = rewritten_gpt2
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    fresh = gpt2(n_layer=1, n_embd=32)
    fresh.load_state_dict(torch.load(tmp_path / "weights.pt"))
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_forward_hooks_registered_on_the_rewritten_model_run(rewritten_gpt2):
    model, _ = rewritten_gpt2
    seen = []
    handle = model.register_forward_hook(
        lambda module, args, kwargs, output: seen.append(output.loss), with_kwargs=True
    )
    ids = token_batch()
    try:
        out = model(input_ids=ids, labels=ids)
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], out.loss)


def test_plain_module_keeps_its_own_class_methods(bf16):
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    first = net[0]
    graphamp.rewrite(net, torch.randn(2, 4), amp_lists=bf16)
    assert type(net) is nn.Sequential and len(net) == 2 and net[0] is first


def test_rewriting_a_rewritten_model_is_refused_with_the_fix(bf16):
    net = nn.Linear(4, 4)
    graphamp.rewrite(net, amp_lists=bf16)
    with pytest.raises(graphamp.ArgumentError, match="already rewritten"):
        graphamp.rewrite(net, amp_lists=bf16)


def test_call_inside_autocast_raises_double_amp_error(bf16):
    net = nn.Linear(4, 4)
    graphamp.rewrite(net, torch.randn(2, 4), amp_lists=bf16)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(graphamp.DoubleAmpError, match="Turn one off"):
        net(torch.randn(2, 4))
