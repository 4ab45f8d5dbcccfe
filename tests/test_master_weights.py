"""Master weights: the rewritten model trains its own FP32 parameters and buffers, and every call reads them as they
are now (an in-place write, a `.data` write, load_state_dict, an optimizer step are seen at the next call)."""

import copy
import warnings

import pytest
import torch
from torch import nn

import graphamp
from graphamp import ArgumentError
from graphamp.policy import dtypes


class ConvNet(nn.Module):
    """A convolution, BatchNorm (running statistics: FP32 buffers), a linear head: quick for dynamo to trace."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(self.stem(x).flatten(1))


def convnet_and_batch():
    torch.manual_seed(0)
    return ConvNet(), torch.randn(8, 1, 8, 8)


@pytest.fixture
def rewritten_convnet(bf16):
    """(the ConvNet rewritten for bfloat16, its batch)."""
    model, x = convnet_and_batch()
    return graphamp.rewrite(model, (x,), amp_lists=bf16), x


def test_rewrite_returns_the_model_itself_with_its_parameters_and_buffers(bf16):
    model, x = convnet_and_batch()
    parameters, buffers = [id(p) for p in model.parameters()], [id(b) for b in model.buffers()]
    assert graphamp.rewrite(model, (x,), amp_lists=bf16) is model
    assert type(model) is ConvNet
    assert [id(p) for p in model.parameters()] == parameters
    assert [id(b) for b in model.buffers()] == buffers
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_an_optimizer_built_before_rewrite_updates_the_model(bf16):
    model, x = convnet_and_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.fc.weight.detach().clone()
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    model(x).square().mean().backward()
    optimizer.step()
    assert not torch.equal(model.fc.weight, before)


def test_gradients_arrive_in_fp32_on_every_parameter(rewritten_convnet):
    model, x = rewritten_convnet
    model(x).square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_frozen_parameters_get_no_gradient_and_the_others_train(bf16):
    model, x = convnet_and_batch()
    model.stem.requires_grad_(False)  # a frozen part (a LoRA base, say)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    model(x).square().mean().backward()
    assert all(p.grad is None for p in model.stem.parameters())
    assert all(p.grad is not None for p in model.fc.parameters())


def test_state_dict_has_the_fp32_models_keys_and_loads_into_a_fresh_model(bf16):
    model, x = convnet_and_batch()
    keys = list(model.state_dict())
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    model(x).square().mean().backward()
    state = model.state_dict()
    assert list(state) == keys
    fresh = ConvNet()
    fresh.load_state_dict(state)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_load_state_dict_into_the_rewritten_model_is_seen_at_the_next_call(rewritten_convnet):
    model, x = rewritten_convnet
    other = ConvNet()
    model.load_state_dict(other.state_dict())
    assert torch.equal(model.fc.weight, other.fc.weight)
    model.eval(), other.eval()
    with torch.autocast("cpu", torch.bfloat16):
        expected = other(x).float()
    torch.testing.assert_close(model(x), expected, rtol=3e-2, atol=3e-2)


def test_batch_norm_statistics_update_as_in_the_fp32_model(bf16):
    model, x = convnet_and_batch()
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    for _ in range(3):
        model(x)
        reference(x)
    for (name, ours), theirs in zip(model.named_buffers(), reference.buffers()):
        assert ours.dtype == theirs.dtype, name
        if name.endswith("num_batches_tracked"):
            assert ours.item() == theirs.item() == 3
        else:  # bf16 activations feed fp32 statistics: close, not bit-identical
            torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)


def test_buffers_stay_fp32_after_training_steps(rewritten_convnet):
    model, x = rewritten_convnet
    model(x).square().mean().backward()
    float_buffers = [b for b in model.buffers() if b.is_floating_point()]
    assert float_buffers and all(b.dtype == torch.float32 for b in float_buffers)


def test_eval_mode_leaves_batch_norm_statistics_alone(rewritten_convnet):
    model, x = rewritten_convnet
    model.eval()
    before = {n: b.clone() for n, b in model.named_buffers()}
    with torch.no_grad():
        model(x)
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())


# -- every call reads the weights as they are now -------------------------------------------------------------------


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def mlp_batch(seed=0):
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))


def output_after(change, amp_lists):
    """The rewritten MLP's output before and after `change(model)`, and a fresh copy's on the changed weights (a
    deepcopy of a rewritten model is rewritten, with graphs of its own)."""
    model, x = mlp(), mlp_batch()
    graphamp.rewrite(model, (x,), amp_lists=amp_lists)
    before = model(x)
    change(model)
    return before, model(x), copy.deepcopy(model)(x)


def double_under_no_grad(model):
    with torch.no_grad():
        model[0].weight.mul_(2)


def write_through_data(model):
    model[0].weight.data.mul_(2)


def replace_data(model):
    model[2].weight.data = torch.randn(32, 32)


def load_other_weights(model):
    model.load_state_dict(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                        nn.Linear(32, 4)).state_dict())


@pytest.mark.parametrize(
    "change", [double_under_no_grad, write_through_data, replace_data, load_other_weights],
    ids=["in_place_write", "write_through_data", "data_replaced", "load_state_dict"],
)
def test_a_write_to_the_weights_is_seen_at_the_next_call(bf16, change):
    before, after, fresh = output_after(change, bf16)
    assert not torch.equal(after, before)
    assert torch.equal(after, fresh)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_each_optimizer_step_is_seen_at_the_next_call(bf16, fused):
    """A fused step writes the weights in its kernel without the version counter's bump: the graph reads them still."""
    model, x = mlp(), mlp_batch()
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    for _ in range(2):
        before = model(x)
        before.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        after = model(x)
        assert not torch.equal(after, before)
        assert torch.equal(after, copy.deepcopy(model)(x))


def test_functional_call_with_other_tensors_runs_on_them(bf16):
    model, x = mlp(), mlp_batch()
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    model(x)
    doubled = {name: p.detach() * 2 for name, p in model.named_parameters()}
    ours = torch.func.functional_call(model, doubled, (x,))
    twin = copy.deepcopy(model)
    twin.load_state_dict(doubled)
    assert torch.equal(ours, twin(x))
    assert not torch.equal(ours, model(x))  # the model's own weights are untouched


def test_a_call_under_inference_mode_leaves_training_gradients_alone(bf16):
    model, x = mlp(), mlp_batch()
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    graphamp.rewrite(reference, (x,), amp_lists=bf16)
    with torch.inference_mode():
        model(x)
    model(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))


def test_weight_cache_argument_is_deprecated_and_changes_nothing(bf16):
    model, x = mlp(), mlp_batch()
    reference = copy.deepcopy(model)
    graphamp.rewrite(reference, (x,), amp_lists=bf16)
    with pytest.warns(DeprecationWarning, match=r"rewrite\(weight_cache=...\) is ignored"):
        graphamp.rewrite(model, (x,), amp_lists=bf16, weight_cache=True)
    assert torch.equal(model(x), reference(x))


# -- what rewrite() refuses or warns about --------------------------------------------------------------------------


def test_rewrite_refuses_half_precision_parameters():
    with pytest.raises(ValueError, match="'weight' is float16.*Keep the model in float32"):
        graphamp.rewrite(nn.Linear(4, 4).half(), (torch.randn(2, 4, dtype=torch.float16),))


def test_rewriting_a_rewritten_model_is_refused(bf16):
    model = graphamp.rewrite(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=bf16)
    with pytest.raises(ValueError, match="already rewritten"):
        graphamp.rewrite(model, (torch.randn(2, 4),))


def test_float16_on_cpu_warns_once_and_names_bfloat16(fp16, monkeypatch):
    monkeypatch.setattr(dtypes, "_warned_float16_on_cpu", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            graphamp.rewrite(nn.Linear(4, 4), amp_lists=fp16)
    said = [w for w in caught if "float16 on CPU" in str(w.message)]
    assert len(said) == 1 and "dtype='bfloat16'" in str(said[0].message)


@pytest.fixture
def pretend_gpu(monkeypatch):
    """Make torch.cuda describe a GPU of the given capability, without one."""
    def pretend(name, capability, bf16):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
        return torch.device("cuda", 0)
    return pretend


def test_bfloat16_on_a_gpu_without_it_is_a_clear_error(pretend_gpu):
    gpu = pretend_gpu("Tesla P100", (6, 0), bf16=False)
    with pytest.raises(ArgumentError, match=r"Tesla P100 cannot run bfloat16: use .*dtype='float16'"):
        dtypes.check_dtype_runs_on(gpu, torch.bfloat16, compile=False)


def test_compiled_bfloat16_before_sm80_is_a_clear_error(pretend_gpu):
    gpu = pretend_gpu("Tesla V100", (7, 0), bf16=True)  # eager bf16 is emulated there; inductor's is not
    dtypes.check_dtype_runs_on(gpu, torch.bfloat16, compile=False)
    with pytest.raises(ArgumentError, match=r"Tesla V100 \(sm_70\) cannot run inductor's bfloat16 kernels"):
        dtypes.check_dtype_runs_on(gpu, torch.bfloat16, compile=True)


def test_float16_on_a_gpu_without_half_arithmetic_is_a_clear_error(pretend_gpu):
    gpu = pretend_gpu("Tesla M40", (5, 2), bf16=False)
    with pytest.raises(ArgumentError, match=r"Tesla M40 \(sm_52\) has no float16 arithmetic"):
        dtypes.check_dtype_runs_on(gpu, torch.float16, compile=False)
