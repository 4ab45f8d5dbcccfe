"""Never stale: an edit to a rewritten model (a submodule swapped, a parameter replaced or frozen, a `.data` write,
train/eval of a submodule, a Python attribute forward reads) reaches the next call, as in eager. torch.compile
guards on what the graphs read and recompiles when it changes."""

import copy

import pytest
import torch
from torch import nn

import graphamp
from conftest import CompiledCodeRecorder
from models import TwoLayer
from training import TORCH_BEFORE_2_13, matmul_dtypes, relative_error

# graphamp's warnings that code ran eagerly, in float32, outside its graphs: none may pass unless a test expects it.
pytestmark = pytest.mark.filterwarnings("error:graphamp. :UserWarning")


def zero_linear(fan_in, fan_out):
    layer = nn.Linear(fan_in, fan_out)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def model_and_batch():
    torch.manual_seed(0)
    return TwoLayer(), torch.randn(8, 16)


def autocast_output(model, x):
    with torch.autocast("cpu", torch.bfloat16):
        return model(x).float()


def test_swapped_submodule_is_used_and_trained(bf16):
    model, x = model_and_batch()
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    model.fc2 = zero_linear(32, 4)
    out = model(x)
    assert torch.equal(out, torch.zeros_like(out))  # eager gives exactly 0: the old fc2 would not
    out.sum().backward()
    assert model.fc2.weight.grad is not None and model.fc2.weight.grad.abs().sum() > 0


def test_replaced_parameter_is_used_and_trained(bf16):
    model, x = model_and_batch()
    eager = copy.deepcopy(model)  # before rewrite: a copy of a rewritten model is rewritten too
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    model.fc1.weight = nn.Parameter(torch.randn(32, 16))
    eager.fc1.weight = nn.Parameter(model.fc1.weight.detach().clone())
    out = model(x)
    assert relative_error(out, autocast_output(eager, x)) < 1e-2
    out.sum().backward()
    assert model.fc1.weight.grad is not None


def test_a_frozen_parameter_gets_no_gradient(bf16):
    model, x = model_and_batch()
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    model.fc1.weight.requires_grad_(False)
    model(x).sum().backward()
    assert model.fc1.weight.grad is None and model.fc2.weight.grad is not None


@pytest.mark.parametrize(
    "write", [lambda p, t: setattr(p, "data", t), lambda p, t: p.data.copy_(t)], ids=["data_assigned", "data_copied"]
)
def test_a_data_write_is_read_by_the_next_call(bf16, write):
    model, x = model_and_batch()
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    before = model(x)
    new_weight = torch.randn(4, 32)
    for net in (model, eager):
        write(net.fc2.weight, new_weight.clone())  # an EMA swapped in, a checkpoint loaded by hand
    out = model(x)
    assert relative_error(out, autocast_output(eager, x)) < 1e-2
    assert relative_error(out, before) > 0.1


class WritesThroughData(nn.Module):
    """WGAN's weight clipping and a step counter, written through `.data` inside forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.data.add_(1)
        self.fc.weight.data.clamp_(-0.05, 0.05)
        return self.fc(x)


@pytest.mark.parametrize("compile", [False, True])
def test_a_write_through_data_in_forward_reaches_the_model(bf16, compile):
    """make_fx made `.data` a constant: the writes changed that copy (compile=False) or inductor refused it."""
    torch.manual_seed(0)
    model = graphamp.rewrite(WritesThroughData(), amp_lists=bf16, compile=compile)
    for _ in range(2):
        model(torch.randn(4, 8))

    assert model.steps.item() == 2
    assert model.fc.weight.abs().max() <= torch.tensor(0.05)


class NormalizedMLP(nn.Module):
    """Linear, BatchNorm, dropout, Linear: submodules whose train/eval mode changes what they compute."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.dropout = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.dropout(torch.relu(self.norm(self.fc1(x)))))


def test_eval_of_a_submodule_under_a_training_model_takes_effect(bf16):
    torch.manual_seed(0)
    model, x = NormalizedMLP(), torch.randn(8, 16)
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    for net in (model, eager):
        net.norm.eval()  # running statistics, not the batch's
        net.dropout.eval()
    out = model(x)
    assert relative_error(out, autocast_output(eager, x)) < 1e-2
    assert model.training and not model.norm.training
    assert set(matmul_dtypes(model)) == {torch.bfloat16}


def test_train_and_eval_each_keep_their_graph(bf16):
    torch.manual_seed(0)
    model, x = NormalizedMLP(), torch.randn(8, 16)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    for _ in range(2):
        model.eval()
        model(x)
        model.train()
        model(x)
    graphs = graphamp.rewritten_graphs(model)
    assert len(graphs) == 2 and [graph.runs for graph in graphs] == [3, 2]


def test_a_python_attribute_read_in_forward_takes_effect(bf16):
    model, x = model_and_batch()
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    with_relu = model(x)
    model.use_relu = eager.use_relu = False
    expected = autocast_output(eager, x)
    assert relative_error(model(x), expected) < 1e-2
    assert relative_error(with_relu, expected) > 0.1  # the first graph would be wrong


@pytest.mark.parametrize("convert", [
    pytest.param(lambda m: m.to(torch.bfloat16), id="to_bf16"),
    pytest.param(lambda m: m.half(), id="half"),
    pytest.param(lambda m: m.fc2.to(torch.bfloat16), id="one_layer", marks=pytest.mark.skipif(
        TORCH_BEFORE_2_13, reason="torch 2.11's dynamo does not guard the dtype of one layer's parameters that "
        "Module.to() changes: the old graph runs them (its casts still apply the lists), and graphamp's check, made "
        "when dynamo recompiles, is not reached")),
])
def test_half_precision_parameters_after_rewrite_are_refused(bf16, convert):
    model, x = model_and_batch()
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    convert(model)
    with pytest.raises(graphamp.ArgumentError, match=r"parameter 'fc\d\.weight' is .* FP32 master weights"):
        model(x.to(next(model.fc1.parameters()).dtype))


def test_the_refusal_of_half_parameters_after_rewrite_names_model_float_which_brings_back_low_matmuls(bf16):
    """Rewriting again, what the refusal before conversion asks for, is refused for a converted model."""
    model, x = model_and_batch()
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    model.half()
    with pytest.raises(graphamp.ArgumentError, match=r"model\.float\(\)") as refused:
        model(x.half())
    assert "rewrite it" not in str(refused.value)
    model.float()
    eager = TwoLayer()
    eager.load_state_dict(model.state_dict())
    with CompiledCodeRecorder() as recorder:
        out = model(x)
    assert {call.in_dtypes[:2] for call in recorder.calls_of("addmm")} == {(torch.bfloat16, torch.bfloat16)}
    assert relative_error(out, autocast_output(eager, x)) < 1e-6


@pytest.mark.parametrize("convert", [
    pytest.param(lambda m: m.half(), id="float16_under_bfloat16_lists"),
    pytest.param(lambda m: m.to(torch.bfloat16), id="bfloat16", marks=pytest.mark.skipif(
        TORCH_BEFORE_2_13, reason="torch 2.11's dynamo guards no parameter dtype of an nn.Sequential: the old graph "
        "runs, its casts take the bfloat16 weights, and no kernel fails")),
])
def test_half_precision_parameters_are_refused_before_the_new_graph_runs(bf16, convert):
    """A LayerNorm's parameters stay uncast in the graph: its kernel would fail on a float32 batch with float16
    parameters before any check after the call."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)), torch.randn(2, 8)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    convert(model)
    with pytest.raises(graphamp.ArgumentError, match=r"parameter '0\.weight' is .* FP32 master weights"):
        model(x)


def test_lora_merge_and_unload_after_rewrite_gives_eager_logits(bf16):
    peft = pytest.importorskip("peft")
    model, x = model_and_batch()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["fc1"], init_lora_weights=False)
    graphamp.rewrite(model, (x,), amp_lists=bf16)  # the base model first, then the adapters
    lora_model = peft.get_peft_model(model, config)
    merged = lora_model.merge_and_unload()  # the LoRA layer replaced by a merged Linear, inside model
    eager = TwoLayer()
    eager.fc1, eager.fc2 = copy.deepcopy(merged.fc1), copy.deepcopy(merged.fc2)  # an FP32 twin, not rewritten
    assert merged is model
    assert relative_error(merged(x), autocast_output(eager, x)) < 1e-2
    assert set(matmul_dtypes(merged)) == {torch.bfloat16}
