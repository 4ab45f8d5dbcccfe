"""The cast pass, judged by the dtypes the ATen kernels actually execute with (forward and backward), on both front
ends: the same lists give the same decisions under torch.compile (rewrite) and torch.export (export_program)."""

import copy
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import graphamp
import models
from graphamp import AutoMixedPrecisionLists
from graphamp.inspection.recording import DtypeRecorder, floating
from graphamp.passes.marks import mark_of
from conftest import FrontEnd
from training import loss_of, relative_error

CAST = torch.ops.aten._to_copy.default


def inserted_casts(graph_module):
    return [n for n in graph_module.graph.nodes if getattr(mark_of(n), "decision", None) == "inserted-cast"]


def nodes_of(graph_module, target):
    return [n for n in graph_module.graph.nodes if n.target == target]


def state_placeholders_cast(converted, dtype=None):
    """The model paths of the parameters and buffers the graph casts (to `dtype`, or to any dtype). A tied weight
    is named by its first path in named_parameters(): the front ends may each name its placeholder by another."""
    model = converted.model
    first_path = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    tensors = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    return [
        first_path[id(tensors[converted.state[cast.args[0].name]])] for cast in inserted_casts(converted.graph_module)
        if cast.args[0].name in converted.state and dtype in (None, cast.kwargs["dtype"])
    ]


class LinearThen(nn.Module):
    """linear (white) followed by one op under test."""

    def __init__(self, then):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.then = then

    def forward(self, x, *extra):
        return self.then(self.fc(x), *extra)


# -- shared models: each converted once per front end, for the tests that only read them -------------------------

def _bert_case():
    ids = models.token_batch()
    model = models.bert()
    # BERT writes config.problem_type at its first call with labels, which dynamo guards on: set, it compiles once.
    model.config.problem_type = "single_label_classification"
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 2])}


def _gpt2_case():
    ids = models.token_batch()
    model = models.gpt2()
    # GPT2LMHeadModel's loss warns once through transformers' logger, which dynamo cannot trace under fullgraph=True;
    # naming the loss it falls back to keeps the whole call one graph.
    model.loss_type = "ForCausalLM"
    return model, {"input_ids": ids, "labels": ids}


def _llama_case():
    ids = models.token_batch()
    return models.llama(), {"input_ids": ids, "labels": ids}


CASES = {"bert": _bert_case, "gpt2": _gpt2_case, "llama": _llama_case}


@pytest.fixture(scope="module")
def converted_case(bf16):
    """converted_case(name, front_end) -> (Converted, an FP32 copy made before converting, the batch), built once
    per module for each (name, front end)."""
    built = {}
    for make in CASES.values():
        # A transformers model class registers itself in a dict that dynamo guards on: making each class before
        # any compile keeps a later one from recompiling the others (whose new graph recording() would not see).
        make()

    def get(name, front_end):
        if (name, front_end) not in built:
            torch.manual_seed(0)
            model, batch = CASES[name]()
            reference = copy.deepcopy(model)
            built[name, front_end] = (FrontEnd(front_end).convert(model, (), batch, amp_lists=bf16), reference, batch)
        return built[name, front_end]

    return get


# -- white, black, gray --------------------------------------------------------------------------------------------

def test_white_op_runs_in_the_low_dtype_forward_and_backward(bf16, rewritten):
    x = torch.randn(2, 8, requires_grad=True)
    amp = rewritten.convert(nn.Linear(8, 4), (x,), amp_lists=bf16)
    with amp.recording() as rec:
        amp.run(x).sum().backward()
    gemms = rec.calls_of("addmm", "mm")
    assert len(gemms) == 3  # forward, grad of input, grad of weight
    assert all(floating(call.in_dtypes) == {torch.bfloat16} for call in gemms)


def test_black_op_runs_in_fp32_on_low_inputs(bf16, rewritten):
    amp = rewritten.convert(LinearThen(lambda h: torch.log_softmax(h, -1)), (torch.randn(2, 8),), amp_lists=bf16)
    with amp.recording() as rec:
        amp.run(torch.randn(2, 8)).sum().backward()
    (softmax,) = rec.calls_of("_log_softmax")
    assert floating(softmax.in_dtypes) == {torch.float32}
    assert floating(rec.calls_of("_log_softmax_backward_data")[0].in_dtypes) == {torch.float32}


def test_gray_op_follows_low_inputs(bf16, rewritten):
    amp = rewritten.convert(LinearThen(torch.relu), (torch.randn(2, 8),), amp_lists=bf16)
    with amp.recording() as rec:
        out = amp.run(torch.randn(2, 8))
    assert rec.calls_of("relu")[0].out_dtypes == (torch.bfloat16,)
    assert out.dtype == torch.float32  # returned as the FP32 model returns it


def test_gray_op_with_an_fp32_input_runs_in_fp32(bf16, rewritten):
    amp = rewritten.convert(LinearThen(torch.add), (torch.randn(2, 8), torch.randn(2, 8)), amp_lists=bf16)
    with amp.recording() as rec:
        amp.run(torch.randn(2, 8), torch.randn(2, 8))
    (add,) = rec.calls_of("add")
    assert add.out_dtypes == (torch.float32,)
    (node,) = nodes_of(amp.graph_module, torch.ops.aten.add.Tensor)
    assert not [n for n in node.all_input_nodes if n.target == CAST]  # torch promotes inside the kernel


def test_gray_op_that_does_not_promote_gets_its_low_inputs_cast_up(bf16, rewritten):
    model = LinearThen(lambda h, other: torch.dot(h.flatten(), other.flatten()))
    amp = rewritten.convert(model, (torch.randn(2, 8), torch.randn(2, 8)), amp_lists=bf16)
    (dot,) = nodes_of(amp.graph_module, torch.ops.aten.dot.default)
    assert [n.meta["val"].dtype for n in dot.args] == [torch.float32, torch.float32]
    with amp.recording() as rec:
        amp.run(torch.randn(2, 8), torch.randn(2, 8))
    assert rec.calls_of("dot")[0].in_dtypes == (torch.float32, torch.float32)


def test_gray_op_that_promotes_natively_gets_no_cast(bf16, rewritten):
    model = LinearThen(lambda h, other: torch.cat([h, other], dim=0))
    graph_module, _ = rewritten(model, (torch.randn(2, 8), torch.randn(2, 8)), amp_lists=bf16)
    (cat,) = nodes_of(graph_module, torch.ops.aten.cat.default)
    assert [n.meta["val"].dtype for n in cat.args[0]] == [torch.bfloat16, torch.float32]
    assert cat.meta["val"].dtype == torch.float32


def test_unlisted_op_is_treated_as_gray_and_reported(bf16, rewritten):
    amp = rewritten.convert(models.CustomOpModel(), (torch.randn(4, 8),), amp_lists=bf16)
    assert amp.report.unlisted_ops == Counter({"graphamp_test::scaled_tanh": 1})
    assert "graphamp_test::scaled_tanh x1" in str(amp.report)
    with amp.recording() as rec:
        amp.run(torch.randn(4, 8))
    assert rec.calls_of("graphamp_test::scaled_tanh")[0].in_dtypes == (torch.bfloat16,)  # followed fc1's output


def test_custom_op_on_the_black_list_runs_in_fp32(rewritten):
    lists = AutoMixedPrecisionLists(dtype="bfloat16", custom_black_list=["graphamp_test::scaled_tanh"])
    amp = rewritten.convert(models.CustomOpModel(), (torch.randn(4, 8),), amp_lists=lists)
    with amp.recording() as rec:
        amp.run(torch.randn(4, 8)).sum().backward()
    assert rec.calls_of("graphamp_test::scaled_tanh")[0].in_dtypes == (torch.float32,)
    assert not amp.report.unlisted_ops


def test_integer_and_bool_tensors_are_never_cast(bf16, rewritten):
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.fc = nn.Linear(8, 8)

        def forward(self, tokens, mask):
            return self.fc(self.embed(tokens)).masked_fill(mask.unsqueeze(-1), 0.0)

    tokens, mask = torch.randint(0, 10, (2, 5)), torch.rand(2, 5) > 0.5
    amp = rewritten.convert(Masked(), (tokens, mask), amp_lists=bf16)
    casts = inserted_casts(amp.graph_module)
    assert casts and all(cast.args[0].meta["val"].dtype.is_floating_point for cast in casts)
    with amp.recording() as rec:
        amp.run(tokens, mask)
    assert rec.calls_of("embedding")[0].in_dtypes == (torch.float32, torch.int64)
    assert torch.bool in rec.calls_of("masked_fill")[0].in_dtypes


class GatedByANoGradRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.gate = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            scale = self.gate(x).sigmoid()
        return self.fc(x) * scale


def test_a_value_leaving_a_no_grad_region_has_the_dtype_it_runs_in(bf16, rewritten):
    x = torch.randn(4, 8)
    amp = rewritten.convert(GatedByANoGradRegion(), (x,), amp_lists=bf16)
    (mul,) = nodes_of(amp.graph_module, torch.ops.aten.mul.Tensor)
    with amp.recording() as rec:
        amp.run(x)
    assert rec.calls_of("mul")[0].out_dtypes == (mul.meta["val"].dtype,)
    # torch.export makes the region a sub-graph whose result crosses back in its traced dtype, float32 (and the mul
    # promotes); dynamo keeps the region inline, and the mul follows the gate's bfloat16.
    assert mul.meta["val"].dtype == {"export": torch.float32, "compile": torch.bfloat16}[rewritten.name]


# -- the model's own casts -----------------------------------------------------------------------------------------

def test_casts_the_model_writes_are_kept(bf16, rewritten):
    class WritesCasts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).float() * 2 + self.fc(x).to(torch.float32)

    graph_module, _ = rewritten(WritesCasts(), (torch.randn(2, 8),), amp_lists=bf16)
    decisions = Counter(getattr(mark_of(n), "decision", None) for n in graph_module.graph.nodes)
    assert decisions["explicit-cast"] == 2
    assert nodes_of(graph_module, torch.ops.aten.to.dtype)


def test_explicit_dtype_argument_is_kept(bf16, rewritten):
    model = LinearThen(lambda h: torch.softmax(h, -1, dtype=torch.float32))
    graph_module, _ = rewritten(model, (torch.randn(2, 8),), amp_lists=bf16)
    (softmax,) = nodes_of(graph_module, torch.ops.aten.softmax.int)
    assert mark_of(softmax).decision == "explicit-cast"
    assert softmax.args[0].meta["val"].dtype == torch.bfloat16  # not cast up by graphamp: the op converts
    assert softmax.args[2] == torch.float32


def test_a_black_op_on_the_models_own_low_value_computes_fp32_and_returns_the_models_dtype(bf16, rewritten):
    class SumsItsOwnLowValue(nn.Module):
        def forward(self, x):
            return x.bfloat16().sum(-1)

    x = torch.randn(4, 8)
    amp = rewritten.convert(SumsItsOwnLowValue(), (x,), amp_lists=bf16)
    (total,) = nodes_of(amp.graph_module, torch.ops.aten.sum.dim_IntList)
    assert total.meta["val"].dtype == torch.float32  # accumulates in FP32 through its dtype argument
    with amp.recording() as rec:
        out = amp.run(x)
    assert rec.calls_of("sum")[0].out_dtypes == (torch.float32,)
    assert out.dtype == torch.bfloat16  # as the model returns it
    torch.testing.assert_close(out, x.bfloat16().float().sum(-1).bfloat16())


def test_a_returned_value_the_model_also_casts_to_float32_is_cast_up_once(bf16, rewritten):
    model, x, labels = models.LossOfCastLogits(), torch.randn(4, 8), torch.randint(0, 6, (4,))
    amp = rewritten.convert(model, (x, labels), amp_lists=bf16)

    up = [n for n in amp.graph_module.graph.nodes if n.target in (torch.ops.aten.to.dtype, CAST)
          and n.meta["val"].dtype == torch.float32 and n.meta["val"].shape == (4, 6)]
    assert len(up) == 1
    assert amp.run(x, labels)[1].dtype == torch.float32


def test_a_value_and_its_reshapes_share_one_cast(bf16, rewritten):
    """Logits come back FP32 and the loss reads them flattened in FP32: one copy serves both."""

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 6)

        def forward(self, x, labels):
            logits = self.proj(x)
            return F.cross_entropy(logits.view(-1, 6), labels.view(-1)), logits

    model, x, labels = Classifier(), torch.randn(2, 3, 8), torch.randint(0, 6, (2, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, expected_logits = model(x, labels)
    amp = rewritten.convert(model, (x, labels), amp_lists=bf16)

    up_casts = [c for c in inserted_casts(amp.graph_module) if c.kwargs["dtype"] == torch.float32]
    assert len(up_casts) == 1
    assert all(n.users for n in amp.graph_module.graph.nodes if n.op == "call_function")  # no stale reshape left
    loss, logits = amp.run(x, labels)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected_logits.float())
    torch.testing.assert_close(loss, expected_loss)


def test_cast_of_an_inserted_cast_is_folded_into_it(rewritten):
    class WeightTwice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).sum() + torch.exp(self.fc.weight).sum()  # weight: white linear, then black exp

    graph_module, _ = rewritten(WeightTwice(), (torch.randn(2, 8),), amp_lists=AutoMixedPrecisionLists(dtype="float16"))
    casts = inserted_casts(graph_module)
    assert casts and all(cast.args[0].target != CAST for cast in casts)  # never a cast of a cast
    (exp,) = nodes_of(graph_module, torch.ops.aten.exp.default)
    assert exp.args[0].op == "placeholder"  # the FP32 master weight itself, not bf16 -> fp32


def test_in_place_write_makes_an_earlier_cast_stale(bf16, rewritten):
    class WritesInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = F.relu(x)
            a = self.fc(h)  # h cast to bf16 here
            h.mul_(2.0)
            return a + self.fc(h)  # must see the doubled h, not the stale cast

    model, x = WritesInPlace(), torch.randn(4, 8)
    expected = model(x)
    amp = rewritten.convert(model, (x,), amp_lists=bf16)
    torch.testing.assert_close(amp.run(x), expected, rtol=2e-2, atol=2e-2)


# -- outputs and gradients -------------------------------------------------------------------------------------------

def test_outputs_come_back_in_the_dtype_the_fp32_model_returns(bf16, rewritten):
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            h = self.fc(x)
            return h, h.bfloat16()  # the second is the model's own low value

    amp = rewritten.convert(Both(), (torch.randn(2, 8),), amp_lists=bf16)
    with amp.recording() as rec:
        fp32, low = amp.run(torch.randn(2, 8))
    assert floating(rec.calls_of("addmm")[0].out_dtypes) == {torch.bfloat16}
    assert (fp32.dtype, low.dtype) == (torch.float32, torch.bfloat16)


def test_gradients_of_a_white_op_reach_fp32_master_weights(bf16, rewritten):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    amp = rewritten.convert(model, (torch.randn(4, 8),), amp_lists=bf16)
    amp.run(torch.randn(4, 8)).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


# -- one cast per value --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("front_end", ["compile", "export"])
def test_no_value_is_cast_to_the_same_dtype_twice(converted_case, front_end):
    amp, _, _ = converted_case("bert", front_end)
    keys = [(cast.args[0], cast.kwargs["dtype"]) for cast in inserted_casts(amp.graph_module)]
    assert keys and len(keys) == len(set(keys))


@pytest.mark.parametrize("front_end", ["compile", "export"])
def test_no_cast_to_a_values_own_dtype(converted_case, front_end):
    amp, _, _ = converted_case("gpt2", front_end)
    casts = inserted_casts(amp.graph_module)
    assert casts and all(cast.args[0].meta["val"].dtype != cast.kwargs["dtype"] for cast in casts)


@pytest.mark.parametrize("front_end", ["compile", "export"])
def test_each_parameter_is_cast_at_most_once_per_forward(converted_case, front_end):
    amp, _, _ = converted_case("bert", front_end)
    sources = Counter(state_placeholders_cast(amp))
    assert sources and max(sources.values()) == 1


@pytest.mark.parametrize("front_end", ["compile", "export"])
def test_tied_weights_are_cast_once(converted_case, front_end):
    amp, _, _ = converted_case("gpt2", front_end)
    assert amp.model.lm_head.weight is amp.model.transformer.wte.weight
    tied = [path for path in state_placeholders_cast(amp, torch.bfloat16) if path == "transformer.wte.weight"]
    assert len(tied) == 1


class ExecutedValues(torch.fx.Interpreter):
    """Runs a graph node by node, keeping each tensor's (dtype, shape) as executed."""

    def __init__(self, graph_module):
        super().__init__(graph_module)
        self.executed = {}

    def run_node(self, node):
        value = super().run_node(node)
        if isinstance(value, torch.Tensor):
            self.executed[node] = (value.dtype, tuple(value.shape))
        return value


def _executed_values_of_the_rewritten_graph(front_end, amp_lists):
    """gpt2's rewritten graph run on its real inputs: the exported program's own, or, on the compile side, those
    dynamo hands graphamp's backend (rewrite() uses the same backend; its inputs are not reachable from outside)."""
    torch.manual_seed(0)
    model, batch = _gpt2_case()
    if front_end == "export":
        program = graphamp.export_program(model, (), batch, amp_lists=amp_lists)
        user = iter(pytree.tree_leaves(((), batch)))
        values = {**program.state_dict, **program.constants}
        inputs = [values[spec.target] if spec.kind.name != "USER_INPUT" else next(user)
                  for spec in program.graph_signature.input_specs]
        interpreter = ExecutedValues(program.graph_module)
        interpreter.run(*inputs)
        return interpreter.executed
    amp_backend, executed = graphamp.backend(amp_lists, inductor=False), {}

    def compile_and_run_node_by_node(gm, example_inputs):
        compiled = amp_backend(gm, example_inputs)
        interpreter = ExecutedValues(amp_backend.graphs[-1].graph_module)
        interpreter.run(*example_inputs)
        executed.update(interpreter.executed)
        return compiled

    torch.compile(model, backend=compile_and_run_node_by_node, fullgraph=True)(**batch)
    return executed


@pytest.mark.parametrize("front_end", ["compile", "export"])
def test_node_meta_val_matches_what_executes(bf16, front_end):
    executed = _executed_values_of_the_rewritten_graph(front_end, bf16)
    for node, dtype_and_shape in executed.items():
        assert dtype_and_shape == (node.meta["val"].dtype, tuple(node.meta["val"].shape)), node
    assert len(executed) > 100


@pytest.mark.parametrize("name", ["bert", "gpt2"])
@pytest.mark.parametrize("front_end", ["compile", "export"])
def test_casts_executed_are_no_more_than_torch_autocast(converted_case, front_end, name):
    """graphamp shares one cast per value; autocast casts per consuming op. BERT's q/k/v share an input."""
    amp, reference, batch = converted_case(name, front_end)
    with DtypeRecorder() as autocast_run:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(reference(**batch))
        loss.backward()
    with amp.recording() as graphamp_run:
        loss_of(amp.run(**batch)).backward()
    assert graphamp_run.casts <= autocast_run.casts
    if name == "bert":
        assert graphamp_run.casts < autocast_run.casts


def test_casts_executed_by_a_cnn_are_no_more_than_torch_autocast(bf16, rewritten, seeded):
    model, x = models.SmallResNet(), torch.randn(8, 1, 8, 8)
    reference = copy.deepcopy(model)
    with DtypeRecorder() as autocast_run:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(reference(x))
        loss.backward()
    amp = rewritten.convert(model, (x,), amp_lists=bf16)
    with amp.recording() as graphamp_run:
        loss_of(amp.run(x)).backward()
    # loss_of's `pow` saves its input for backward: autocast's float32 copy, or a rewritten model's low output, which
    # the backward reads (upcasts) again: one cast more, autocast's memory.
    assert 0 < graphamp_run.casts <= autocast_run.casts + (rewritten.name == "compile")


# -- same lists, same decisions ----------------------------------------------------------------------------------

def floating_decisions(graph_module) -> Counter:
    """(op, decision, source, dtype) of every node with a floating value, sub-graphs included."""
    decided = Counter()
    for module in graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                mark, value = mark_of(node), node.meta.get("val")
                if mark and isinstance(value, torch.Tensor) and value.is_floating_point():
                    decided[str(node.target), str(mark.decision), mark.source, value.dtype] += 1
    return decided


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_both_front_ends_make_the_same_decisions_and_casts(converted_case, name):
    """Every floating op gets the same decision, from the same list entry, in the same dtype, and the same casts,
    whether dynamo or torch.export captured the model. (Integer-only ops may differ: transformers builds its
    masks by another code path under torch.export than under dynamo, and neither is ever cast.)"""
    compiled, _, _ = converted_case(name, "compile")
    exported, _, _ = converted_case(name, "export")
    assert floating_decisions(compiled.graph_module) == floating_decisions(exported.graph_module)
    assert compiled.report.casts_inserted == exported.report.casts_inserted > 0
    assert compiled.report.unlisted_ops == exported.report.unlisted_ops
    assert sorted(state_placeholders_cast(compiled)) == sorted(state_placeholders_cast(exported))


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_both_front_ends_give_the_same_loss_and_gradients(converted_case, name):
    losses, gradients = {}, {}
    for front_end in ("compile", "export"):
        amp, _, batch = converted_case(name, front_end)
        amp.model.zero_grad()
        loss = amp.run(**batch).loss
        loss.backward()
        losses[front_end] = loss
        gradients[front_end] = {n: p.grad.clone() for n, p in amp.model.named_parameters() if p.grad is not None}
        amp.model.zero_grad()
    assert relative_error(losses["compile"], losses["export"]) < 1e-3
    assert gradients["compile"].keys() == gradients["export"].keys()
    for name_, gradient in gradients["compile"].items():
        assert relative_error(gradient, gradients["export"][name_]) < 2e-2, name_


def test_a_rewritten_model_exports_the_same_program_as_its_fp32_self(bf16, recwarn):
    """Train with rewrite(), deploy with export_program(): the program is the one the FP32 model gives."""
    model, x = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2)), torch.randn(4, 8)
    before = graphamp.export_program(model, (x,), amp_lists=bf16)
    graphamp.rewrite(model, (x,), amp_lists=bf16)

    after = graphamp.export_program(model, (x,), amp_lists=bf16)

    assert after.graph_module.code == before.graph_module.code
    assert floating_decisions(after.graph_module) == floating_decisions(before.graph_module)
    assert not [w for w in recwarn if "graphamp" in str(w.message)]  # export traced the model's own code


# -- black modules, normalizations, levels --------------------------------------------------------------------------

def test_black_modules_keep_every_op_of_the_module_fp32(rewritten):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    lists = AutoMixedPrecisionLists(dtype="bfloat16", custom_black_modules=["2"])
    amp = rewritten.convert(model, (torch.randn(4, 8),), amp_lists=lists)
    with amp.recording() as rec:
        amp.run(torch.randn(4, 8)).sum().backward()
    first, second = rec.calls_of("addmm")[:2]
    assert floating(first.in_dtypes) == {torch.bfloat16}
    assert floating(second.in_dtypes) == {torch.float32}
    sources = {mark_of(n).source for n in amp.graph_module.graph.nodes if getattr(mark_of(n), "module", None) == "2"}
    assert "custom_black_modules: 2" in sources


def test_black_module_glob_pattern_matches_every_layer(rewritten):
    lists = AutoMixedPrecisionLists(dtype="bfloat16", custom_black_modules=["bert.encoder.layer.*.attention"])
    graph_module, _ = rewritten(models.bert(), (), {"input_ids": models.token_batch()}, amp_lists=lists)
    linears = [n for n in graph_module.graph.nodes if n.target == torch.ops.aten.linear.default]
    in_attention = [n for n in linears if ".attention" in mark_of(n).module]
    assert len(in_attention) == 2 * 4  # q, k, v, output dense in each of 2 layers
    assert all(mark_of(n).decision == "black" and n.meta["val"].dtype == torch.float32 for n in in_attention)
    assert {mark_of(n).module for n in in_attention} >= {
        "bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.1.attention.output.dense"
    }  # the model's own named_modules() paths, on both front ends
    assert all(mark_of(n).decision == "white" for n in linears if n not in in_attention)


def test_batch_norm_runs_low_with_fp32_parameters_and_statistics(bf16, rewritten):
    model = models.SmallResNet()
    amp = rewritten.convert(model, (torch.randn(4, 1, 8, 8),), amp_lists=bf16)
    with amp.recording() as rec:
        amp.run(torch.randn(4, 1, 8, 8)).sum().backward()
    batch_norm = rec.calls_of("native_batch_norm", "_native_batch_norm_legit")[0]
    assert batch_norm.in_dtypes[0] == torch.bfloat16 and set(batch_norm.in_dtypes[1:]) == {torch.float32}
    assert model.stem[1].running_mean.dtype == torch.float32
    assert not [path for path in state_placeholders_cast(amp) if path.startswith("stem.1.")]


def test_level_o2_runs_gray_ops_low_and_keeps_norm_parameters_fp32(bf16, rewritten):
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    o2 = rewritten.convert(model, (x,), amp_lists=bf16, level="O2")
    with o2.recording() as rec:
        o2.run(x)
    assert floating(rec.calls_of("addmm")[1].in_dtypes) == {torch.bfloat16}
    layer_norm = rec.calls_of("native_layer_norm")[0]
    # gray op, FP32 params; its input stays low (the kernel accumulates in FP32)
    assert layer_norm.in_dtypes == (torch.bfloat16, torch.float32, torch.float32)
    cast = state_placeholders_cast(o2)
    assert {"0.weight", "0.bias", "2.weight", "2.bias"} <= set(cast)
    assert not {"1.weight", "1.bias"} & set(cast)  # LayerNorm's weight and bias


def test_level_o2_casts_gray_op_fp32_inputs_down(bf16, rewritten):
    o2 = rewritten.convert(LinearThen(torch.add), (torch.randn(2, 8), torch.randn(2, 8)), amp_lists=bf16, level="O2")
    with o2.recording() as rec:
        out = o2.run(torch.randn(2, 8), torch.randn(2, 8))
    assert floating(rec.calls_of("add")[0].in_dtypes) == {torch.bfloat16}
    assert out.dtype == torch.float32  # returned as the FP32 model returns it


def test_unknown_level_is_rejected(bf16, rewritten):
    with pytest.raises(graphamp.ArgumentError, match="level='O3'"):
        rewritten(nn.Linear(2, 2), (torch.randn(1, 2),), amp_lists=bf16, level="O3")


def test_float16_lists_keep_exp_fp32_and_bfloat16_lets_it_follow(bf16, rewritten):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 on CPU is slow, and said so
        fp16, _ = rewritten(
            LinearThen(torch.exp), (torch.randn(2, 8),), amp_lists=AutoMixedPrecisionLists(dtype="float16")
        )
    bf16, _ = rewritten(LinearThen(torch.exp), (torch.randn(2, 8),), amp_lists=bf16)
    (exp16,) = nodes_of(fp16, torch.ops.aten.exp.default)
    (exp_bf,) = nodes_of(bf16, torch.ops.aten.exp.default)
    assert exp16.meta["val"].dtype == torch.float32
    assert exp_bf.meta["val"].dtype == torch.bfloat16


class VmappedMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return torch.vmap(lambda row: torch.tanh(row @ self.weight))(self.linear(x))


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ops_inside_a_vmap_are_cast_by_the_lists(bf16, level, compile):
    """A vmap in the graph: the cast pass works out the casts' values inside the vmap it was traced in (before, any
    cast there failed the rewrite: 'your tensor may have escaped from inside a function being vmapped')."""
    torch.manual_seed(0)
    model, x = VmappedMatmul(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16, level=level, compile=compile)
    with DtypeRecorder() as recorder:
        out = model(x)
        out.sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        expected = reference(x)
    expected.sum().backward()
    if not compile:  # inductor fuses the casts into its kernels; the fx code runs each GEMM as a kernel
        gemms = recorder.calls_of("mm", "addmm")
        assert len(gemms) == 5 and all(d == torch.bfloat16 for c in gemms for d in c.in_dtypes if d.is_floating_point)
    assert relative_error(out, expected) < 1e-2
    for mine, autocasts in zip(model.parameters(), reference.parameters()):
        assert mine.grad.dtype == torch.float32 and relative_error(mine.grad, autocasts.grad) < 2e-2
