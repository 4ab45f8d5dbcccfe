"""Hooks on a rewritten model run as in eager: forward pre-hooks and forward hooks (with or without kwargs, changing
values, or working by side effect and reading values), full backward hooks, global module hooks, on submodules,
blocks or the model itself, registered before or after rewrite(), on every call and with autocast's values.
torch.compile traces them into the model's graphs and guards on them, so adding or removing one recompiles."""

import copy
import threading

import pytest
import torch
from torch import nn

import graphamp
from graphamp.torch_private import dynamo_traces_hook_table_subclasses
from conftest import CompiledCodeRecorder
from models import BlockStack, TwoLayer, gpt2, llama, token_batch
from training import TORCH_BEFORE_2_13, matmul_dtypes, relative_error

BF16_TOLERANCE = 2e-2
# graphamp's warnings that code ran eagerly, in float32, outside its graphs: none may pass unless a test expects it.
pytestmark = pytest.mark.filterwarnings("error:graphamp. :UserWarning")


def double_input(module, args):
    return (args[0] * 2,)


def shift_output(module, args, output):
    return output + 1.5


def shift_output_with_kwargs(module, args, kwargs, output):
    return output + 1.5


def register(model, kind):
    if kind == "pre":
        return model.fc1.register_forward_pre_hook(double_input)
    if kind == "forward":
        return model.fc2.register_forward_hook(shift_output)
    return model.fc2.register_forward_hook(shift_output_with_kwargs, with_kwargs=True)


def autocast_output(model, *args):
    with torch.autocast("cpu", torch.bfloat16):
        return model(*args).float()


def model_and_batch():
    torch.manual_seed(0)
    return TwoLayer(), torch.randn(8, 16)


@pytest.mark.parametrize("kind", ["pre", "forward", "forward_with_kwargs"])
def test_forward_hook_registered_before_rewrite_changes_values_as_in_eager(bf16, kind):
    model, x = model_and_batch()
    register(model, kind)
    eager = copy.deepcopy(model)  # its hooks copied with it
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    assert relative_error(model(x), autocast_output(eager, x)) < 1e-2
    assert set(matmul_dtypes(model)) == {torch.bfloat16}


@pytest.mark.parametrize("kind", ["pre", "forward", "forward_with_kwargs"])
def test_forward_hook_registered_after_rewrite_changes_values_as_in_eager(bf16, kind):
    model, x = model_and_batch()
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    without = model(x)
    register(model, kind)
    register(eager, kind)
    expected = autocast_output(eager, x)
    assert relative_error(model(x), expected) < 1e-2
    assert relative_error(without, expected) > 0.1  # the hook matters: the first graph would be wrong
    assert len(graphamp.rewritten_graphs(model)) == 2  # dynamo guards on the hooks and recompiled


def test_removed_hook_no_longer_changes_values(bf16):
    model, x = model_and_batch()
    eager = copy.deepcopy(model)
    handle = register(model, "forward")
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    handle.remove()
    assert relative_error(model(x), autocast_output(eager, x)) < 1e-2


def add_ten(module, args, output):
    return output + 10


def hook_registrations(model):
    """Three hooks, on the model and on its layers, in the order the other thread registers (and removes) them."""
    return [lambda: model.register_forward_hook(add_ten), lambda: model.fc1.register_forward_pre_hook(double_input),
            lambda: model.fc2.register_forward_hook(shift_output)]


@pytest.mark.skipif(not dynamo_traces_hook_table_subclasses(), reason=(
    "this torch's dynamo cannot trace a hook table that is a dict subclass, so graphamp leaves the tables plain and "
    "hooks changed by another thread can fail a call, as under torch.compile alone (docs/module_contract.md)"))
def test_hooks_that_another_thread_adds_and_removes_apply_to_each_call_as_of_one_moment(bf16):
    """Dynamo reads a module's hooks when it traces a call and again when it builds that call's guards: a hook added or
    removed in between failed the call (IndexError in dynamo's guard code, under torch.compile too). A rewritten
    model's hook tables change between its calls, so every call runs with some moment's hooks, as eager would."""
    model, x = model_and_batch()
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    expected = []  # autocast's output with each set of hooks the other thread passes through
    for chosen in ([], [0], [0, 1], [0, 1, 2], [1, 2], [2]):
        handles = [hook_registrations(eager)[i]() for i in chosen]
        expected.append(autocast_output(eager, x))
        for handle in handles:
            handle.remove()
    stop = threading.Event()

    def add_and_remove_hooks():
        while not stop.is_set():
            for handle in [register() for register in hook_registrations(model)]:
                handle.remove()

    thread = threading.Thread(target=add_and_remove_hooks)
    thread.start()
    try:
        outputs = [model(x) for _ in range(300)]
    finally:
        stop.set()
        thread.join()
    for output in outputs:
        assert min(relative_error(output, hooked) for hooked in expected) < BF16_TOLERANCE


def test_a_prepended_pre_hook_runs_before_the_others_as_in_eager(bf16):
    model, x = model_and_batch()
    model.fc1.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    for net in (model, eager):
        net.fc1.register_forward_pre_hook(double_input, prepend=True)  # 2x + 1, not 2(x + 1)
    assert relative_error(model(x), autocast_output(eager, x)) < 1e-2


def test_forward_hook_gradients_match_autocast(bf16):
    model, x = model_and_batch()
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    register(model, "pre")
    register(eager, "pre")
    model(x).square().sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        eager(x).float().square().sum().backward()
    assert relative_error(model.fc1.weight.grad, eager.fc1.weight.grad) < 1e-2


def record_into(calls):
    """A hook of each kind that returns None and records what it saw, reading a value as feature extractors do."""
    def pre(module, args):
        calls.append(("pre", round(args[0].float().sum().item(), 2)))

    def forward(module, args, output):
        calls.append(("forward", round(output.float().sum().item(), 2)))

    return pre, forward


@pytest.mark.skipif(
    TORCH_BEFORE_2_13, reason="torch 2.11's dynamo guards the length of the list a hook appends to and recompiles at "
    "every call; past its recompile limit the calls run eagerly, which graphamp reports (the test fails on the report)"
)
@pytest.mark.parametrize("registered", ["before", "after"])
def test_side_effect_and_value_reading_hooks_run_on_every_call_with_autocasts_values(bf16, registered):
    model, x = model_and_batch()
    inputs = [x, x * 2, x - 1]
    eager = copy.deepcopy(model)
    expected = []
    pre, forward = record_into(expected)
    eager.fc1.register_forward_pre_hook(pre)
    eager.fc2.register_forward_hook(forward)
    for x_ in inputs:
        autocast_output(eager, x_)

    calls = []
    pre, forward = record_into(calls)
    if registered == "after":
        graphamp.rewrite(model, (x,), amp_lists=bf16)
    model.fc1.register_forward_pre_hook(pre)
    model.fc2.register_forward_hook(forward)
    if registered == "before":
        graphamp.rewrite(model, (x,), amp_lists=bf16)
        calls.clear()  # the compile ahead ran them once
    for x_ in inputs:
        model(x_)

    assert [kind for kind, _ in calls] == [kind for kind, _ in expected]
    for (_, got), (_, want) in zip(calls, expected):
        assert abs(got - want) <= 2e-2 * max(1.0, abs(want))
    assert set(matmul_dtypes(model)) == {torch.bfloat16}  # .item() splits the graph; both matmuls stay low


def test_a_feature_extracting_hook_cleared_each_step_costs_no_recompile(bf16):
    model, x = model_and_batch()
    features = []
    model.fc1.register_forward_hook(lambda module, args, output: features.append(output))
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    for step in range(10):
        features.clear()
        model(x + step)
        assert len(features) == 1
    graphs = graphamp.rewritten_graphs(model)
    assert len(graphs) == 1 and graphs[0].runs == 11  # the compile ahead, then ten steps


def test_a_hook_filling_a_growing_list_warns_when_dynamo_gives_up_compiling(bf16):
    """Dynamo guards on the list's length: each call recompiles, and past its recompile limit the model would run
    eagerly in float32. graphamp says so rather than let it pass silently."""
    model, x = model_and_batch()
    features = []
    model.fc1.register_forward_hook(lambda module, args, output: features.append(output))
    graphamp.rewrite(model, amp_lists=bf16)
    with pytest.warns(UserWarning, match="ran none of graphamp's graphs"):
        for _ in range(torch._dynamo.config.recompile_limit + 2):
            model(x)


def test_a_forward_hook_on_the_layer_reading_the_models_input_sees_that_input(bf16):
    model, x = model_and_batch()
    seen = []
    model.fc1.register_forward_hook(lambda module, args, output: seen.append((args[0], output)))
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    model(x)
    (given, output), = seen
    seen.clear()
    autocast_output(eager, x)
    assert given is x
    assert relative_error(output, seen[0][1].float()) < 1e-2


def test_a_pre_hook_that_changes_a_keyword_argument_changes_values_as_in_eager(bf16):
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = TwoLayer()

        def forward(self, x, *, gate):
            return self.body(x) * gate

    def open_gate(module, args, kwargs):
        return args, {**kwargs, "gate": kwargs["gate"] + 1.0}

    torch.manual_seed(0)
    model, x, gate = Gated(), torch.randn(8, 16), torch.zeros(8, 1)
    model.register_forward_pre_hook(open_gate, with_kwargs=True)
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    with torch.autocast("cpu", torch.bfloat16):
        expected = eager(x, gate=gate).float()
    assert relative_error(model(x, gate=gate), expected) < 1e-2  # a closed gate would give zeros


def test_a_hook_returning_its_output_in_float32_keeps_the_next_matmul_low(bf16):
    """`return output.float()` (an upcast under autocast) is no cast at all in the FP32 trace: fc2 stays low."""
    model, x = model_and_batch()
    model.fc1.register_forward_hook(lambda module, args, output: output.float())
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    assert relative_error(model(x), autocast_output(eager, x)) < 1e-2
    assert matmul_dtypes(model) == [torch.bfloat16, torch.bfloat16]


def test_a_hook_on_the_models_root_runs_on_every_call(bf16):
    model, x = model_and_batch()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    model.register_forward_hook(lambda module, args, output: output * 0 + 1)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    seen.clear()
    for batch in (x, x[:3]):
        assert torch.equal(model(batch), torch.ones(batch.shape[0], 4))
    assert seen == [8, 3]


@pytest.mark.parametrize("registered", ["before", "after"])
def test_full_backward_hook_sees_the_gradients_autocast_sees(bf16, registered):
    model, x = model_and_batch()
    eager = copy.deepcopy(model)
    grads = []

    def record(module, grad_input, grad_output):
        grads.append(grad_output[0].float().clone())

    if registered == "after":
        graphamp.rewrite(model, (x,), amp_lists=bf16)
    model.fc2.register_full_backward_hook(record)
    eager.fc2.register_full_backward_hook(record)
    if registered == "before":
        graphamp.rewrite(model, (x,), amp_lists=bf16)
    for _ in range(2):  # fc2 runs outside the graphs, under the eager policy: the test below
        model(x).square().sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        eager(x).float().square().sum().backward()
    assert len(grads) == 3
    assert relative_error(grads[0], grads[2]) < 2e-2 and relative_error(grads[1], grads[2]) < 2e-2
    assert relative_error(model.fc1.weight.grad / 2, eager.fc1.weight.grad) < 2e-2


def test_a_module_with_a_full_backward_hook_runs_outside_the_graphs_under_the_eager_policy(bf16):
    """Dynamo does not trace a module with backward hooks (it asks for compiled autograd): fc2 runs eagerly, and
    graphamp's eager policy runs its linear low by the same lists."""
    model, x = model_and_batch()
    model.fc2.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    with CompiledCodeRecorder() as recorder:
        model(x)
    assert matmul_dtypes(model) == [torch.bfloat16]  # fc1, in the graph
    assert [c.in_dtypes[0] for c in recorder.calls_of("addmm")] == [torch.bfloat16] * 2  # fc1 and fc2


def test_hooks_on_a_module_and_on_a_module_inside_it_both_run_with_eagers_values(bf16):
    model, x = model_and_batch()
    outer = nn.Sequential(model)
    outer[0].register_forward_hook(shift_output)
    outer[0].fc1.register_forward_hook(lambda module, args, output: output * 2)
    eager = copy.deepcopy(outer)
    graphamp.rewrite(outer, (x,), amp_lists=bf16)
    assert relative_error(outer(x), autocast_output(eager, x)) < 1e-2


def test_a_global_forward_hook_runs_at_every_module_call_as_in_eager(bf16):
    """Registered before the model's first call: dynamo guards on global hooks only once it has traced some."""
    model, x = model_and_batch()
    eager = copy.deepcopy(model)
    seen = []

    def count_every_module(module, args, output):
        seen.append(type(module).__name__)

    handle = nn.modules.module.register_module_forward_hook(count_every_module)
    try:
        graphamp.rewrite(model, (x,), amp_lists=bf16)
        seen.clear()
        model(x)
        got = list(seen)
        seen.clear()
        autocast_output(eager, x)
    finally:
        handle.remove()
    assert got == seen == ["Linear", "Linear", "TwoLayer"]
    seen.clear()
    model(x)
    assert seen == []  # removed: no longer run


def test_backward_hook_on_the_rewritten_model_itself_runs_every_call(bf16):
    model, x = model_and_batch()
    graphamp.rewrite(model, (x.requires_grad_(),), amp_lists=bf16)
    calls = []
    model.register_full_backward_hook(lambda module, grad_input, grad_output: calls.append(grad_output[0].shape))
    for _ in range(2):
        model(x).sum().backward()
    assert calls == [torch.Size([8, 4])] * 2


def test_hf_output_hidden_states_match_autocast(bf16, seeded):
    model, ids = gpt2(n_layer=1, n_embd=32), token_batch()
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    with torch.autocast("cpu", torch.bfloat16):
        expected = eager(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hidden) == len(expected) == model.config.n_layer + 1
    assert all(relative_error(a, b.float()) < BF16_TOLERANCE for a, b in zip(hidden, expected))
    assert set(matmul_dtypes(model)) == {torch.bfloat16}


def test_a_hooked_model_trains_with_loss_scaling_in_the_graph_as_an_unhooked_one(fp16):
    grads = []
    for hooked in (False, True):
        model, x = model_and_batch()
        if hooked:
            model.fc1.register_forward_hook(lambda module, args, output: None)
        graphamp.rewrite(model, (x,), amp_lists=fp16)
        optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, init_loss_scaling=1024.0)
        model(x).float().square().mean().backward()  # plain backward: the graph scales and unscales
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    assert all(relative_error(a, b) < 1e-3 for a, b in zip(*grads))


def test_hooks_on_a_llamas_attention_and_mlp_run_on_every_call_with_autocasts_values(bf16, seeded):
    model, ids = llama(num_hidden_layers=1), token_batch()  # one layer: dynamo's time grows with them
    seen = []

    def record(module, args, output):
        seen.append((output[0] if isinstance(output, tuple) else output).float().abs().mean())

    for layer in model.model.layers:
        for module in (layer.self_attn, layer.mlp):
            module.register_forward_hook(record)
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    loss = model(input_ids=ids, labels=ids).loss
    got = list(seen)
    seen.clear()
    with torch.autocast("cpu", torch.bfloat16):
        expected_loss = eager(input_ids=ids, labels=ids).loss
    assert len(got) == len(seen) == 2 * model.config.num_hidden_layers
    assert all(relative_error(a, b) < BF16_TOLERANCE for a, b in zip(got, seen))
    assert relative_error(loss, expected_loss) < BF16_TOLERANCE


def test_a_hooked_llama_layer_with_the_cache_on_matches_autocast(bf16, seeded):
    model, ids = llama(), token_batch()
    model.model.layers[0].register_forward_hook(lambda module, args, output: output * 0.5)
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    out = model(input_ids=ids, labels=ids, use_cache=True)
    with torch.autocast("cpu", torch.bfloat16):
        expected = eager(input_ids=ids, labels=ids, use_cache=True)
    assert relative_error(out.loss, expected.loss) < BF16_TOLERANCE
    assert out.past_key_values.get_seq_length() == expected.past_key_values.get_seq_length() == ids.shape[1]


# -- hooks on blocks (what rewrite(regions=...) was for) ------------------------------------------------------------


def test_forward_hooks_on_a_block_run_on_every_call_with_the_blocks_arguments(bf16, seeded):
    model, tokens = BlockStack(), token_batch()
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda module, args: seen.append(("pre", tuple(args[0].shape))))
    model.blocks[1].register_forward_hook(lambda module, args, output: seen.append(("post", output.dtype)))
    graphamp.rewrite(model, (tokens, tokens), amp_lists=bf16)
    seen.clear()
    for _ in range(3):
        model(tokens, tokens)
    assert seen == [("pre", (2, 16, 64)), ("post", torch.float32)] * 3


def test_a_forward_hook_that_changes_a_blocks_output_changes_the_loss_as_in_eager(bf16, seeded):
    model, tokens = BlockStack(), token_batch()
    model.blocks[0].register_forward_hook(lambda module, args, output: output * 0.0)
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    with torch.autocast("cpu", torch.bfloat16):
        expected = eager(tokens, tokens)
    assert relative_error(model(tokens, tokens), expected) < BF16_TOLERANCE


def test_a_full_backward_hook_on_a_block_sees_the_gradient_autocast_sees(bf16, seeded):
    model, tokens = BlockStack(), token_batch()
    grad_outputs = []
    model.blocks[1].register_full_backward_hook(lambda module, grad_in, grad_out: grad_outputs.append(grad_out[0]))
    eager = copy.deepcopy(model)
    with torch.autocast("cpu", torch.bfloat16):
        eager(tokens, tokens).backward()
    graphamp.rewrite(model, amp_lists=bf16)
    model(tokens, tokens).backward()
    assert len(grad_outputs) == 2
    assert relative_error(grad_outputs[1], grad_outputs[0].float()) < BF16_TOLERANCE


def test_the_regions_argument_is_deprecated_and_hooks_on_blocks_still_run(bf16, seeded):
    model, tokens = BlockStack(), token_batch()
    calls = []
    model.blocks[0].register_forward_hook(lambda module, args, output: calls.append(1))
    with pytest.warns(DeprecationWarning, match="regions=.*ignored"):
        graphamp.rewrite(model, amp_lists=bf16, regions="blocks.*")
    model(tokens, tokens)
    assert calls == [1]
    assert set(matmul_dtypes(model)) == {torch.bfloat16}
