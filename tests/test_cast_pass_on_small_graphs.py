"""The passes on small graphs made by make_fx, with no dynamo and no model: each rule of the cast pass,
judged by the graph it leaves (the dtypes in meta["val"], the aten._to_copy nodes, what they read) and, where that
could still be wrong, by running the rewritten graph on real inputs against eager autocast or the FP32 function and
by the dtypes its kernels ran in. The slow end-to-end tests through both front ends are tests/test_cast_pass.py."""

import logging
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import graphamp.passes
from graphamp import AutoMixedPrecisionLists
from graphamp.inspection.recording import DtypeRecorder, floating
from graphamp.passes import PASSES_AFTER_CASTS, run_passes
from graphamp.passes.cast_pass import INPUT_UPCAST, insert_casts
from graphamp.passes.grouped_query_attention import attend_grouped_queries
from graphamp.policy.config import AmpConfig

pytestmark = pytest.mark.usefixtures("seeded")

aten = torch.ops.aten
CAST = aten._to_copy.default
# What a bfloat16 GEMM of a few dozen products keeps of the FP32 result (8 bits of mantissa).
BF16_TOLERANCE = {"rtol": 2e-2, "atol": 2e-2}


def traced(fn, *example_inputs):
    """`fn`'s pre-autograd ATen graph, as the front ends trace it: make_fx with pre_dispatch=True keeps composite
    ops whole (aten.linear, aten.matmul, aten.softmax) and does not functionalize (in-place ops stay), and
    tracing_mode="fake" writes a FakeTensor meta["val"] on every node."""
    return make_fx(fn, pre_dispatch=True, tracing_mode="fake")(*example_inputs)


@pytest.fixture
def cast_pass(bf16):
    """`cast_pass(fn, *inputs)`: `fn` traced and rewritten by the cast pass (the bfloat16 lists unless `lists=` says
    otherwise): (graph_module, report)."""

    def rewrite(fn, *inputs, lists=bf16, level="O1", parameters=frozenset(), outputs_stay_low=False):
        graph_module = traced(fn, *inputs)
        report = insert_casts(graph_module, AmpConfig(lists, level), parameters, outputs_stay_low)
        return graph_module, report

    return rewrite


def traced_module(module, *inputs):
    """`module`'s graph with its parameters as the first placeholders and each op's nn_module_stack, as
    torch.export's non-strict trace makes it (make_fx records the stack of a function whose `_orig_mod` is the
    module). Returns (graph_module, the parameter placeholders' names, the parameters to run it with)."""
    names = [name for name, _ in module.named_parameters()]

    def call(*args):
        return torch.func.functional_call(module, dict(zip(names, args)), args[len(names):])

    call._orig_mod = module
    parameters = [p.detach() for p in module.parameters()]
    graph_module = make_fx(call, pre_dispatch=True, tracing_mode="fake", record_module_stack=True)(
        *parameters, *inputs
    )
    placeholders = graph_module.graph.find_nodes(op="placeholder")
    return graph_module, frozenset(p.name for p in placeholders[:len(names)]), parameters


def nodes_of(graph_module, target):
    return [n for n in graph_module.graph.nodes if n.target is target]


def casts_of(graph_module, value=None):
    """The _to_copy nodes (of `value`, when given)."""
    return [n for n in nodes_of(graph_module, CAST) if value is None or n.args[0] is value]


def placeholders(graph_module):
    return graph_module.graph.find_nodes(op="placeholder")


def outputs(graph_module):
    return pytree.tree_leaves(graph_module.graph.find_nodes(op="output")[0].args[0])


def dtype_of(node):
    return node.meta["val"].dtype


def run_recorded(graph_module, *inputs):
    """(what the graph returns on `inputs`, the DtypeRecorder of its kernels)."""
    with DtypeRecorder() as recorder:
        result = graph_module(*inputs)
    return result, recorder


def under_autocast(fn, *inputs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn(*inputs)


def linear_then(then):
    """x, w -> then(linear(x, w)): a white op whose low output the op under test reads."""
    return lambda x, w, *extra: then(F.linear(x, w), *extra)


def x_and_w():
    return torch.randn(4, 8), torch.randn(6, 8)


# -- the trace the tests stand on ------------------------------------------------------------------------------------

def test_make_fx_keeps_composite_ops_whole_with_a_meta_val_on_every_node():
    graph_module = traced(lambda x, w: torch.softmax(F.linear(x, w) @ w, -1), torch.randn(4, 8), torch.randn(4, 8))
    ops = {n.target for n in graph_module.graph.nodes if n.op == "call_function"}
    assert {aten.linear.default, aten.matmul.default, aten.softmax.int} <= ops
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in graph_module.graph.nodes if n.op != "output")


# -- white, black, gray, unlisted ------------------------------------------------------------------------------------

def test_white_op_runs_low_on_its_inputs_cast_down(cast_pass):
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    graph_module, _ = cast_pass(lambda x, w, b: F.linear(x, w, b), x, w, b)
    (linear,) = nodes_of(graph_module, aten.linear.default)
    assert [n.target for n in linear.args] == [CAST] * 3
    assert [n.args[0] for n in linear.args] == placeholders(graph_module)
    assert {n.kwargs["dtype"] for n in linear.args} == {dtype_of(linear)} == {torch.bfloat16}
    out, recorder = run_recorded(graph_module, x, w, b)
    assert [floating(call.in_dtypes) for call in recorder.calls_of("addmm")] == [{torch.bfloat16}]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, under_autocast(F.linear, x, w, b).float())


def test_black_op_runs_fp32_on_its_low_input_cast_up(cast_pass):
    x, w = x_and_w()
    fn = linear_then(lambda h: torch.logsumexp(h, -1))
    graph_module, _ = cast_pass(fn, x, w)
    (logsumexp,) = nodes_of(graph_module, aten.logsumexp.default)
    (linear,) = nodes_of(graph_module, aten.linear.default)
    assert logsumexp.args[0] in casts_of(graph_module, linear)
    assert logsumexp.args[0].kwargs["dtype"] == dtype_of(logsumexp) == torch.float32
    out, recorder = run_recorded(graph_module, x, w)
    assert floating(recorder.calls_of("logsumexp")[0].in_dtypes) == {torch.float32}
    torch.testing.assert_close(out, under_autocast(fn, x, w).float(), **BF16_TOLERANCE)


def test_black_op_with_a_dtype_argument_computes_fp32_through_it_instead_of_a_cast(cast_pass):
    x, w = x_and_w()
    fn = linear_then(lambda h: torch.log_softmax(h, -1))
    graph_module, _ = cast_pass(fn, x, w)
    (log_softmax,) = nodes_of(graph_module, aten.log_softmax.int)
    (linear,) = nodes_of(graph_module, aten.linear.default)
    assert log_softmax.args[0] is linear and not casts_of(graph_module, linear)
    assert log_softmax.kwargs["dtype"] == dtype_of(log_softmax) == torch.float32
    out, recorder = run_recorded(graph_module, x, w)
    assert floating(recorder.calls_of("_log_softmax")[0].in_dtypes) == {torch.float32}
    torch.testing.assert_close(out, fn(x, w), **BF16_TOLERANCE)


def test_softmax_feeding_only_a_white_op_reads_its_low_input_as_it_is(cast_pass):
    """The kernel accumulates in FP32 inside; its low output is what the next GEMM would read after a cast anyway."""
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)

    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    graph_module, _ = cast_pass(attention, q, k, v)
    (softmax,) = nodes_of(graph_module, aten.softmax.int)
    assert softmax.args[0].target is aten.matmul.default
    assert dtype_of(softmax) == torch.bfloat16 and "dtype" not in softmax.kwargs
    out, recorder = run_recorded(graph_module, q, k, v)
    assert floating(recorder.calls_of("_softmax")[0].in_dtypes) == {torch.bfloat16}
    torch.testing.assert_close(out, attention(q, k, v), **BF16_TOLERANCE)


def test_exp_is_black_under_float16_lists_and_gray_under_bfloat16_lists(cast_pass, fp16):
    x, w = x_and_w()
    fn = linear_then(torch.exp)
    in_float16, _ = cast_pass(fn, x, w, lists=fp16)
    in_bfloat16, _ = cast_pass(fn, x, w)
    (exp16,), (exp_bf16,) = nodes_of(in_float16, aten.exp.default), nodes_of(in_bfloat16, aten.exp.default)
    assert exp16.args[0].target is CAST and dtype_of(exp16) == torch.float32
    assert exp_bf16.args[0].target is aten.linear.default and dtype_of(exp_bf16) == torch.bfloat16


def test_gray_op_follows_its_all_low_inputs(cast_pass):
    x, w = x_and_w()
    graph_module, report = cast_pass(linear_then(torch.relu), x, w)
    (relu,) = nodes_of(graph_module, aten.relu.default)
    assert relu.args[0].target is aten.linear.default and dtype_of(relu) == torch.bfloat16
    assert report.decisions["gray"] == 1
    _, recorder = run_recorded(graph_module, x, w)
    assert recorder.calls_of("relu")[0].out_dtypes == (torch.bfloat16,)


def test_gray_op_with_an_fp32_input_runs_fp32(cast_pass):
    x, w = x_and_w()
    y = torch.randn(4, 6)
    fn = linear_then(lambda h, y: torch.lerp(h, y, 0.5))  # lerp wants one dtype: no promotion inside
    graph_module, _ = cast_pass(fn, x, w, y)
    (lerp,) = nodes_of(graph_module, aten.lerp.Scalar)
    (linear,) = nodes_of(graph_module, aten.linear.default)
    assert lerp.args[0] in casts_of(graph_module, linear) and lerp.args[0].kwargs["dtype"] == torch.float32
    assert lerp.args[1] is placeholders(graph_module)[2] and dtype_of(lerp) == torch.float32
    out, recorder = run_recorded(graph_module, x, w, y)
    assert floating(recorder.calls_of("lerp")[0].in_dtypes) == {torch.float32}
    torch.testing.assert_close(out, fn(x, w, y), **BF16_TOLERANCE)  # autocast refuses lerp's mixed dtypes


def test_gray_op_whose_type_promotion_computes_fp32_gets_no_cast(cast_pass):
    x, w = x_and_w()
    y = torch.randn(4, 6)
    graph_module, _ = cast_pass(linear_then(torch.add), x, w, y)
    (add,) = nodes_of(graph_module, aten.add.Tensor)
    assert add.args == (nodes_of(graph_module, aten.linear.default)[0], placeholders(graph_module)[2])
    assert dtype_of(add) == torch.float32 and len(casts_of(graph_module)) == 2  # x and w, down
    _, recorder = run_recorded(graph_module, x, w, y)
    assert recorder.calls_of("add")[0].in_dtypes == (torch.bfloat16, torch.float32)
    assert recorder.calls_of("add")[0].out_dtypes == (torch.float32,)


def drop_path(h, keep_prob=0.75):
    """HF's stochastic depth: a mask drawn in the dtype of the value it scales."""
    mask = keep_prob + torch.rand((h.shape[0], 1), dtype=h.dtype, device=h.device)
    mask.floor_()
    return h.div(keep_prob) * mask


def test_a_random_draw_of_the_traced_dtype_is_drawn_in_the_dtype_of_the_low_value_it_scales(cast_pass):
    x, w = x_and_w()
    y = torch.randn(4, 6)
    fn = linear_then(lambda h, y: y + drop_path(h))  # the residual stream y stays FP32, as under autocast
    graph_module, _ = cast_pass(fn, x, w, y)
    (draw,) = nodes_of(graph_module, aten.rand.default)
    (mul,) = nodes_of(graph_module, aten.mul.Tensor)
    assert draw.kwargs["dtype"] == dtype_of(draw) == dtype_of(mul) == torch.bfloat16
    assert len(casts_of(graph_module)) == 2  # x and w: none for the mask
    out, recorder = run_recorded(graph_module, x, w, y)
    _, expected = run_recorded(make_fx(lambda *a: under_autocast(fn, *a))(x, w, y), x, w, y)
    for op in ("rand", "add", "floor_", "mul"):
        assert [c.in_dtypes + c.out_dtypes for c in recorder.calls_of(op)] == \
               [c.in_dtypes + c.out_dtypes for c in expected.calls_of(op)], op
    assert out.dtype == torch.float32


def test_a_random_draw_stays_fp32_where_the_model_gave_no_dtype_or_an_fp32_op_reads_it(cast_pass):
    x, w = x_and_w()
    y = torch.randn(4, 6)

    def default_dtype(h, y):
        return y + h * torch.rand((h.shape[0], 1))  # float32 by default, as in eager code: h * mask promotes

    def read_by_fp32_too(h, y):
        mask = torch.rand((h.shape[0], 1), dtype=h.dtype)
        return h * mask + (y * mask).sum()

    for then in (default_dtype, read_by_fp32_too):
        graph_module, _ = cast_pass(linear_then(then), x, w, y)
        (draw,) = nodes_of(graph_module, aten.rand.default)
        assert dtype_of(draw) == torch.float32, then.__name__
    (low_mul, fp32_mul) = nodes_of(graph_module, aten.mul.Tensor)
    assert dtype_of(low_mul) == torch.bfloat16 and low_mul.args[1] in casts_of(graph_module, draw)
    assert dtype_of(fp32_mul) == torch.float32 and fp32_mul.args[1] is draw


def test_unlisted_op_acts_gray_and_is_reported(cast_pass):
    x, w = x_and_w()
    graph_module, report = cast_pass(linear_then(torch.atan), x, w)
    (atan,) = nodes_of(graph_module, aten.atan.default)
    assert atan.args[0].target is aten.linear.default and dtype_of(atan) == torch.bfloat16
    assert report.unlisted_ops == Counter({"atan": 1}) and report.decisions["unlisted"] == 1


def test_custom_white_list_runs_a_gray_op_low(cast_pass):
    lists = AutoMixedPrecisionLists(dtype="bfloat16", custom_white_list=["relu"])
    graph_module, report = cast_pass(torch.relu, torch.randn(4, 8), lists=lists)
    (relu,) = nodes_of(graph_module, aten.relu.default)
    assert relu.args[0].target is CAST and dtype_of(relu) == torch.bfloat16
    assert report.decisions == Counter({"white": 1})


def test_custom_black_list_runs_a_gray_op_fp32_on_low_inputs(cast_pass):
    lists = AutoMixedPrecisionLists(dtype="bfloat16", custom_black_list=["relu"])
    graph_module, report = cast_pass(linear_then(torch.relu), *x_and_w(), lists=lists)
    (relu,) = nodes_of(graph_module, aten.relu.default)
    assert relu.args[0].target is CAST and relu.args[0].kwargs["dtype"] == dtype_of(relu) == torch.float32
    assert report.decisions == Counter({"white": 1, "black": 1})


# -- casts: shared, folded, remade, made stale -----------------------------------------------------------------------

def test_one_cast_per_value_and_dtype_serves_every_reader(cast_pass):
    x, w1, w2 = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6, 8)
    graph_module, _ = cast_pass(lambda x, w1, w2: F.linear(x, w1) * F.linear(x, w2), x, w1, w2)
    (cast_of_x,) = casts_of(graph_module, placeholders(graph_module)[0])
    assert [linear.args[0] for linear in nodes_of(graph_module, aten.linear.default)] == [cast_of_x, cast_of_x]


def test_a_cast_of_an_inserted_cast_folds_back_to_its_source(cast_pass):
    """O2 casts src down for index_copy_; the kernel wants the dtype of the FP32 buffer it writes, so src goes back
    up: to src itself, not to a cast of its cast."""
    buffer, index, src = torch.randn(5, 8), torch.tensor([0, 2]), torch.randn(2, 8)

    def copy_into(buffer, index, src):
        return buffer.index_copy_(0, index, src)

    graph_module, _ = cast_pass(copy_into, buffer, index, src, level="O2")
    (index_copy,) = nodes_of(graph_module, aten.index_copy_.default)
    assert index_copy.args[3] is placeholders(graph_module)[2]
    assert all(cast.args[0].target is not CAST for cast in casts_of(graph_module))


def test_no_inserted_cast_is_left_without_a_reader(cast_pass):
    def copy_into(buffer, index, src):
        return buffer.index_copy_(0, index, src)

    graph_module, report = cast_pass(copy_into, torch.randn(5, 8), torch.tensor([0, 2]), torch.randn(2, 8), level="O2")
    assert all(cast.users for cast in casts_of(graph_module))
    assert report.casts_inserted == len(casts_of(graph_module))


def test_a_down_cast_of_the_front_ends_upcast_of_a_low_input_is_the_low_input_itself(bf16):
    def upcast_then_linear(x_low, w):
        x = aten._to_copy.default(x_low, dtype=torch.float32)  # as graphamp's lowering traces a low input's upcast
        return F.linear(x, w)

    graph_module = traced(upcast_then_linear, torch.randn(4, 8).bfloat16(), torch.randn(6, 8))
    casts_of(graph_module)[0].meta[INPUT_UPCAST] = True
    insert_casts(graph_module, AmpConfig(bf16))
    (linear,) = nodes_of(graph_module, aten.linear.default)
    assert linear.args[0] is placeholders(graph_module)[0]
    assert not casts_of(graph_module, placeholders(graph_module)[0])  # the upcast nothing reads now is gone


def test_a_reshapes_cast_is_made_as_the_reshape_of_the_cast(cast_pass):
    def two_sums(x, w):
        h = F.linear(x, w)
        return torch.logsumexp(h, -1), torch.logsumexp(h.view(-1), 0)

    graph_module, _ = cast_pass(two_sums, *x_and_w())
    (linear,) = nodes_of(graph_module, aten.linear.default)
    (up,) = casts_of(graph_module, linear)
    (view,) = nodes_of(graph_module, aten.view.default)  # the low view nothing reads any more is gone
    assert view.args[0] is up and dtype_of(view) == torch.float32
    assert [n.args[0] for n in nodes_of(graph_module, aten.logsumexp.default)] == [up, view]


def test_an_in_place_write_makes_an_earlier_cast_stale(cast_pass):
    def doubled_between_reads(x, w):
        h = torch.relu(x)
        a = F.linear(h, w)  # h cast down here
        h.mul_(2.0)
        return a + F.linear(h, w)  # must read the doubled h, not that cast

    x, w = x_and_w()
    graph_module, _ = cast_pass(doubled_between_reads, x, w)
    (relu,) = nodes_of(graph_module, aten.relu.default)
    (mul_,) = nodes_of(graph_module, aten.mul_.Tensor)
    first, second = (linear.args[0] for linear in nodes_of(graph_module, aten.linear.default))
    assert (first.target, first.args[0]) == (CAST, relu)
    assert (second.target, second.args[0]) == (CAST, mul_)
    torch.testing.assert_close(graph_module(x, w), doubled_between_reads(x, w), **BF16_TOLERANCE)


def test_integer_and_bool_tensors_are_never_cast(cast_pass):
    def embed_and_mask(ids, mask, table, w):
        return F.linear(F.embedding(ids, table), w).masked_fill(mask.unsqueeze(-1), 0.0)

    ids, mask, table, w = torch.randint(0, 10, (2, 5)), torch.rand(2, 5) > 0.5, torch.randn(10, 8), torch.randn(6, 8)
    graph_module, _ = cast_pass(embed_and_mask, ids, mask, table, w)
    assert casts_of(graph_module)
    assert all(dtype_of(cast.args[0]).is_floating_point for cast in casts_of(graph_module))
    _, recorder = run_recorded(graph_module, ids, mask, table, w)
    assert recorder.calls_of("embedding")[0].in_dtypes == (torch.float32, torch.int64)
    assert recorder.calls_of("masked_fill")[0].in_dtypes == (torch.bfloat16, torch.bool)


def test_the_models_own_float_and_to_dtype_are_kept(cast_pass):
    def casts_itself(x, w):
        h = F.linear(x, w)
        return h.float() * 2, h.to(torch.bfloat16)

    x, w = x_and_w()
    graph_module, report = cast_pass(casts_itself, x, w)
    own = nodes_of(graph_module, aten.to.dtype)
    assert own[0].args[0].target is aten.linear.default  # read as it is, no cast of graphamp's before it
    assert [(n.args[1], dtype_of(n)) for n in own] == [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
    assert report.decisions["explicit-cast"] == 2
    assert [out.dtype for out in graph_module(x, w)] == [torch.float32, torch.bfloat16]


# -- outputs -----------------------------------------------------------------------------------------------------------

def test_outputs_come_back_in_their_traced_dtype(cast_pass):
    x, w = x_and_w()
    graph_module, report = cast_pass(linear_then(torch.relu), x, w)
    (output,) = outputs(graph_module)
    assert output.target is CAST and output.args[0].target is aten.relu.default
    assert report.outputs_kept_low == [] and graph_module(x, w).dtype == torch.float32


def test_outputs_stay_low_with_outputs_stay_low_and_are_reported(cast_pass):
    def low_and_fp32(x, w):
        h = F.linear(x, w)
        return torch.relu(h), torch.logsumexp(h, -1)

    x, w = x_and_w()
    graph_module, report = cast_pass(low_and_fp32, x, w, outputs_stay_low=True)
    assert report.outputs_kept_low == [0]
    assert [out.dtype for out in graph_module(x, w)] == [torch.bfloat16, torch.float32]


def test_an_output_that_views_another_output_still_views_it_after_the_pass(cast_pass):
    def value_and_its_transpose(x, w):
        h = torch.relu(F.linear(x, w))
        return h, h.t()

    x, w = x_and_w()
    graph_module, _ = cast_pass(value_and_its_transpose, x, w)
    value, transpose = outputs(graph_module)
    assert transpose.target is aten.t.default and transpose.args[0] is value
    h, h_t = graph_module(x, w)
    assert h_t.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    h_t[0, 0] = 7.0
    assert h[0, 0] == 7.0


# -- O2 ----------------------------------------------------------------------------------------------------------------

def test_o2_runs_a_gray_op_low_on_fp32_inputs(cast_pass):
    graph_module, _ = cast_pass(torch.mul, torch.randn(4, 8), torch.randn(4, 8), level="O2")
    (mul,) = nodes_of(graph_module, aten.mul.Tensor)
    assert [(n.target, n.kwargs["dtype"]) for n in mul.args] == [(CAST, torch.bfloat16)] * 2
    assert dtype_of(mul) == torch.bfloat16


class T5LayerNorm(nn.Module):
    """HF's RMS norm: its weight is read by a gray mul, which O2 would run low."""

    def __init__(self, size):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class NormedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = T5LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc(x))


def test_o2_keeps_the_parameters_a_normalization_module_reads_fp32(bf16):
    graph_module, parameters, _ = traced_module(NormedLinear(), torch.randn(4, 8))
    insert_casts(graph_module, AmpConfig(bf16, "O2"), parameters)
    fc_weight, fc_bias, norm_weight = placeholders(graph_module)[:3]
    assert not casts_of(graph_module, norm_weight)
    assert [c.kwargs["dtype"] for c in casts_of(graph_module, fc_weight) + casts_of(graph_module, fc_bias)] == [
        torch.bfloat16
    ] * 2


# -- number arguments, meta["val"], lint -------------------------------------------------------------------------------

def test_a_float32_min_argument_of_an_op_made_low_is_clamped_to_the_low_range(cast_pass):
    """HF's "minus infinity" is torch.finfo(float32).min, which a bfloat16 masked_fill refuses."""
    x, w = x_and_w()
    mask = torch.rand(4, 6) > 0.5
    fn = linear_then(lambda h, mask: h.masked_fill(mask, torch.finfo(torch.float32).min))
    graph_module, _ = cast_pass(fn, x, w, mask)
    (masked_fill,) = nodes_of(graph_module, aten.masked_fill.Scalar)
    assert dtype_of(masked_fill) == torch.bfloat16
    assert masked_fill.args[2] == -torch.finfo(torch.bfloat16).max
    out = graph_module(x, w, mask)
    assert (out[mask] == -torch.finfo(torch.bfloat16).max).all()


class _ValuesAgainstMeta(torch.fx.Interpreter):
    """Runs the graph on real inputs and collects each node whose values' dtypes or shapes differ from meta["val"]."""

    def __init__(self, graph_module):
        super().__init__(graph_module)
        self.untrue = []

    def run_node(self, node):
        result = super().run_node(node)
        if node.op != "output":
            ran = [(t.dtype, t.shape) for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
            meta = [(t.dtype, t.shape) for t in pytree.tree_leaves(node.meta["val"]) if isinstance(t, torch.Tensor)]
            if ran != meta:
                self.untrue.append((node.name, ran, meta))
        return result


def test_the_pass_keeps_every_nodes_meta_val_true_and_the_graph_lints(cast_pass):
    def mixed(x, w, y, mask):
        h = F.linear(x, w)
        scores = torch.softmax(h.masked_fill(mask, torch.finfo(torch.float32).min), -1)
        g = torch.relu(h) + y
        g.mul_(0.5)
        return torch.logsumexp(g.view(-1), 0), scores @ w, h.t(), torch.atan(h).sum(-1)

    inputs = (*x_and_w(), torch.randn(4, 6), torch.rand(4, 6) > 0.5)
    graph_module, _ = cast_pass(mixed, *inputs)
    graph_module.graph.lint()
    checker = _ValuesAgainstMeta(graph_module)
    checker.run(*inputs)
    assert checker.untrue == []


# -- run_passes and the passes after the casts ------------------------------------------------------------------------

def test_run_passes_runs_the_cast_pass_then_each_named_pass_and_times_each(bf16, monkeypatch):
    ran = []

    def spy(name, apply):
        def run(graph_module):
            ran.append(name)
            return apply(graph_module)
        return run

    monkeypatch.setattr(graphamp.passes, "PASSES_AFTER_CASTS", tuple((n, spy(n, a)) for n, a in PASSES_AFTER_CASTS))
    graph_module, timings = traced(linear_then(torch.relu), *x_and_w()), {}
    report = run_passes(graph_module, AmpConfig(bf16), timings=timings)
    assert ran == [name for name, _ in PASSES_AFTER_CASTS]
    assert list(timings) == ["pass cast", *(f"pass {name}" for name in ran)]
    assert all(seconds >= 0 for seconds in timings.values())
    assert report.decisions == Counter({"white": 1, "gray": 1})


def test_each_pass_is_logged_by_its_name_at_debug(bf16, caplog):
    """A newcomer finds each pass by its name in a log: the "graphamp.passes" logger, at DEBUG."""
    with caplog.at_level(logging.DEBUG, logger="graphamp.passes"):
        run_passes(traced(linear_then(torch.relu), *x_and_w()), AmpConfig(bf16))
    logged = [r.getMessage() for r in caplog.records if r.name == "graphamp.passes"]
    assert [m.split()[2].rstrip(":") for m in logged] == ["cast", *(name for name, _ in PASSES_AFTER_CASTS)]



@pytest.mark.parametrize("disabled", ["REMOVE_BROADCAST", "CAST", "GROUPED_QUERY_ATTENTION"])
def test_inductors_disabled_passes_never_skip_the_cast_pass_and_the_log_says_what_was_skipped(bf16, caplog, disabled):
    """inductor's disabled_passes is a substring test over pass names: "REMOVE_BROADCAST" names "cast". The cast
    pass is the policy, so it runs whatever the list says; the passes after it are skipped by their own name."""
    graph_module = traced(linear_then(torch.relu), *x_and_w())
    with torch._inductor.config.patch(disabled_passes=disabled), caplog.at_level(logging.DEBUG, "graphamp.passes"):
        report = run_passes(graph_module, AmpConfig(bf16))
    assert report.decisions == Counter({"white": 1, "gray": 1})
    assert casts_of(graph_module)
    skipped = [m.split()[2].rstrip(":") for r in caplog.records if "disabled" in (m := r.getMessage())]
    assert skipped == (["grouped_query_attention"] if disabled == "GROUPED_QUERY_ATTENTION" else [])

def attention_over_repeated_heads(q, k, v, mask):
    """transformers' repeat_kv (unsqueeze, expand, reshape) of each key/value head for its group, then SDPA."""
    batch, kv_heads, sequence, head_dim = k.shape
    group = q.shape[1] // kv_heads

    def repeat_kv(t):
        return t[:, :, None, :, :].expand(batch, kv_heads, group, sequence, head_dim).reshape(
            batch, kv_heads * group, sequence, head_dim
        )

    return F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask)


def gqa_inputs():
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    return q, k, v, torch.ones(5, 5, dtype=torch.bool).tril()


def test_grouped_query_attention_pass_attends_the_unrepeated_heads_and_keeps_the_values():
    inputs = gqa_inputs()
    graph_module = traced(attention_over_repeated_heads, *inputs)
    attend_grouped_queries(graph_module)
    (attention,) = nodes_of(graph_module, aten.scaled_dot_product_attention.default)
    assert attention.kwargs["enable_gqa"] is True
    assert attention.args[1:3] == tuple(placeholders(graph_module)[1:3])
    assert not nodes_of(graph_module, aten.expand.default)
    torch.testing.assert_close(graph_module(*inputs), attention_over_repeated_heads(*inputs))


def test_run_passes_groups_the_heads_of_the_low_attention_after_its_casts(bf16):
    inputs = gqa_inputs()
    graph_module = traced(attention_over_repeated_heads, *inputs)
    run_passes(graph_module, AmpConfig(bf16))
    (attention,) = nodes_of(graph_module, aten.scaled_dot_product_attention.default)
    key, value = attention.args[1:3]
    assert attention.kwargs["enable_gqa"] is True
    assert [(n.target, n.args[0]) for n in (key, value)] == [(CAST, p) for p in placeholders(graph_module)[1:3]]
    assert dtype_of(attention) == torch.bfloat16
    torch.testing.assert_close(graph_module(*inputs), under_autocast(attention_over_repeated_heads, *inputs).float())
