"""The cast pass, judged by the dtypes the ATen kernels actually execute with (forward and backward)."""

import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
import models
from graphamp import AutoMixedPrecisionLists
from graphamp.inspection.recording import DtypeRecorder, floating
from training import loss_of

BF16 = AutoMixedPrecisionLists(dtype="bfloat16")
CAST = torch.ops.aten._to_copy.default


def rewrite_bf16(model, *args, amp_lists=BF16, **options):
    return graphamp.rewrite(model, args, amp_lists=amp_lists, **options)


def inserted_casts(graph_module):
    return [n for n in graph_module.graph.nodes if n.meta.get("graphamp", {}).get("decision") == "inserted-cast"]


class LinearThen(nn.Module):
    """linear (white) followed by one op under test."""

    def __init__(self, then):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.then = then

    def forward(self, x, *extra):
        return self.then(self.fc(x), *extra)


def test_white_op_runs_in_the_low_dtype_forward_and_backward():
    amp = rewrite_bf16(nn.Linear(8, 4), torch.randn(2, 8))
    with DtypeRecorder() as rec:
        amp(torch.randn(2, 8, requires_grad=True)).sum().backward()
    gemms = rec.calls_of("addmm", "mm")
    assert len(gemms) == 3  # forward, grad of input, grad of weight
    assert all(floating(call.in_dtypes) == {torch.bfloat16} for call in gemms)


def test_black_op_runs_in_fp32_on_low_inputs():
    amp = rewrite_bf16(LinearThen(lambda h: torch.log_softmax(h, -1)), torch.randn(2, 8))
    with DtypeRecorder() as rec:
        amp(torch.randn(2, 8)).sum().backward()
    (softmax,) = rec.calls_of("_log_softmax")
    assert floating(softmax.in_dtypes) == {torch.float32}
    assert floating(rec.calls_of("_log_softmax_backward_data")[0].in_dtypes) == {torch.float32}


def test_gray_op_follows_low_inputs():
    amp = rewrite_bf16(LinearThen(torch.relu), torch.randn(2, 8), fp32_outputs=False)
    with DtypeRecorder() as rec:
        out = amp(torch.randn(2, 8))
    assert rec.calls_of("relu")[0].out_dtypes == (torch.bfloat16,)
    assert out.dtype == torch.bfloat16


def test_gray_op_with_an_fp32_input_runs_in_fp32():
    amp = rewrite_bf16(LinearThen(torch.add), torch.randn(2, 8), torch.randn(2, 8))
    with DtypeRecorder() as rec:
        amp(torch.randn(2, 8), torch.randn(2, 8))
    (add,) = rec.calls_of("add")
    assert add.out_dtypes == (torch.float32,)  # torch promotes inside the kernel: no cast node needed


def test_gray_op_that_does_not_promote_gets_its_low_inputs_cast_up():
    amp = rewrite_bf16(LinearThen(lambda h, other: torch.dot(h.flatten(), other.flatten())), torch.randn(2, 8), torch.randn(2, 8))
    (dot,) = [n for n in amp.graph_module.graph.nodes if n.target == torch.ops.aten.dot.default]
    assert [n.meta["val"].dtype for n in dot.args] == [torch.float32, torch.float32]
    with DtypeRecorder() as rec:
        amp(torch.randn(2, 8), torch.randn(2, 8))
    assert rec.calls_of("dot")[0].in_dtypes == (torch.float32, torch.float32)


def test_gray_op_that_promotes_natively_gets_no_cast():
    amp = rewrite_bf16(LinearThen(lambda h, other: torch.cat([h, other], dim=0)), torch.randn(2, 8), torch.randn(2, 8))
    (cat,) = [n for n in amp.graph_module.graph.nodes if n.target == torch.ops.aten.cat.default]
    assert [n.meta["val"].dtype for n in cat.args[0]] == [torch.bfloat16, torch.float32]
    assert cat.meta["val"].dtype == torch.float32


def test_unlisted_op_is_treated_as_gray_and_reported():
    amp = rewrite_bf16(models.CustomOpModel(), torch.randn(4, 8), fp32_outputs=False)
    assert amp.report.unlisted_ops == Counter({"graphamp_test::scaled_tanh": 1})
    assert "graphamp_test::scaled_tanh x1" in str(amp.report)
    with DtypeRecorder() as rec:
        amp(torch.randn(4, 8))
    assert rec.calls_of("graphamp_test::scaled_tanh")[0].in_dtypes == (torch.bfloat16,)  # followed fc1's output


def test_custom_op_on_the_black_list_runs_in_fp32():
    lists = AutoMixedPrecisionLists(dtype="bfloat16", custom_black_list=["graphamp_test::scaled_tanh"])
    amp = rewrite_bf16(models.CustomOpModel(), torch.randn(4, 8), amp_lists=lists)
    with DtypeRecorder() as rec:
        amp(torch.randn(4, 8)).sum().backward()
    assert rec.calls_of("graphamp_test::scaled_tanh")[0].in_dtypes == (torch.float32,)
    assert not amp.report.unlisted_ops


def test_integer_and_bool_tensors_are_never_cast():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.fc = nn.Linear(8, 8)

        def forward(self, tokens, mask):
            return self.fc(self.embed(tokens)).masked_fill(mask.unsqueeze(-1), 0.0)

    tokens, mask = torch.randint(0, 10, (2, 5)), torch.rand(2, 5) > 0.5
    amp = rewrite_bf16(Masked(), tokens, mask)
    casts = inserted_casts(amp.graph_module)
    assert casts and all(cast.args[0].meta["val"].dtype.is_floating_point for cast in casts)
    with DtypeRecorder() as rec:
        amp(tokens, mask)
    assert rec.calls_of("embedding")[0].in_dtypes == (torch.float32, torch.int64)
    assert torch.bool in rec.calls_of("masked_fill")[0].in_dtypes


def test_casts_the_model_writes_are_kept():
    class WritesCasts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).float() * 2 + self.fc(x).to(torch.float32)

    amp = rewrite_bf16(WritesCasts(), torch.randn(2, 8))
    decisions = Counter(n.meta.get("graphamp", {}).get("decision") for n in amp.graph_module.graph.nodes)
    assert decisions["explicit-cast"] == 2
    targets = {n.target for n in amp.graph_module.graph.nodes}
    assert torch.ops.aten.to.dtype in targets


def test_explicit_dtype_argument_is_kept():
    amp = rewrite_bf16(LinearThen(lambda h: torch.softmax(h, -1, dtype=torch.float32)), torch.randn(2, 8))
    (softmax,) = [n for n in amp.graph_module.graph.nodes if n.target == torch.ops.aten.softmax.int]
    assert softmax.meta["graphamp"]["decision"] == "explicit-cast"
    assert softmax.args[0].meta["val"].dtype == torch.bfloat16  # not cast up by graphamp: the op converts
    assert softmax.args[2] == torch.float32


def test_no_value_is_cast_to_the_same_dtype_twice():
    amp = graphamp.rewrite(models.bert(), (), {"input_ids": models.token_batch()}, amp_lists=BF16)
    keys = [(cast.args[0], cast.kwargs["dtype"]) for cast in inserted_casts(amp.graph_module)]
    assert keys and len(keys) == len(set(keys))


def test_no_cast_to_a_values_own_dtype():
    amp = graphamp.rewrite(models.gpt2(), (), {"input_ids": models.token_batch()}, amp_lists=BF16)
    casts = inserted_casts(amp.graph_module)
    assert casts and all(cast.args[0].meta["val"].dtype != cast.kwargs["dtype"] for cast in casts)


def test_cast_of_an_inserted_cast_is_folded_into_it():
    class WeightTwice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).sum() + torch.exp(self.fc.weight).sum()  # weight: white linear, then black exp

    amp = graphamp.rewrite(WeightTwice(), (torch.randn(2, 8),), amp_lists=AutoMixedPrecisionLists(dtype="float16"))
    casts = inserted_casts(amp.graph_module)
    assert casts and all(cast.args[0].target != CAST for cast in casts)  # never a cast of a cast
    (exp,) = [n for n in amp.graph_module.graph.nodes if n.target == torch.ops.aten.exp.default]
    assert exp.args[0].op == "placeholder"  # the FP32 master weight itself, not bf16 -> fp32


def test_without_fp32_outputs_a_value_the_model_also_casts_comes_back_in_its_own_dtype_as_under_autocast():
    model, x, labels = models.LossOfCastLogits(), torch.randn(4, 8), torch.randint(0, 6, (4,))
    with torch.autocast("cpu", torch.bfloat16):
        _, autocast_logits = model(x, labels)

    loss, logits = rewrite_bf16(model, x, labels, fp32_outputs=False)(x, labels)

    assert logits.dtype == autocast_logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32


def test_with_fp32_outputs_a_value_the_model_also_casts_is_cast_once():
    model, x, labels = models.LossOfCastLogits(), torch.randn(4, 8), torch.randint(0, 6, (4,))
    amp = rewrite_bf16(model, x, labels)

    up = [n for n in amp.graph_module.graph.nodes if n.target in (torch.ops.aten.to.dtype, CAST)
          and n.meta["val"].dtype == torch.float32 and n.meta["val"].shape == (4, 6)]
    assert len(up) == 1
    assert amp(x, labels)[1].dtype == torch.float32


def test_a_value_and_its_reshapes_share_one_cast():
    """Logits come back FP32 (fp32_outputs) and the loss reads them flattened in FP32: one copy serves both."""

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 6)

        def forward(self, x, labels):
            logits = self.proj(x)
            return F.cross_entropy(logits.view(-1, 6), labels.view(-1)), logits

    model, x, labels = Classifier(), torch.randn(2, 3, 8), torch.randint(0, 6, (2, 3))
    amp = rewrite_bf16(model, x, labels)

    up_casts = [c for c in inserted_casts(amp.graph_module) if c.kwargs["dtype"] == torch.float32]
    assert len(up_casts) == 1
    assert all(n.users for n in amp.graph_module.graph.nodes if n.op == "call_function")  # no stale reshape left
    loss, logits = amp(x, labels)
    assert logits.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, expected_logits = model(x, labels)
    torch.testing.assert_close(logits, expected_logits.float())
    torch.testing.assert_close(loss, expected_loss)


def test_each_parameter_is_cast_at_most_once_per_forward():
    amp = graphamp.rewrite(models.bert(), (), {"input_ids": models.token_batch()}, amp_lists=BF16)
    sources = Counter(c.args[0].name for c in inserted_casts(amp.graph_module) if c.args[0].op == "placeholder")
    assert sources and max(sources.values()) == 1


def test_tied_weights_are_cast_once():
    model = models.gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    amp = graphamp.rewrite(model, (), {"input_ids": models.token_batch()}, amp_lists=BF16)
    with DtypeRecorder() as rec:
        amp(input_ids=models.token_batch())
    vocab_shaped = [c for c in rec.calls_of("_to_copy") if c.out_dtypes == (torch.bfloat16,)]
    assert vocab_shaped  # the recorder saw the casts it counts
    tied = [n for n in inserted_casts(amp.graph_module) if n.args[0].op == "placeholder" and "wte" in n.args[0].name]
    assert len(tied) == 1


def test_node_meta_val_matches_what_executes():
    amp = graphamp.rewrite(models.gpt2(), (), {"input_ids": models.token_batch()}, amp_lists=BF16)
    captured = amp.captures[-1]
    inputs = [source.get() for source in captured.lifted] + [models.token_batch()]
    executed = {}

    class Recording(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if isinstance(value, torch.Tensor):
                executed[node] = (value.dtype, tuple(value.shape))
            return value

    Recording(amp.graph_module).run(*inputs)
    for node, dtype_and_shape in executed.items():
        assert dtype_and_shape == (node.meta["val"].dtype, tuple(node.meta["val"].shape)), node
    assert len(executed) > 100


def test_outputs_come_back_in_float32_by_default():
    amp = rewrite_bf16(nn.Linear(8, 4), torch.randn(2, 8))
    assert amp(torch.randn(2, 8)).dtype == torch.float32
    low = rewrite_bf16(nn.Linear(8, 4), torch.randn(2, 8), fp32_outputs=False)
    assert low(torch.randn(2, 8)).dtype == torch.bfloat16


def test_gradients_of_a_white_op_reach_fp32_master_weights():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    amp = rewrite_bf16(model, torch.randn(4, 8))
    amp(torch.randn(4, 8)).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_black_modules_keep_every_op_of_the_module_fp32():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    lists = AutoMixedPrecisionLists(dtype="bfloat16", custom_black_modules=["2"])
    amp = rewrite_bf16(model, torch.randn(4, 8), amp_lists=lists)
    with DtypeRecorder() as rec:
        amp(torch.randn(4, 8)).sum().backward()
    first, second = rec.calls_of("addmm")[:2]
    assert floating(first.in_dtypes) == {torch.bfloat16}
    assert floating(second.in_dtypes) == {torch.float32}
    decisions = {n.meta["graphamp"]["source"] for n in amp.graph_module.graph.nodes if n.meta.get("graphamp", {}).get("module") == "2"}
    assert "custom_black_modules: 2" in decisions


def test_black_module_glob_pattern_matches_every_layer():
    lists = AutoMixedPrecisionLists(dtype="bfloat16", custom_black_modules=["bert.encoder.layer.*.attention"])
    amp = graphamp.rewrite(models.bert(), (), {"input_ids": models.token_batch()}, amp_lists=lists)
    in_attention = [
        n for n in amp.graph_module.graph.nodes
        if ".attention" in n.meta.get("graphamp", {}).get("module", "") and n.target == torch.ops.aten.linear.default
    ]
    assert len(in_attention) == 2 * 4  # q, k, v, output dense in each of 2 layers
    assert all(n.meta["graphamp"]["decision"] == "black" and n.meta["val"].dtype == torch.float32 for n in in_attention)


def test_batch_norm_runs_low_with_fp32_parameters_and_statistics():
    model = models.SmallResNet()
    amp = rewrite_bf16(model, torch.randn(4, 1, 8, 8))
    with DtypeRecorder() as rec:
        amp(torch.randn(4, 1, 8, 8)).sum().backward()
    batch_norm = rec.calls_of("native_batch_norm", "_native_batch_norm_legit")[0]
    assert batch_norm.in_dtypes[0] == torch.bfloat16 and set(batch_norm.in_dtypes[1:]) == {torch.float32}
    assert model.stem[1].running_mean.dtype == torch.float32


def test_level_o2_runs_gray_ops_low_and_keeps_norm_parameters_fp32():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    o1 = rewrite_bf16(model, torch.randn(4, 8))
    o2 = rewrite_bf16(model, torch.randn(4, 8), level="O2")
    x = torch.randn(4, 8)
    with DtypeRecorder() as rec1:
        o1(x)
    with DtypeRecorder() as rec2:
        o2(x)
    assert floating(rec1.calls_of("addmm")[1].in_dtypes) == {torch.bfloat16}
    layer_norm = rec2.calls_of("native_layer_norm")[0]
    # gray op, FP32 params; its input stays low (the kernel accumulates in FP32)
    assert layer_norm.in_dtypes == (torch.bfloat16, torch.float32, torch.float32)
    placeholders_cast = {c.args[0].name for c in inserted_casts(o2.graph_module) if c.args[0].op == "placeholder"}
    assert not any(name.startswith("p_1_") for name in placeholders_cast)  # LayerNorm's weight and bias


def test_level_o2_casts_gray_op_fp32_inputs_down():
    model = LinearThen(torch.add)
    o2 = rewrite_bf16(model, torch.randn(2, 8), torch.randn(2, 8), level="O2", fp32_outputs=False)
    with DtypeRecorder() as rec:
        out = o2(torch.randn(2, 8), torch.randn(2, 8))
    assert floating(rec.calls_of("add")[0].in_dtypes) == {torch.bfloat16}
    assert out.dtype == torch.bfloat16


def test_unknown_level_is_rejected():
    with pytest.raises(ValueError, match="level='O3'"):
        rewrite_bf16(nn.Linear(2, 2), torch.randn(1, 2), level="O3")


def test_float16_lists_keep_exp_fp32_and_bfloat16_lets_it_follow():
    model = LinearThen(torch.exp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 on CPU is slow, and said so
        fp16 = graphamp.rewrite(model, (torch.randn(2, 8),), amp_lists=AutoMixedPrecisionLists(dtype="float16"))
    bf16 = rewrite_bf16(model, torch.randn(2, 8))
    exp16 = next(n for n in fp16.graph_module.graph.nodes if n.target == torch.ops.aten.exp.default)
    exp_bf = next(n for n in bf16.graph_module.graph.nodes if n.target == torch.ops.aten.exp.default)
    assert exp16.meta["val"].dtype == torch.float32
    assert exp_bf.meta["val"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["bert", "gpt2", "resnet"])
def test_casts_executed_are_no_more_than_torch_autocast(name):
    """graphamp shares one cast per value; autocast casts per consuming op. BERT's q/k/v share an input."""
    model, args, kwargs = _model_and_inputs(name)
    with DtypeRecorder() as autocast_run:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model(*args, **kwargs))
        loss.backward()
    amp = graphamp.rewrite(model, args, kwargs, amp_lists=BF16)
    with DtypeRecorder() as graphamp_run:
        loss_of(amp(*args, **kwargs)).backward()
    assert graphamp_run.casts <= autocast_run.casts
    if name == "bert":
        assert graphamp_run.casts < autocast_run.casts


def _model_and_inputs(name):
    tokens = models.token_batch()
    if name == "bert":
        return models.bert(), (), {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": torch.tensor([0, 2])}
    if name == "gpt2":
        return models.gpt2(), (), {"input_ids": tokens, "labels": tokens}
    return models.SmallResNet(), (torch.randn(8, 1, 8, 8),), {}


def test_in_place_write_makes_an_earlier_cast_stale():
    class WritesInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = F.relu(x)
            a = self.fc(h)  # h cast to bf16 here
            h.mul_(2.0)
            return a + self.fc(h)  # must see the doubled h, not the stale cast

    model = WritesInPlace()
    x = torch.randn(4, 8)
    amp = rewrite_bf16(model, x)
    torch.testing.assert_close(amp(x), model(x), rtol=2e-2, atol=2e-2)
