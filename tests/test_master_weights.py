"""Master weights: the rewritten module trains the original model's own FP32 parameters and buffers."""

import copy
import warnings

import pytest
import torch
from torch import nn

import graphamp
import models
from graphamp import AutoMixedPrecisionLists

BF16 = AutoMixedPrecisionLists(dtype="bfloat16")


def resnet_and_batch():
    torch.manual_seed(0)
    return models.SmallResNet(), torch.randn(8, 1, 8, 8)


def test_parameters_and_buffers_are_the_original_objects():
    model, x = resnet_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16)
    assert [id(p) for p in amp.parameters()] == [id(p) for p in model.parameters()]
    assert [id(b) for b in amp.buffers()] == [id(b) for b in model.buffers()]
    assert all(p.dtype == torch.float32 for p in amp.parameters())


def test_an_optimizer_built_before_rewrite_updates_the_model():
    model, x = resnet_and_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.fc.weight.detach().clone()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16)
    amp(x).square().mean().backward()
    optimizer.step()
    assert not torch.equal(model.fc.weight, before)


def test_gradients_arrive_in_fp32_on_every_parameter():
    model, x = resnet_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16)
    amp(x).square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_state_dict_has_the_original_keys_and_loads_into_the_original():
    model, x = resnet_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16)
    amp(x).square().mean().backward()
    state = amp.state_dict()
    assert list(state) == list(model.state_dict())
    fresh = models.SmallResNet()
    fresh.load_state_dict(state)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_load_state_dict_into_the_rewritten_module_updates_the_original():
    model, x = resnet_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16)
    other = models.SmallResNet()
    amp.load_state_dict(other.state_dict())
    assert torch.equal(model.fc.weight, other.fc.weight)
    model.eval(), other.eval()  # the original's mode is the rewritten module's mode
    assert not amp.training
    torch.testing.assert_close(amp(x), other(x), rtol=3e-2, atol=3e-2)


def test_batch_norm_statistics_update_exactly_as_in_the_original():
    model, x = resnet_and_batch()
    reference = copy.deepcopy(model)
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16)
    for _ in range(3):
        amp(x)
        reference(x)
    for (name, ours), theirs in zip(model.named_buffers(), reference.buffers()):
        assert ours.dtype == theirs.dtype, name
        if name.endswith("num_batches_tracked"):
            assert ours.item() == theirs.item() == 3
        else:  # bf16 activations feed fp32 statistics: close, not bit-identical
            torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)


def test_buffers_stay_fp32_after_training_steps():
    model, x = resnet_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16)
    amp(x).square().mean().backward()
    float_buffers = [b for b in model.buffers() if b.is_floating_point()]
    assert float_buffers and all(b.dtype == torch.float32 for b in float_buffers)


def test_eval_mode_leaves_batch_norm_statistics_alone():
    model, x = resnet_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16)
    amp.eval()
    before = {n: b.clone() for n, b in model.named_buffers()}
    with torch.no_grad():
        amp(x)
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())


def test_attributes_of_the_original_are_reachable():
    model = models.gpt2()
    amp = graphamp.rewrite(model, (), {"input_ids": models.token_batch()}, amp_lists=BF16)
    assert amp.config is model.config
    assert amp.original_module is model


def test_rewrite_refuses_half_precision_parameters():
    with pytest.raises(ValueError, match="'weight' is float16.*Keep the model in float32"):
        graphamp.rewrite(nn.Linear(4, 4).half(), (torch.randn(2, 4, dtype=torch.float16),))


def test_rewriting_a_rewritten_module_is_refused():
    amp = graphamp.rewrite(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=BF16)
    with pytest.raises(ValueError, match="already rewritten"):
        graphamp.rewrite(amp, (torch.randn(2, 4),))


def test_float16_on_cpu_warns_once_and_names_bfloat16(monkeypatch):
    monkeypatch.setattr(graphamp.dtypes, "_warned_float16_on_cpu", False)
    fp16 = AutoMixedPrecisionLists(dtype="float16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            graphamp.rewrite(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=fp16)
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
    with pytest.raises(ValueError, match=r"Tesla P100 cannot run bfloat16: use .*dtype='float16'"):
        graphamp.dtypes.check_dtype_runs_on(gpu, torch.bfloat16, compile=False)


def test_compiled_bfloat16_before_sm80_is_a_clear_error(pretend_gpu):
    gpu = pretend_gpu("Tesla V100", (7, 0), bf16=True)  # eager bf16 is emulated there; inductor's is not
    graphamp.dtypes.check_dtype_runs_on(gpu, torch.bfloat16, compile=False)
    with pytest.raises(ValueError, match=r"Tesla V100 \(sm_70\) cannot run inductor's bfloat16 kernels"):
        graphamp.dtypes.check_dtype_runs_on(gpu, torch.bfloat16, compile=True)


def test_float16_on_a_gpu_without_half_arithmetic_is_a_clear_error(pretend_gpu):
    gpu = pretend_gpu("Tesla M40", (5, 2), bf16=False)
    with pytest.raises(ValueError, match=r"Tesla M40 \(sm_52\) has no float16 arithmetic"):
        graphamp.dtypes.check_dtype_runs_on(gpu, torch.float16, compile=False)
