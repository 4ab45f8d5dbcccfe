"""Hooks on submodules: forward pre-hooks and forward hooks (with or without kwargs), registered before or after
rewrite, change values as in eager on every call; removing one takes its effect away; backward hooks, which a
graph cannot run, raise HookError naming the hook."""

import pytest
import torch

import graphamp
from models import TwoLayer, gpt2, token_batch
from training import relative_error


def double_input(module, args):
    return (args[0] * 2,)


def shift_output(module, args, output):
    return output + 1.5


def shift_output_with_kwargs(module, args, kwargs, output):
    return output + 1.5


def print_gradients(module, grad_input, grad_output):
    print(grad_output)


def register(model, kind):
    if kind == "pre":
        return model.fc1.register_forward_pre_hook(double_input)
    if kind == "forward":
        return model.fc2.register_forward_hook(shift_output)
    return model.fc2.register_forward_hook(shift_output_with_kwargs, with_kwargs=True)


def autocast_output(model, x):
    with torch.autocast("cpu", torch.bfloat16):
        return model(x).float()


def model_and_batch():
    torch.manual_seed(0)
    return TwoLayer(), torch.randn(8, 16)


@pytest.mark.parametrize("kind", ["pre", "forward", "forward_with_kwargs"])
def test_forward_hook_registered_before_rewrite_changes_values_as_in_eager(bf16, kind):
    model, x = model_and_batch()
    register(model, kind)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    assert relative_error(amp(x), autocast_output(model, x)) < 1e-2


@pytest.mark.parametrize("kind", ["pre", "forward", "forward_with_kwargs"])
def test_forward_hook_registered_after_rewrite_changes_values_as_in_eager(bf16, kind):
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    without = amp(x)
    register(model, kind)
    expected = autocast_output(model, x)
    assert relative_error(amp(x), expected) < 1e-2
    assert relative_error(without, expected) > 0.1  # the hook matters: the old graph would be wrong


def test_removed_hook_no_longer_changes_values(bf16):
    model, x = model_and_batch()
    handle = register(model, "forward")
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    handle.remove()
    assert relative_error(amp(x), autocast_output(model, x)) < 1e-2


def test_forward_hook_gradients_match_eager(bf16):
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    register(model, "pre")
    amp(x).square().sum().backward()
    graphamp_grad = model.fc1.weight.grad.clone()
    model.zero_grad()
    with torch.autocast("cpu", torch.bfloat16):
        model(x).float().square().sum().backward()
    assert relative_error(graphamp_grad, model.fc1.weight.grad) < 1e-2


def test_full_backward_hook_registered_before_rewrite_raises_hook_error(bf16):
    model, x = model_and_batch()
    model.fc2.register_full_backward_hook(print_gradients)
    with pytest.raises(graphamp.HookError, match=r"'print_gradients' .*submodule 'fc2'"):
        graphamp.rewrite(model, (x,), amp_lists=bf16)


def test_full_backward_hook_registered_after_rewrite_raises_hook_error(bf16):
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    model.fc1.register_full_backward_hook(print_gradients)
    with pytest.raises(graphamp.HookError, match="backward hook on submodule 'fc1'"):
        amp(x)


def test_backward_hook_on_the_amp_module_itself_runs_every_call(bf16):
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x.requires_grad_(),), amp_lists=bf16)
    calls = []
    amp.register_full_backward_hook(lambda module, grad_input, grad_output: calls.append(grad_output[0].shape))
    for _ in range(2):
        amp(x).sum().backward()
    assert calls == [torch.Size([8, 4])] * 2


def test_side_effect_hook_is_reported_at_capture(bf16):
    model, x = model_and_batch()
    recorded = []
    model.fc1.register_forward_hook(lambda module, args, output: recorded.append(output.shape))
    with pytest.warns(UserWarning, match=r"forward hook .* on submodule 'fc1' returned None"):
        graphamp.rewrite(model, (x,), amp_lists=bf16)


def test_hf_output_capturing_hooks_are_not_reported(bf16, recwarn):
    torch.manual_seed(0)
    model = gpt2()
    ids = token_batch()
    amp = graphamp.rewrite(model, (), {"input_ids": ids, "output_hidden_states": True}, amp_lists=bf16)
    hidden = amp(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hidden) == model.config.n_layer + 1
    assert not [w for w in recwarn if "returned None" in str(w.message)]


def test_model_fingerprint_changes_with_every_hook_added_removed_or_prepended():
    """The per-call check is cheap for modules with no hook, and still sees each hook edit, prepended ones included."""
    from graphamp.runtime.fingerprint import module_fingerprint

    model = TwoLayer()
    bare = module_fingerprint(model)
    first = model.fc1.register_forward_hook(lambda module, args, output: output)
    with_one = module_fingerprint(model)
    assert with_one != bare
    second = model.fc1.register_forward_hook(lambda module, args, output: output)
    first.remove()
    assert module_fingerprint(model) not in (bare, with_one)  # as many hooks as before, not the same one
    before_prepend = module_fingerprint(model)
    model.fc1.register_forward_pre_hook(lambda module, args: None, prepend=True)
    assert module_fingerprint(model) != before_prepend
    second.remove()
    assert module_fingerprint(model) not in (bare, before_prepend)
