"""Capture: each model is exported and rewritten, and the rewritten module behaves like the original one.

All in bfloat16 on CPU (float16 matmuls on CPU are ~100x slower). Outputs are compared to the original FP32
model by relative error ||a - b|| / ||b||.
"""

import copy
import inspect

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import graphamp
from models import (
    CustomOpModel,
    InputGatedRegionsModel,
    LSTMClassifier,
    RegionsModel,
    SmallResNet,
    bert,
    gpt2,
    token_batch,
)
from graphamp.inspection.recording import DtypeRecorder
from training import loss_of, relative_error

# bfloat16 keeps 8 bits of mantissa: ~2^-8 = 4e-3 relative error per rounding. Measured in these tests: 1.5e-3 to
# 5.2e-3 (GPT-2 3.6e-3 to 3.8e-3, BERT 4.8e-3, SmallResNet 3.8e-3 to 4.8e-3, Linear in NestedOutputs 5.2e-3); 4x margin.
BF16_RTOL = 2e-2

# The kernels of white ops on CPU: GEMMs, convolutions, fused attention, the oneDNN LSTM layer.
WHITE_KERNELS = (
    "mm", "addmm", "bmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu", "mkldnn_rnn_layer",
)


@pytest.fixture(autouse=True)
def every_test_seeded(seeded):
    """Every test draws the same weights, inputs and dropout masks on every run."""


def gpt2_case(attn_implementation="sdpa"):
    ids = token_batch()
    return gpt2(attn_implementation=attn_implementation), (), {"input_ids": ids, "labels": ids}


def bert_case():
    ids = token_batch()
    mask = torch.ones_like(ids)
    mask[:, -4:] = 0  # padded tail, so the mask is not a no-op
    return bert(), (), {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}


MODEL_CASES = {
    "gpt2-sdpa": gpt2_case,
    "gpt2-eager": lambda: gpt2_case("eager"),
    "bert": bert_case,
    "resnet": lambda: (SmallResNet(), (torch.randn(4, 1, 8, 8),), {}),
    "lstm": lambda: (LSTMClassifier(), (token_batch(),), {}),
    "custom-op": lambda: (CustomOpModel(), (torch.randn(4, 8),), {}),
    "regions": lambda: (RegionsModel(), (torch.randn(4, 8),), {}),
}
# RegionsModel's cond predicate is a sum of values centred over the batch (~1e-7): rounding picks its branch, so
# its output is compared in the variant whose predicate is the input's sign.
COMPARABLE_CASES = {
    **{name: case for name, case in MODEL_CASES.items() if name != "regions"},
    "regions-input-gated": lambda: (InputGatedRegionsModel(), (torch.randn(4, 8),), {}),
}


# -- every model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", MODEL_CASES.values(), ids=MODEL_CASES.keys())
def test_rewritten_forward_and_backward_give_finite_fp32_gradients(case, bf16):
    model, args, kwargs = case()
    amp = graphamp.rewrite(model, args, kwargs, amp_lists=bf16)

    loss = loss_of(amp(*args, **kwargs))
    loss.backward()

    assert torch.isfinite(loss)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert parameter.grad.dtype == torch.float32, name
        assert torch.isfinite(parameter.grad).all(), name


@pytest.mark.parametrize("case", MODEL_CASES.values(), ids=MODEL_CASES.keys())
def test_white_kernels_run_in_bfloat16_forward_and_backward(case, bf16):
    model, args, kwargs = case()
    amp = graphamp.rewrite(model, args, kwargs, amp_lists=bf16)

    with DtypeRecorder() as recorder:
        loss_of(amp(*args, **kwargs)).backward()

    white_calls = recorder.calls_of(*WHITE_KERNELS)
    assert white_calls
    for call in white_calls:
        assert {d for d in call.in_dtypes if d.is_floating_point} == {torch.bfloat16}, call


@pytest.mark.parametrize("case", COMPARABLE_CASES.values(), ids=COMPARABLE_CASES.keys())
def test_rewritten_output_matches_the_fp32_original(case, bf16):
    model, args, kwargs = case()
    amp = graphamp.rewrite(model, args, kwargs, amp_lists=bf16)

    out, expected = amp(*args, **kwargs), model(*args, **kwargs)

    logits = getattr(out, "logits", out)
    assert relative_error(logits, getattr(expected, "logits", expected)) < BF16_RTOL


# -- higher-order sub-graphs -------------------------------------------------------------------------------------

def sub_graph_modules(graph_module):
    """The bodies of higher-order ops (torch.cond branches, no_grad regions), by attribute name."""
    return {
        node.target: getattr(graph_module, node.target)
        for node in graph_module.graph.find_nodes(op="get_attr")
        if isinstance(getattr(graph_module, node.target), torch.fx.GraphModule)
    }


def body_of(graph_module, higher_order_name):
    """The sub-graphs fed to the higher-order op whose name contains `higher_order_name`."""
    bodies = sub_graph_modules(graph_module)
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and higher_order_name in getattr(node.target, "__name__", str(node.target)):
            return [bodies[n.target] for n in node.all_input_nodes if n.target in bodies]
    raise AssertionError(f"no {higher_order_name} in the graph")


def assert_linear_runs_low(body):
    linears = [n for n in body.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.linear.default]
    assert linears, body.graph
    for linear in linears:
        assert linear.meta["graphamp"]["decision"] == "white"
        for value in linear.all_input_nodes:
            assert value.meta["val"].dtype == torch.bfloat16, (linear, value)
            assert value.target == torch.ops.aten._to_copy.default, (linear, value)


def test_linear_inside_both_cond_branches_runs_in_bfloat16(bf16):
    x = torch.randn(4, 8)
    amp = graphamp.rewrite(RegionsModel(), (x,), amp_lists=bf16)

    branches = body_of(amp.graph_module, "cond")

    assert len(branches) == 2
    for branch in branches:
        assert_linear_runs_low(branch)


def test_linear_inside_a_no_grad_region_runs_in_bfloat16(bf16):
    x = torch.randn(4, 8)
    amp = graphamp.rewrite(RegionsModel(), (x,), amp_lists=bf16)

    (body,) = body_of(amp.graph_module, "wrap_with_set_grad_enabled")

    assert_linear_runs_low(body)


class NoGradRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            scale = self.gate(x).sigmoid()
        return self.fc(x) * scale


def test_no_grad_region_gemm_executes_in_bfloat16(bf16):
    x = torch.randn(4, 8)
    amp = graphamp.rewrite(NoGradRegion(), (x,), amp_lists=bf16)

    with DtypeRecorder() as recorder:
        amp(x)

    gemms = recorder.calls_of("addmm")
    assert len(gemms) == 2  # self.gate inside the region, self.fc outside
    assert all(set(call.in_dtypes) == {torch.bfloat16} for call in gemms)


# -- new shapes --------------------------------------------------------------------------------------------------

@pytest.fixture
def gpt2_pair(bf16):
    """(rewritten GPT-2 captured on a (2, 16) batch, its original)."""
    model = gpt2()
    ids = token_batch(2, 16)
    return graphamp.rewrite(model, (), {"input_ids": ids}, amp_lists=bf16), model


def test_new_batch_size_is_captured_and_matches_the_original(gpt2_pair):
    amp, model = gpt2_pair
    ids = token_batch(3, 16, seed=1)

    logits = amp(input_ids=ids).logits

    assert len(amp.captures) == 2
    assert logits.shape == (3, 16, model.config.vocab_size)
    assert relative_error(logits, model(input_ids=ids).logits) < BF16_RTOL


def test_new_sequence_length_is_captured_and_matches_the_original(gpt2_pair):
    amp, model = gpt2_pair
    ids = token_batch(2, 24, seed=1)

    logits = amp(input_ids=ids).logits

    assert len(amp.captures) == 2
    assert logits.shape == (2, 24, model.config.vocab_size)
    assert relative_error(logits, model(input_ids=ids).logits) < BF16_RTOL


def test_first_shape_again_reuses_its_capture(gpt2_pair):
    amp, _ = gpt2_pair
    first = amp.graph_module
    amp(input_ids=token_batch(3, 16, seed=1))

    amp(input_ids=token_batch(2, 16, seed=2))

    assert len(amp.captures) == 2
    assert amp.graph_module is first


# -- arguments and outputs ---------------------------------------------------------------------------------------

def test_hf_output_comes_back_as_the_original_model_output_class(bf16):
    model, args, kwargs = gpt2_case()
    amp = graphamp.rewrite(model, args, kwargs, amp_lists=bf16)

    out, expected = amp(**kwargs), model(**kwargs)

    assert type(out) is type(expected)
    assert list(out.keys()) == list(expected.keys()) == ["loss", "logits"]
    assert out.loss.shape == () and out.logits.shape == expected.logits.shape


def test_keyword_attention_mask_reaches_the_model(bf16):
    model, _, kwargs = bert_case()
    kwargs = dict(kwargs, output_hidden_states=True)
    unmasked = dict(kwargs, attention_mask=torch.ones_like(kwargs["attention_mask"]))
    amp = graphamp.rewrite(model, (), kwargs, amp_lists=bf16)

    def unpadded_last_hidden(out):
        return out.hidden_states[-1][:, :-4]

    hidden = unpadded_last_hidden(amp(**kwargs))

    # Measured: 1.4e-4 from the masked original, 3.8e-3 from the unmasked one.
    assert relative_error(hidden, unpadded_last_hidden(model(**kwargs))) < (
        relative_error(hidden, unpadded_last_hidden(model(**unmasked))) / 10
    )


def test_keyword_order_does_not_make_a_new_capture(bf16):
    model, _, kwargs = bert_case()
    amp = graphamp.rewrite(model, (), kwargs, amp_lists=bf16)

    out = amp(**dict(reversed(list(kwargs.items()))))

    assert len(amp.captures) == 1
    assert torch.isfinite(out.loss)


class NestedOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        h = self.fc(x) * scale
        return {"hidden": h, "pair": (h.sum(), [h.relu()])}, h.mean()


def test_tuple_and_dict_outputs_keep_the_original_structure_and_values(bf16):
    model, x = NestedOutputs(), torch.randn(2, 4)
    amp = graphamp.rewrite(model, (x,), {"scale": 2.0}, amp_lists=bf16)

    out, expected = amp(x, scale=2.0), model(x, scale=2.0)

    assert pytree.tree_structure(out) == pytree.tree_structure(expected)
    for value, reference in zip(pytree.tree_leaves(out), pytree.tree_leaves(expected)):
        assert value.dtype == reference.dtype == torch.float32
        assert relative_error(value, reference) < BF16_RTOL


def test_non_tensor_keyword_value_is_honoured(bf16):
    model, x = NestedOutputs(), torch.randn(2, 4)
    amp = graphamp.rewrite(model, (x,), {"scale": 2.0}, amp_lists=bf16)

    hidden = amp(x, scale=3.0)[0]["hidden"]

    assert relative_error(hidden, model(x, scale=3.0)[0]["hidden"]) < BF16_RTOL


# -- train and eval ----------------------------------------------------------------------------------------------

class DropoutModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def test_dropout_is_active_in_train_mode(bf16):
    x = torch.randn(8, 16)
    amp = graphamp.rewrite(DropoutModel(), (x,), amp_lists=bf16)

    first, second = amp(x), amp(x)

    assert not torch.equal(first, second)
    assert 0.3 < (first == 0).float().mean().item() < 0.7  # p=0.5 of 128 values


def test_dropout_is_off_in_eval_mode(bf16):
    model, x = DropoutModel(), torch.randn(8, 16)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)

    amp.eval()
    first, second = amp(x), amp(x)

    assert torch.equal(first, second)
    assert relative_error(first, model(x)) < BF16_RTOL


def test_eval_and_train_switch_the_original_model_too(bf16):
    model, x = DropoutModel(), torch.randn(8, 16)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)

    amp.eval()
    in_eval = (amp.training, model.training, model.drop.training)
    amp.train()

    assert in_eval == (False, False, False)
    assert (amp.training, model.training, model.drop.training) == (True, True, True)


def test_eval_on_the_original_model_switches_the_rewritten_one(bf16):
    model, x = DropoutModel(), torch.randn(8, 16)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)

    model.eval()

    assert amp.training is False
    assert torch.equal(amp(x), amp(x))


@pytest.fixture
def resnet_pair(bf16):
    """(rewritten SmallResNet captured in train mode, an FP32 copy with the same weights and statistics, input)."""
    model = SmallResNet()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 1, 8, 8) * 3 + 1  # far from the initial running statistics (mean 0, var 1)
    return graphamp.rewrite(model, (x,), amp_lists=bf16), reference, x


def test_batchnorm_uses_batch_statistics_in_train_mode(resnet_pair):
    amp, reference, x = resnet_pair

    out = amp(x)

    assert relative_error(out, reference.train()(x)) < BF16_RTOL
    assert relative_error(out, copy.deepcopy(reference).eval()(x)) > 10 * BF16_RTOL


def test_batchnorm_updates_running_statistics_in_train_mode(resnet_pair):
    amp, reference, x = resnet_pair
    batchnorm = amp.original_module.stem[1]

    amp(x)
    reference(x)

    assert batchnorm.num_batches_tracked.item() == 1
    assert relative_error(batchnorm.running_mean, reference.stem[1].running_mean) < BF16_RTOL
    assert relative_error(batchnorm.running_var, reference.stem[1].running_var) < BF16_RTOL


def test_batchnorm_uses_running_statistics_in_eval_mode(resnet_pair):
    amp, reference, x = resnet_pair
    amp(x)  # one train-mode call each moves the running statistics away from their initial values
    reference(x)

    amp.eval()
    reference.eval()
    out = amp(x)

    assert relative_error(out, reference(x)) < BF16_RTOL
    assert relative_error(out, copy.deepcopy(reference).train()(x)) > 10 * BF16_RTOL


# -- inference ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_eval_inference_builds_no_autograd_graph_and_matches_the_original(context, bf16):
    model, args, kwargs = gpt2_case()
    amp = graphamp.rewrite(model, args, kwargs, amp_lists=bf16)
    amp.eval()

    with context():
        out, expected = amp(**kwargs), model(**kwargs)

    assert not out.logits.requires_grad and not out.loss.requires_grad
    assert relative_error(out.logits, expected.logits) < BF16_RTOL


def test_inference_mode_call_reuses_the_eval_capture(bf16):
    model, x = DropoutModel(), torch.randn(8, 16)
    amp = graphamp.rewrite(model.eval(), (x,), amp_lists=bf16)

    with torch.inference_mode():
        out = amp(x)

    assert len(amp.captures) == 1
    assert out.is_inference()


# -- the rewritten graph -----------------------------------------------------------------------------------------

def test_graph_module_is_an_fx_graph_module_with_inserted_casts(bf16):
    model, args, kwargs = gpt2_case()
    amp = graphamp.rewrite(model, args, kwargs, amp_lists=bf16)

    casts = [
        n for n in amp.graph_module.graph.nodes
        if n.target == torch.ops.aten._to_copy.default and n.meta.get("graphamp", {}).get("decision") == "inserted-cast"
    ]

    amp.graph_module.graph.lint()  # a well-formed fx graph after the pass's edits
    assert len(casts) == amp.report.casts_inserted > 0
    assert torch.bfloat16 in {c.kwargs["dtype"] for c in casts}


# -- what cannot be captured -------------------------------------------------------------------------------------

def test_a_decoder_with_use_cache_on_trains_and_returns_its_cache(bf16, seeded):
    """use_cache=True, decoder configs' default: the DynamicCache comes back from the graph, as from eager."""
    model, args, kwargs = gpt2_case()
    model.config.use_cache = True
    amp = graphamp.rewrite(model, args, kwargs, amp_lists=bf16)
    out, expected = amp(*args, **kwargs), model(*args, **kwargs)
    out.loss.backward()
    assert type(out.past_key_values) is type(expected.past_key_values)
    assert out.past_key_values.get_seq_length() == expected.past_key_values.get_seq_length() > 0
    # The cache's public use: the next token's logits, computed from each cache, agree. The cache is GPT-2's
    # second argument, whose keyword transformers renamed (past_key_values, then cache).
    next_token = token_batch(kwargs["input_ids"].shape[0], 1, seed=9)
    with torch.no_grad():
        from_graph = model(next_token, out.past_key_values).logits
        from_eager = model(next_token, expected.past_key_values).logits
    assert relative_error(from_graph, from_eager) < 2e-2
    assert relative_error(out.loss, expected.loss) < 2e-2
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_an_unflattenable_cache_asks_for_use_cache_false(bf16):
    class CacheLike:
        def __init__(self, tensor):
            self.tensor = tensor

    class ReturnsACache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x), CacheLike(x)

    CacheLike.__name__ = "StaticCache"  # a transformers Cache class that no pytree registration covers
    with pytest.raises(graphamp.CaptureError, match=r"returns a transformers Cache .*use_cache=False") as caught:
        graphamp.rewrite(ReturnsACache(), (torch.randn(2, 4),), amp_lists=bf16)
    assert caught.value.__cause__ is not None


class Box:
    def __init__(self, tensor):
        self.tensor = tensor


class ReturnsBox(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Box(self.fc(x))


def test_returned_custom_class_asks_for_register_pytree_node(bf16):
    with pytest.raises(graphamp.CaptureError, match="register_pytree_node") as caught:
        graphamp.rewrite(ReturnsBox(), (torch.randn(2, 4),), amp_lists=bf16)

    assert caught.value.__cause__ is not None


def test_returned_custom_class_error_names_no_torch_generated_code(bf16):
    with pytest.raises(graphamp.CaptureError) as caught:
        graphamp.rewrite(ReturnsBox(), (torch.randn(2, 4),), amp_lists=bf16)

    assert "<string>" not in str(caught.value)


class DataDependentIf(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            return h
        return -h


def test_data_dependent_if_asks_for_torch_cond_and_names_its_line(bf16):
    source, first = inspect.getsourcelines(DataDependentIf.forward)
    line = first + next(i for i, text in enumerate(source) if "if h.sum() > 0" in text)

    with pytest.raises(graphamp.CaptureError, match="torch.cond") as caught:
        graphamp.rewrite(DataDependentIf(), (torch.randn(2, 4),), amp_lists=bf16)

    assert f"test_capture.py:{line}" in str(caught.value)
    assert caught.value.__cause__ is not None


def test_half_model_is_refused_with_a_keep_fp32_message(bf16):
    model = CustomOpModel().half()

    with pytest.raises(ValueError, match="Keep the model in float32"):
        graphamp.rewrite(model, (torch.randn(4, 8, dtype=torch.float16),), amp_lists=bf16)
