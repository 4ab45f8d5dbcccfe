"""autocast's promote rule: mixed float16/bfloat16/float32 inputs of promote.txt's ops meet at the widest dtype; and
PyTorch's own autocast test table, read against the lists through both front ends."""

import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import graphamp
from autocast_table import PROMOTE_GROUPS, entries
from conftest import FrontEnd
from graphamp.inspection.recording import floating
from graphamp.passes.marks import mark_of
from training import TORCH_BEFORE_2_13

CAST = torch.ops.aten._to_copy.default


class Call(nn.Module):
    """One call of `function`, its tensors as the module's inputs and everything else fixed."""

    def __init__(self, function, args, kwargs):
        super().__init__()
        self.function = function
        self.leaves, self.spec = pytree.tree_flatten((args, kwargs))

    def forward(self, *tensors):
        given = iter(tensors)
        leaves = [next(given) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.function(*args, **kwargs)


def _runs_on_cpu(function, args, kwargs) -> bool:
    """cudnn_convolution and the like have no CPU kernel at all: the table cannot be read on CPU for them."""
    as_fp32 = pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                              (args, kwargs))
    try:
        function(*as_fp32[0], **as_fp32[1])
        return True
    except (NotImplementedError, RuntimeError, TypeError):
        return False


def _runs_eagerly_as_given(function, args, kwargs) -> bool:
    """Whether the FP32 model runs the call as it is, without autocast (dot of a float16 and a float32 does not)."""
    try:
        function(*args, **kwargs)
        return True
    except (RuntimeError, TypeError):
        return False


def _returns_a_tensor(function, args, kwargs) -> bool:
    as_fp32 = pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                              (args, kwargs))
    return any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(function(*as_fp32[0], **as_fp32[1])))


class TableCalls(nn.Module):
    """Many calls as one model (one capture for a whole table): each call's tensors are inputs of its own, and its
    first output tensor is one output of the model, in order."""

    def __init__(self, calls):
        super().__init__()
        self.calls = nn.ModuleList(Call(function, args, kwargs) for function, args, kwargs in calls)
        self.sizes = [sum(isinstance(leaf, torch.Tensor) for leaf in call.leaves) for call in self.calls]

    def forward(self, *tensors):
        given, outputs = iter(tensors), []
        for call, size in zip(self.calls, self.sizes):
            out = call(*(next(given) for _ in range(size)))
            outputs.append(next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)))
        return tuple(outputs)

    def inputs(self):
        """A copy of each call's tensors: no two calls share an input, as no two share one in the table."""
        return tuple(leaf.clone() for call in self.calls for leaf in call.leaves if isinstance(leaf, torch.Tensor))


def _computed_dtypes(graph_module) -> list:
    """The dtype the rewritten graph computes each output in, before the cast back to the dtype the model returns
    it in: what autocast's table expects."""
    output = graph_module.graph.find_nodes(op="output")[0]
    computed = []
    for value in pytree.tree_leaves(output.args):
        if getattr(mark_of(value), "decision", None) == "inserted-cast":
            value = value.args[0]
        computed.append(value.meta["val"].dtype)
    return computed


def _table(front_end: str):
    """The table's entries a front end is judged on: those with a CPU kernel. torch.compile keeps eager semantics:
    the promote entries the FP32 model itself refuses (mixed float16/float32 inputs of an op without type
    promotion, which only autocast runs) are refused under rewrite() too (tested below), while export_program
    captures them with autocast's promotion."""
    for group, op, function, args, kwargs, expected in entries():
        if isinstance(args, str) or not _runs_on_cpu(function, args, kwargs):
            continue  # einsum's entry is skipped by PyTorch's own test too
        if front_end == "compile" and group in PROMOTE_GROUPS and not _runs_eagerly_as_given(function, args, kwargs):
            continue
        yield group, op, function, args, kwargs, expected


@pytest.mark.parametrize("front_end", [
    pytest.param("compile", marks=pytest.mark.skipif(
        TORCH_BEFORE_2_13, reason="torch 2.11's dynamo cannot trace this test's table (a module attribute holding a "
        "builtin function, called with fullgraph=True)")),
    "export",
])
def test_agreement_with_pytorchs_autocast_test_table_is_at_least_95_percent(front_end, fp16):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the table calls deprecated ops (chain_matmul, cross without dim)
        table = list(_table(front_end))
        judged = [(f"{group}.{op}", function, args, kwargs, expected)
                  for group, op, function, args, kwargs, expected in table if _returns_a_tensor(function, args, kwargs)]
        model = TableCalls([(function, args, kwargs) for _, function, args, kwargs, _ in judged])
        amp = FrontEnd(front_end).convert(model, model.inputs(), amp_lists=fp16)
        amp.run(*model.inputs())  # the rewritten table runs
    computed = _computed_dtypes(amp.graph_module)

    disagree = [name for (name, *_, expected), dtype in zip(judged, computed) if dtype != expected]
    disagree += [f"{group}.{op} returns no tensor" for group, op, function, args, kwargs, _ in table
                 if not _returns_a_tensor(function, args, kwargs)]
    share = 1 - len(disagree) / len(table)
    assert len(computed) == len(judged) and len(table) > 100
    assert share >= 0.95, (share, disagree)


def _keywords(op) -> dict:
    return {"dim": 0} if op is torch.cross else {}  # torch.cross without dim is deprecated


@pytest.mark.parametrize("op", [torch.dot, torch.vdot, torch.atan2, torch.cross])
def test_mixed_precision_inputs_of_a_promote_op_export_and_compute_in_fp32(op, fp16):
    a, b = torch.randn(3, dtype=torch.float16), torch.randn(3)
    program = graphamp.export_program(Call(op, (a, b), _keywords(op)), (a, b), amp_lists=fp16)
    out = program.module()(a, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, op(a.float(), b, **_keywords(op)))


# The dtype the FP32 model returns, as dynamo traces it: atan2 promotes; cross's meta kernel says float16 (its CPU
# kernel refuses the mix outright, so eager has no answer), and the rewritten graph returns what the trace says.
RETURNED_UNDER_DYNAMO = {torch.atan2: torch.float32, torch.cross: torch.float16}


@pytest.mark.parametrize("op", RETURNED_UNDER_DYNAMO)
def test_mixed_precision_inputs_of_a_promote_op_are_computed_in_fp32_by_rewrite(op, fp16):
    a, b = torch.randn(3, dtype=torch.float16), torch.randn(3)
    amp = FrontEnd("compile").convert(Call(op, (a, b), _keywords(op)), (a, b), amp_lists=fp16)
    (node,) = [n for n in amp.graph_module.graph.nodes if n.op == "call_function" and n.target != CAST]
    assert {value.meta["val"].dtype for value in node.all_input_nodes} == {torch.float32}
    out = amp.run(a, b)
    assert out.dtype == RETURNED_UNDER_DYNAMO[op]
    torch.testing.assert_close(out.float(), op(a.float(), b, **_keywords(op)), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("op", [torch.dot, torch.vdot])
def test_mixed_precision_inputs_eager_refuses_are_refused_by_rewrite_as_by_eager(op, fp16):
    """Under torch.compile the model keeps eager semantics: what the FP32 model cannot run, it cannot run rewritten."""
    a, b = torch.randn(3, dtype=torch.float16), torch.randn(3)
    with pytest.raises(RuntimeError, match="expected both vectors to have same dtype"):
        op(a, b)
    with pytest.raises(Exception, match="expected both vectors to have same dtype"):
        graphamp.rewrite(Call(op, (a, b), {}), (a, b), amp_lists=fp16)


class ScoresIntoFP32Buffer(nn.Module):
    """A low-precision linear's output written into an FP32 tensor: index_put's kernel wants one dtype."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, rows):
        return torch.index_put(torch.zeros(4, 8), (rows,), self.fc(x))


def test_promote_op_gets_explicit_casts_in_the_pass(rewritten, bf16, seeded):
    model, x, rows = ScoresIntoFP32Buffer(), torch.randn(2, 8), torch.tensor([1, 3])
    expected = model(x, rows)
    amp = rewritten.convert(model, (x, rows), amp_lists=bf16)
    with amp.recording() as rec:
        out = amp.run(x, rows)
    (put,) = rec.calls_of("index_put")
    assert floating(put.in_dtypes) == {torch.float32}
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_lists_folder_without_promote_file_promotes_nothing(write_lists, tmp_path):
    folder = write_lists(tmp_path / "mine", gray="cat\n")
    assert graphamp.AutoMixedPrecisionLists(lists_dir=folder).promote_ops == frozenset()


class MixedInnerProduct(nn.Module):
    """A model written for autocast: the inner product of its own bfloat16 vector and a float32 one (eager and
    torch.export refuse the mix)."""

    def __init__(self):
        super().__init__()
        self.vector = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.inner(self.vector.bfloat16(), x)


def test_export_program_captures_with_the_users_promote_list_not_the_shipped_one(write_lists, tmp_path):
    """export_program's capture meets mixed inputs at the widest for the ops of the lists' own promote.txt."""
    model, x = MixedInnerProduct(), torch.randn(4)
    with pytest.raises(graphamp.CaptureError):  # the shipped promote.txt has no inner: eager's refusal stands
        graphamp.export_program(model, (x,), amp_lists=graphamp.AutoMixedPrecisionLists(dtype="bfloat16"))
    mine = graphamp.AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=write_lists(tmp_path / "mine", promote="inner\n"))
    program = graphamp.export_program(model, (x,), amp_lists=mine)
    expected = torch.inner(model.vector.bfloat16().float(), x)
    torch.testing.assert_close(program.module()(x).float(), expected, atol=2e-2, rtol=2e-2)
