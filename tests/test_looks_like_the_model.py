"""To frameworks an AmpModule looks like the model it runs: class, forward's signature, saving, hooks."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import graphamp
from tests.models import gpt2, token_batch


def rewritten_gpt2(bf16):
    model = gpt2()
    ids = token_batch()
    return model, graphamp.rewrite(model, (), dict(input_ids=ids, labels=ids), amp_lists=bf16, progress=False)


def test_forward_signature_is_the_originals(bf16):
    model, amp_model = rewritten_gpt2(bf16)
    assert inspect.signature(amp_model.forward) == inspect.signature(model.forward)


def test_amp_module_is_an_instance_of_the_original_class(bf16):
    model, amp_model = rewritten_gpt2(bf16)
    assert isinstance(amp_model, type(model)) and isinstance(amp_model, graphamp.AmpModule)
    assert type(model).__name__ in type(amp_model).__name__


def test_trainer_finds_the_labels_from_the_class(bf16):
    from transformers.utils import find_labels

    _, amp_model = rewritten_gpt2(bf16)
    assert find_labels(type(amp_model)) == ["labels"]


def test_save_pretrained_loads_into_the_original_class(tmp_path, bf16):
    model, amp_model = rewritten_gpt2(bf16)
    amp_model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists()
    for a, b in zip(loaded.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_torch_save_of_the_state_dict_loads_into_the_original(tmp_path, bf16):
    model, amp_model = rewritten_gpt2(bf16)
    torch.save(amp_model.state_dict(), tmp_path / "weights.pt")
    fresh = gpt2()
    fresh.load_state_dict(torch.load(tmp_path / "weights.pt"))
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_forward_hooks_registered_on_the_amp_module_run(bf16):
    _, amp_model = rewritten_gpt2(bf16)
    seen = []
    amp_model.register_forward_hook(lambda module, args, kwargs, output: seen.append(output.loss), with_kwargs=True)
    ids = token_batch()
    out = amp_model(input_ids=ids, labels=ids)
    assert seen and seen[0] is out.loss


def test_plain_module_keeps_its_own_class_methods(bf16):
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    amp_model = graphamp.rewrite(net, torch.randn(2, 4), amp_lists=bf16, progress=False)
    assert isinstance(amp_model, nn.Sequential) and len(amp_model) == 2 and amp_model[0] is net[0]


def test_call_inside_autocast_raises_double_amp_error(bf16):
    net = nn.Linear(4, 4)
    amp_model = graphamp.rewrite(net, torch.randn(2, 4), amp_lists=bf16, progress=False)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(graphamp.DoubleAmpError, match="Turn one off"):
        amp_model(torch.randn(2, 4))
