"""Hooks on submodules and on the model: forward pre-hooks and forward hooks (with or without kwargs, changing
values, or working by side effect and reading values), and full backward hooks, registered before or after
rewrite, run on every call with eager's values (their modules are called as modules); removing one takes its
effect away; hooks that cannot be honoured (global ones, hooks on modules inside each other) raise HookError."""

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


def record_into(calls):
    """A hook of each kind that returns None and records what it saw, reading a value as feature extractors do."""
    def pre(module, args):
        calls.append(("pre", round(args[0].float().sum().item(), 2)))

    def forward(module, args, output):
        calls.append(("forward", round(output.float().sum().item(), 2)))

    return pre, forward


def eager_calls(model, inputs, autocast=True):
    calls = []
    pre, forward = record_into(calls)
    handles = [model.fc1.register_forward_pre_hook(pre), model.fc2.register_forward_hook(forward)]
    for x in inputs:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            model(x)
    for handle in handles:
        handle.remove()
    return calls


@pytest.mark.parametrize("registered", ["before", "after"])
def test_side_effect_and_value_reading_hooks_run_on_every_call_with_eagers_values(bf16, registered):
    model, x = model_and_batch()
    inputs = [x, x * 2, x - 1]
    expected = eager_calls(model, inputs)
    calls = []
    pre, forward = record_into(calls)
    if registered == "after":
        amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    model.fc1.register_forward_pre_hook(pre)
    model.fc2.register_forward_hook(forward)
    if registered == "before":
        amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
        calls.clear()  # rewrite's capture runs no hook, but the count below is per call
    for x_ in inputs:
        amp(x_)
    assert [kind for kind, _ in calls] == [kind for kind, _ in expected]
    for (_, got), (_, want) in zip(calls, expected):
        assert abs(got - want) <= 2e-2 * max(1.0, abs(want))


def test_a_hook_on_the_models_root_runs_on_every_call(bf16):
    model, x = model_and_batch()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    model.register_forward_hook(lambda module, args, output: output * 0 + 1)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    seen.clear()
    for batch in (x, x[:3]):
        assert torch.equal(amp(batch), torch.ones(batch.shape[0], 4))
    assert seen == [8, 3]


@pytest.mark.parametrize("registered", ["before", "after"])
def test_full_backward_hook_sees_the_gradients_eager_sees(bf16, registered):
    model, x = model_and_batch()
    grads = []

    def record(module, grad_input, grad_output):
        grads.append(grad_output[0].float().clone())

    if registered == "after":
        amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    handle = model.fc2.register_full_backward_hook(record)
    if registered == "before":
        amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    for _ in range(2):
        amp(x).square().sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        model(x).float().square().sum().backward()
    handle.remove()
    assert len(grads) == 3
    assert relative_error(grads[0], grads[2]) < 2e-2 and relative_error(grads[1], grads[2]) < 2e-2


def test_hooks_on_modules_inside_each_other_raise_hook_error_naming_both(bf16):
    model, x = model_and_batch()
    outer = torch.nn.Sequential(model)
    outer[0].register_forward_hook(lambda module, args, output: None)
    outer[0].fc1.register_forward_hook(lambda module, args, output: None)
    with pytest.raises(graphamp.HookError, match=r"'0.fc1' .* inside '0'"):
        graphamp.rewrite(outer, (x,), amp_lists=bf16)


def test_a_global_forward_hook_raises_hook_error_naming_it(bf16):
    model, x = model_and_batch()

    def count_every_module(module, args, output):
        return None

    handle = torch.nn.modules.module.register_module_forward_hook(count_every_module)
    try:
        with pytest.raises(graphamp.HookError, match=r"count_every_module' .* global forward hook"):
            graphamp.rewrite(model, (x,), amp_lists=bf16)
    finally:
        handle.remove()


def test_backward_hook_on_the_amp_module_itself_runs_every_call(bf16):
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x.requires_grad_(),), amp_lists=bf16)
    calls = []
    amp.register_full_backward_hook(lambda module, grad_input, grad_output: calls.append(grad_output[0].shape))
    for _ in range(2):
        amp(x).sum().backward()
    assert calls == [torch.Size([8, 4])] * 2


def test_hf_output_capturing_hooks_stay_in_the_graph(bf16):
    torch.manual_seed(0)
    model = gpt2()
    ids = token_batch()
    amp = graphamp.rewrite(model, (), {"input_ids": ids, "output_hidden_states": True}, amp_lists=bf16)
    hidden = amp(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hidden) == model.config.n_layer + 1
    assert amp._regions is None  # library hooks feed forward's outputs: no module is called on its own


def test_a_hooked_model_trains_with_loss_scaling_in_the_graph_as_an_unhooked_one(bf16):
    fp16 = graphamp.AutoMixedPrecisionLists(dtype="float16")
    grads = []
    for hooked in (False, True):
        model, x = model_and_batch()
        if hooked:
            model.fc1.register_forward_hook(lambda module, args, output: None)
        amp = graphamp.rewrite(model, (x,), amp_lists=fp16)
        optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=1024.0)
        amp(x).float().square().mean().backward()  # plain backward: the graph scales and unscales
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        assert (amp._regions is not None) == hooked
    assert all(relative_error(a, b) < 1e-3 for a, b in zip(*grads))


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


def test_hooks_on_a_llamas_attention_and_mlp_run_on_every_call_with_eagers_values(bf16):
    from models import llama

    torch.manual_seed(0)
    model, ids = llama(), token_batch()
    seen = []
    for layer in model.model.layers:
        for module in (layer.self_attn, layer.mlp):
            module.register_forward_hook(lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out).float().abs().mean().item()))
    amp = graphamp.rewrite(model, (), {"input_ids": ids, "labels": ids}, amp_lists=bf16)
    seen.clear()
    loss = amp(input_ids=ids, labels=ids).loss
    got = list(seen)
    seen.clear()
    with torch.autocast("cpu", torch.bfloat16):
        expected_loss = model(input_ids=ids, labels=ids).loss
    assert len(got) == len(seen) == 4
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(got, seen))
    assert relative_error(loss, expected_loss) < 2e-2


def test_a_hooked_block_that_takes_a_cache_object_raises_capture_error_with_the_fix(bf16):
    from models import llama

    model, ids = llama(), token_batch()
    model.model.layers[0].register_forward_hook(lambda m, a, out: None)
    with pytest.raises(graphamp.CaptureError, match="use_cache=False"):
        graphamp.rewrite(model, (), {"input_ids": ids, "labels": ids, "use_cache": True}, amp_lists=bf16)
