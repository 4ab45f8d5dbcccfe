"""The pass after the casts that cuts a call's ops (graphamp.passes.PASSES_AFTER_CASTS): repeated key/value heads
handed to SDPA as grouped-query attention, on both front ends. It must leave every value and gradient as it was.
And what a call computes afresh (a tensor it fills in place, noise, a value it returns) stays fresh every call."""

import copy

import pytest
import torch
from torch import nn

import graphamp
import graphamp.passes
import models
from conftest import FrontEnd
from graphamp.passes.grouped_query_attention import attend_grouped_queries

BF16 = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _targets(graph_module):
    return [node.target for node in graph_module.graph.nodes if node.op == "call_function"]


def _relative_error(got, want):
    return float((got - want).detach().norm() / want.detach().norm())


# The Llamas here have one layer: each layer repeats its heads alike, and dynamo's and inductor's time grows with them.
LLAMA_LAYERS = 1


@pytest.mark.parametrize("front_end", ["compile", "export"])
def test_a_llama_call_repeats_no_heads_and_trains_as_before(front_end, monkeypatch):
    torch.manual_seed(0)
    ids = models.token_batch(2, 16)
    batch = {"input_ids": ids, "labels": ids}
    reference = models.llama(num_hidden_layers=LLAMA_LAYERS)
    reference.loss_type = "ForCausalLM"  # named, so that transformers' warning about it does not break the graph
    model, plain_model = copy.deepcopy(reference), copy.deepcopy(reference)
    grouped = FrontEnd(front_end).convert(model, (), batch, amp_lists=BF16)
    with monkeypatch.context() as patch:
        patch.setattr(graphamp.passes, "PASSES_AFTER_CASTS", ())
        plain = FrontEnd(front_end).convert(plain_model, (), batch, amp_lists=BF16)

    attention = [n for n in grouped.graph_module.graph.nodes if n.target is SDPA]
    assert attention and all(n.kwargs.get("enable_gqa") for n in attention)
    assert all(n.args[1].meta["val"].shape[1] == 2 for n in attention)  # the 2 key/value heads, not 4 copies
    expands = [_targets(amp.graph_module).count(torch.ops.aten.expand.default) for amp in (plain, grouped)]
    assert expands[0] - expands[1] == 2 * LLAMA_LAYERS  # repeat_kv's expand of the keys and of the values, per layer
    losses = [amp.run(**batch).loss for amp in (grouped, plain)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    # The gradients differ in rounding only: grouped heads sum the key/value gradients in float32 inside SDPA's
    # kernel, where the repeat summed bfloat16 copies in expand's backward. Both are held to FP32 eager's.
    reference(**batch).loss.backward()
    plain_parameters, fp32 = dict(plain_model.named_parameters()), dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        error, plain_error = (_relative_error(p.grad, fp32[name].grad) for p in (parameter, plain_parameters[name]))
        assert error <= max(1.5 * plain_error, 1e-3), name  # a wrong head mapping would be O(1)


def _repeated_heads_attention(with_mask: bool) -> torch.fx.GraphModule:
    """SDPA over key/value heads repeated as HF's repeat_kv does, traced to ATen (with FakeTensor values)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def repeat(x):
        return x[:, :, None].expand(2, 2, 2, 8, 4).reshape(2, 4, 8, 4)

    def attend(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, repeat(k), repeat(v), mask if with_mask else None)

    q, k, v = torch.randn(2, 4, 8, 4), torch.randn(2, 2, 8, 4), torch.randn(2, 2, 8, 4)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    return make_fx(attend, tracing_mode="fake", pre_dispatch=True)(q, k, v, mask), (q, k, v, mask)


@pytest.mark.parametrize("with_mask", [True, False])
def test_repeated_heads_are_grouped_on_a_cpu_and_off_it_only_without_a_mask(with_mask):
    graph_module, inputs = _repeated_heads_attention(with_mask)
    grouped = copy.deepcopy(graph_module)
    attend_grouped_queries(grouped)
    attention = [n for n in grouped.graph.nodes if n.target is SDPA]
    assert len(attention) == 1 and attention[0].kwargs.get("enable_gqa") is True
    torch.testing.assert_close(grouped(*inputs), graph_module(*inputs))
    # Off a CPU, SDPA's kernels that take a mask do not group (it would fall back to its math path): keep the repeat.
    query = next(n for n in graph_module.graph.nodes if n.op == "placeholder")
    query.meta["val"] = torch.empty(query.meta["val"].shape, device="meta")
    attend_grouped_queries(graph_module)
    grouped_elsewhere = any(n.kwargs.get("enable_gqa") for n in graph_module.graph.nodes)
    assert grouped_elsewhere is (not with_mask)


def test_a_llama_compiled_by_inductor_with_grouped_heads_trains_as_the_fx_code_rewrite():
    """Inductor compiles the graph that calls SDPA with enable_gqa."""
    torch.manual_seed(0)
    ids = models.token_batch(2, 16)
    batch = {"input_ids": ids, "labels": ids}
    model = models.llama(num_hidden_layers=LLAMA_LAYERS)
    eager_model = copy.deepcopy(model)
    compiled = graphamp.rewrite(model, example_kwargs=batch, amp_lists=BF16, compile=True)
    eager = graphamp.rewrite(eager_model, example_kwargs=batch, amp_lists=BF16)
    attention = [n for graph in graphamp.rewritten_graphs(compiled) for n in graph.graph_module.graph.nodes
                 if n.target is SDPA]
    assert attention and all(n.kwargs.get("enable_gqa") for n in attention)
    losses = [amp(**batch).loss for amp in (compiled, eager)]
    for loss in losses:
        loss.backward()
    # Inductor reorders bfloat16 arithmetic: 3e-6 on the loss, 6e-3 on the worst gradient (2026-11-25).
    assert _relative_error(losses[0], losses[1]) < 1e-3
    eager_parameters = dict(eager_model.named_parameters())
    for name, parameter in model.named_parameters():
        assert _relative_error(parameter.grad, eager_parameters[name].grad) < 3e-2, name


class GroupedAttentionThenVmap(nn.Module):
    """Llama's attention (repeat_kv's repeated key/value heads, a causal mask) and a torch.vmap in one forward."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
        self.head_scale = nn.Parameter(torch.randn(8))

    def forward(self, x):
        batch, length, _ = x.shape
        q = self.query(x).view(batch, length, 4, 8).transpose(1, 2)
        k, v = (p(x).view(batch, length, 2, 8).transpose(1, 2) for p in (self.key, self.value))
        k, v = (t[:, :, None].expand(batch, 2, 2, length, 8).reshape(batch, 4, length, 8) for t in (k, v))
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return torch.vmap(lambda row: row * self.head_scale)(attended)


@pytest.mark.parametrize("compile", [False, True], ids=["fx", "inductor"])
def test_grouping_heads_keeps_a_vmap_in_the_same_graph(compile):
    """The pass removes the repeats it replaced and nothing else: vmap's nesting calls have no users but must run
    (Jamba's and Mamba's scans vmap in the graph of their attention layers)."""
    torch.manual_seed(0)
    model, x = GroupedAttentionThenVmap(), torch.randn(2, 6, 32)
    want = model(x)
    graphamp.rewrite(model, (x,), amp_lists=BF16, compile=compile)
    attention = [n for graph in graphamp.rewritten_graphs(model) for n in graph.graph_module.graph.nodes
                 if n.target is SDPA]
    assert attention and all(n.kwargs.get("enable_gqa") for n in attention)
    assert _relative_error(model(x), want) < 2e-2  # bfloat16's rounding; a lost vmap fails to run at all


# -- what a call computes afresh ------------------------------------------------------------------------------

class WritesIntoAFreshTensor(nn.Module):
    def forward(self, x):
        total = torch.zeros(3)
        total.add_(x.sum())  # an in-place write: a value kept across calls would accumulate
        return total * 2


class ReturnsAnInputFreeValue(nn.Module):
    def forward(self, x):
        return x * 2, torch.arange(4.0)


class DrawsNoise(nn.Module):
    def forward(self, x):
        return x + torch.rand(3)


@pytest.mark.parametrize("module", [WritesIntoAFreshTensor, ReturnsAnInputFreeValue, DrawsNoise],
                         ids=lambda m: m.__name__)
def test_values_a_call_makes_without_its_inputs_are_made_every_call(rewritten, module):
    torch.manual_seed(0)
    x = torch.randn(3)
    amp = rewritten.convert(module(), (x,), amp_lists=BF16)
    for seed in (1, 2):
        torch.manual_seed(seed)
        expected = module()(x)
        torch.manual_seed(seed)
        got = amp.run(x)
        for want, have in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)):
            torch.testing.assert_close(have, want)
        if module is ReturnsAnInputFreeValue:
            got[1].add_(100)  # the caller's to change: the next call must not see it


def test_each_pass_runs_by_its_name_and_reports_its_time(bf16, monkeypatch):
    """The passes run from one named list under torch.fx's GraphTransformObserver; each graph's timings name them."""
    from torch.fx.passes.graph_transform_observer import GraphTransformObserver

    seen = []
    original = GraphTransformObserver.apply_gm_pass

    def recording(observer, pass_fn):
        seen.append((observer.subsystem, observer.passname))
        return original(observer, pass_fn)

    monkeypatch.setattr(GraphTransformObserver, "apply_gm_pass", recording)
    model = graphamp.rewrite(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=bf16)
    assert seen == [("graphamp", "cast"), ("graphamp", "grouped_query_attention")]
    timings = graphamp.rewritten_graphs(model)[0].timings
    assert {"pass cast", "pass grouped_query_attention"} <= set(timings)
