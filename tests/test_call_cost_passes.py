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

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _targets(graph_module):
    return [node.target for node in graph_module.graph.nodes if node.op == "call_function"]


def _relative_error(got, want):
    return float((got - want).detach().norm() / want.detach().norm())


def _llama_and_batch():
    torch.manual_seed(0)
    ids = models.token_batch(2, 16)
    reference = models.llama()
    reference.loss_type = "ForCausalLM"  # named, so that transformers' warning about it does not break the graph
    return reference, {"input_ids": ids, "labels": ids}


def _attention(model):
    return [n for graph in graphamp.rewritten_graphs(model) for n in graph.graph_module.graph.nodes if n.target is SDPA]


def test_a_llama_call_without_gradients_on_a_cpu_repeats_no_heads_and_gives_the_same_logits(bf16, monkeypatch):
    reference, batch = _llama_and_batch()
    model, plain_model = copy.deepcopy(reference), copy.deepcopy(reference)
    graphamp.rewrite(model, amp_lists=bf16)
    with monkeypatch.context() as patch:
        patch.setattr(graphamp.passes, "PASSES_AFTER_CASTS", ())
        graphamp.rewrite(plain_model, amp_lists=bf16)
        with torch.no_grad():
            plain_logits = plain_model(**batch).logits
    with torch.no_grad():
        logits = model(**batch).logits

    attention = _attention(model)
    assert attention and all(n.kwargs.get("enable_gqa") for n in attention)
    assert all(n.args[1].meta["val"].shape[1] == 2 for n in attention)  # the 2 key/value heads, not 4 copies
    expands = [sum(_targets(g.graph_module).count(torch.ops.aten.expand.default) for g in graphamp.rewritten_graphs(m))
               for m in (plain_model, model)]
    assert expands[0] - expands[1] == 2 * 2  # repeat_kv's expand of the keys and of the values, in 2 layers
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=0)


@pytest.mark.parametrize("front_end", ["compile", "export"])
def test_a_llama_train_step_on_a_cpu_keeps_the_repeated_heads_whose_backward_is_faster(bf16, front_end, monkeypatch):
    """The CPU flash kernel's grouped backward is slower than the repeat's: a differentiated attention keeps it, and
    trains exactly as without the pass."""
    reference, batch = _llama_and_batch()
    model, plain_model = copy.deepcopy(reference), copy.deepcopy(reference)
    repeated = FrontEnd(front_end).convert(model, (), batch, amp_lists=bf16)
    with monkeypatch.context() as patch:
        patch.setattr(graphamp.passes, "PASSES_AFTER_CASTS", ())
        plain = FrontEnd(front_end).convert(plain_model, (), batch, amp_lists=bf16)

    attention = [n for n in repeated.graph_module.graph.nodes if n.target is SDPA]
    assert attention and not any(n.kwargs.get("enable_gqa") for n in attention)
    losses = [amp.run(**batch).loss for amp in (repeated, plain)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    plain_parameters = dict(plain_model.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, plain_parameters[name].grad, rtol=0, atol=0)


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
    # The grouped graph's gradients are the repeat's (the sums over each group happen inside SDPA's backward).
    q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
    q2, k2, v2 = (t.clone().requires_grad_() for t in inputs[:3])
    grouped(q, k, v, inputs[3]).sum().backward()
    graph_module(q2, k2, v2, inputs[3]).sum().backward()
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want)
    # Off a CPU, SDPA's kernels that take a mask do not group (it would fall back to its math path): keep the repeat.
    query = next(n for n in graph_module.graph.nodes if n.op == "placeholder")
    query.meta["val"] = torch.empty(query.meta["val"].shape, device="meta")
    attend_grouped_queries(graph_module)
    grouped_elsewhere = any(n.kwargs.get("enable_gqa") for n in graph_module.graph.nodes)
    assert grouped_elsewhere is (not with_mask)


def test_a_differentiated_attention_on_a_cpu_keeps_its_repeated_heads():
    from torch.fx.experimental.proxy_tensor import make_fx

    def attend(q, k, v):
        repeat = lambda x: x[:, :, None].expand(2, 2, 2, 8, 4).reshape(2, 4, 8, 4)  # noqa: E731
        return torch.nn.functional.scaled_dot_product_attention(q, repeat(k), repeat(v))

    inputs = [torch.randn(2, 4, 8, 4, requires_grad=True)] + [torch.randn(2, 2, 8, 4) for _ in range(2)]
    graph_module = make_fx(attend, tracing_mode="fake", pre_dispatch=True)(*inputs)
    attend_grouped_queries(graph_module)
    assert not any(n.kwargs.get("enable_gqa") for n in graph_module.graph.nodes if n.target is SDPA)


def test_a_llama_compiled_by_inductor_with_grouped_heads_gives_the_fx_code_rewrites_logits(bf16):
    """Inductor compiles the graph that calls SDPA with enable_gqa (a call without gradients, on a CPU)."""
    torch.manual_seed(0)
    # One layer and no labels: each layer and the loss are C++ kernels of their own, and the logits are compared.
    model, ids = models.llama(num_hidden_layers=1), models.token_batch(2, 16)
    eager_model = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16, compile=True)
    graphamp.rewrite(eager_model, amp_lists=bf16)
    with torch.no_grad():
        logits = [amp(input_ids=ids).logits for amp in (model, eager_model)]
    attention = _attention(model)
    assert attention and all(n.kwargs.get("enable_gqa") for n in attention)
    # Inductor reorders bfloat16 arithmetic.
    assert _relative_error(logits[0], logits[1]) < 1e-2


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
def test_grouping_heads_keeps_a_vmap_in_the_same_graph(bf16, compile):
    """The pass removes the repeats it replaced and nothing else: vmap's nesting calls have no users but must run
    (Jamba's and Mamba's scans vmap in the graph of their attention layers)."""
    torch.manual_seed(0)
    model, x = GroupedAttentionThenVmap(), torch.randn(2, 6, 32)
    with torch.no_grad():  # on a CPU, an attention without gradients groups its heads
        want = model(x)
        graphamp.rewrite(model, (x,), amp_lists=bf16, compile=compile)
        got = model(x)
    attention = _attention(model)
    assert attention and all(n.kwargs.get("enable_gqa") for n in attention)
    assert _relative_error(got, want) < 2e-2  # bfloat16's rounding; a lost vmap fails to run at all


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
def test_values_a_call_makes_without_its_inputs_are_made_every_call(bf16, rewritten, module):
    torch.manual_seed(0)
    x = torch.randn(3)
    amp = rewritten.convert(module(), (x,), amp_lists=bf16)
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
    original = GraphTransformObserver.__enter__

    def recording(observer):  # each pass runs inside its observer (the cast pass unskippable, the rest apply_gm_pass)
        seen.append((observer.subsystem, observer.passname))
        return original(observer)

    monkeypatch.setattr(GraphTransformObserver, "__enter__", recording)
    model = graphamp.rewrite(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=bf16)
    assert seen == [("graphamp", "cast"), ("graphamp", "grouped_query_attention")]
    timings = graphamp.rewritten_graphs(model)[0].timings
    assert {"pass cast", "pass grouped_query_attention"} <= set(timings)
