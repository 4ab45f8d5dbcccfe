"""The graph passes that cut a call's ops: input-free values computed once (HF's causal mask) and repeated
key/value heads handed to SDPA as grouped-query attention. Each must leave every value and gradient as it was."""

import copy

import pytest
import torch
from torch import nn

import graphamp
import graphamp.amp_module
import models
from graphamp.runtime.input_free_values import MAX_KEPT_BYTES

BF16 = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")


def _targets(run):
    return [node.target for node in run.graph.nodes if node.op == "call_function"]


def _rewrite_with_and_without_passes(model, monkeypatch, **example):
    """The model rewritten twice from one set of weights: as shipped, and with both passes turned off."""
    plain_model = copy.deepcopy(model)
    simplified = graphamp.rewrite(model, amp_lists=BF16, progress=False, **example)
    with monkeypatch.context() as patch:
        patch.setattr(graphamp.amp_module, "compute_input_free_values", lambda graph_module: None)
        patch.setattr(graphamp.amp_module, "attend_grouped_queries", lambda graph_module: None)
        plain = graphamp.rewrite(plain_model, amp_lists=BF16, progress=False, **example)
        plain(*example.get("example_args", ()), **example.get("example_kwargs", {}))  # captured with them off
    return simplified, plain, model, plain_model


def test_a_llama_call_builds_no_mask_and_repeats_no_heads_and_trains_as_before(monkeypatch):
    torch.manual_seed(0)
    ids = models.token_batch(2, 16)
    batch = {"input_ids": ids, "labels": ids}
    reference = models.llama()
    simplified, plain, model, plain_model = _rewrite_with_and_without_passes(
        copy.deepcopy(reference), monkeypatch, example_kwargs=batch
    )
    losses = [amp(**batch).loss for amp in (simplified, plain)]
    for loss in losses:
        loss.backward()
    run, plain_run = simplified.captures[-1].run, plain.captures[-1].run
    assert torch.ops.aten.arange.default in _targets(plain_run)
    assert torch.ops.aten.arange.default not in _targets(run)  # the mask is read, not rebuilt
    attention = [n for n in run.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert attention and all(n.kwargs.get("enable_gqa") for n in attention)
    assert all(n.args[1].meta["val"].shape[1] == 2 for n in attention)  # the 2 key/value heads, not 4 copies
    assert torch.ops.aten.expand.default not in _targets(run)
    assert len(run.graph.nodes) < len(plain_run.graph.nodes) - 40
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    # The gradients differ in rounding only: grouped heads sum the key/value gradients in float32 inside SDPA's
    # kernel, where the repeat summed bfloat16 copies in expand's backward. Both are held to FP32 eager's.
    reference(**batch).loss.backward()
    plain_parameters, fp32 = dict(plain_model.named_parameters()), dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        error, plain_error = (_relative_error(p.grad, fp32[name].grad) for p in (parameter, plain_parameters[name]))
        assert error <= max(1.5 * plain_error, 1e-3), name  # a wrong head mapping would be O(1)


def _relative_error(got, want):
    return float((got - want).detach().norm() / want.detach().norm())


class MaskedAttention(nn.Module):
    """A causal mask built from the sequence length alone, as HF builds it under torch.export."""

    def __init__(self):
        super().__init__()
        self.project = nn.Linear(8, 8)

    def forward(self, x):
        positions = torch.arange(x.shape[1])
        mask = positions[None, :] <= positions[:, None]
        scores = (self.project(x) @ x.transpose(1, 2)).masked_fill(~mask, -1e4)
        return scores.softmax(-1) @ x


def test_an_input_free_mask_is_computed_once_and_the_outputs_and_gradients_are_unchanged(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    simplified, plain, model, plain_model = _rewrite_with_and_without_passes(
        MaskedAttention(), monkeypatch, example_args=(x,)
    )
    plain(x)
    kept = dict(simplified.captures[-1].run.named_buffers())
    assert len(kept) == 1 and next(iter(kept.values())).dtype == torch.bool
    for amp in (simplified, plain):
        amp(x).square().sum().backward()
    torch.testing.assert_close(simplified(x), plain(x), rtol=0, atol=0)
    torch.testing.assert_close(model.project.weight.grad, plain_model.project.weight.grad, rtol=0, atol=0)


class WritesIntoAFreshTensor(nn.Module):
    def forward(self, x):
        total = torch.zeros(3)
        total.add_(x.sum())  # an in-place write: a shared constant would accumulate over calls
        return total * 2


class ReturnsAnInputFreeValue(nn.Module):
    def forward(self, x):
        return x * 2, torch.arange(4.0)


class DrawsNoise(nn.Module):
    def forward(self, x):
        return x + torch.rand(3)


class BuildsALargeTable(nn.Module):
    def forward(self, x):
        return x + torch.ones(MAX_KEPT_BYTES // 4 + 1)[:3]  # a view keeps its whole storage


@pytest.mark.parametrize(
    "module", [WritesIntoAFreshTensor, ReturnsAnInputFreeValue, DrawsNoise, BuildsALargeTable], ids=lambda m: m.__name__
)
def test_values_that_could_change_or_escape_or_cost_memory_are_computed_every_call(module):
    torch.manual_seed(0)
    x = torch.randn(3)
    amp = graphamp.rewrite(module(), (x,), amp_lists=BF16, progress=False)
    assert not dict(amp.captures[-1].run.named_buffers())
    for _ in range(2):
        torch.manual_seed(1)
        expected = module()(x)
        torch.manual_seed(1)
        got = amp(x)
        for want, have in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)):
            torch.testing.assert_close(have, want)
        if module is ReturnsAnInputFreeValue:
            got[1].add_(100)  # the caller's to change: the next call must not see it


def test_values_computed_when_the_first_call_runs_under_inference_mode_still_train():
    """The graph made for an inference-mode call serves training calls too: its kept values must be ordinary
    tensors, which autograd can save for backward (masked_fill saves the mask)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    model = MaskedAttention()
    with torch.inference_mode():  # rewrite captures here, and makes the graph's kept values
        amp = graphamp.rewrite(model, (x,), amp_lists=BF16, progress=False)
        amp(x)
    assert dict(amp.captures[-1].run.named_buffers())
    amp(x).square().sum().backward()
    assert model.project.weight.grad is not None


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
    from graphamp.runtime.grouped_query_attention import attend_grouped_queries

    graph_module, inputs = _repeated_heads_attention(with_mask)
    grouped = copy.deepcopy(graph_module)
    attend_grouped_queries(grouped)
    attention = [n for n in grouped.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(attention) == 1 and attention[0].kwargs.get("enable_gqa") is True
    torch.testing.assert_close(grouped(*inputs), graph_module(*inputs))
    # Off a CPU, SDPA's kernels that take a mask do not group (it would fall back to its math path): keep the repeat.
    query = next(n for n in graph_module.graph.nodes if n.op == "placeholder")
    query.meta["val"] = torch.empty(query.meta["val"].shape, device="meta")
    attend_grouped_queries(graph_module)
    grouped_elsewhere = any(n.kwargs.get("enable_gqa") for n in graph_module.graph.nodes)
    assert grouped_elsewhere is (not with_mask)


def test_a_compiled_llama_with_grouped_heads_and_a_kept_mask_trains_as_the_eager_rewrite():
    """Inductor compiles the graph that reads the kept mask and calls SDPA with enable_gqa."""
    torch.manual_seed(0)
    ids = models.token_batch(2, 16)
    batch = {"input_ids": ids, "labels": ids}
    model = models.llama()
    eager_model = copy.deepcopy(model)
    compiled = graphamp.rewrite(model, example_kwargs=batch, amp_lists=BF16, compile=True, progress=False)
    eager = graphamp.rewrite(eager_model, example_kwargs=batch, amp_lists=BF16, progress=False)
    losses = [amp(**batch).loss for amp in (compiled, eager)]
    for loss in losses:
        loss.backward()
    # Inductor reorders bfloat16 arithmetic: 3e-6 on the loss, 6e-3 on the worst gradient (2026-11-25).
    assert _relative_error(losses[0], losses[1]) < 1e-3
    eager_parameters = dict(eager_model.named_parameters())
    for name, parameter in model.named_parameters():
        assert _relative_error(parameter.grad, eager_parameters[name].grad) < 3e-2, name


def test_the_eager_graph_runs_fx_s_code_with_its_ops_bound_as_globals():
    """Same outputs and gradients as fx's own code; `.code` stays fx's, and recompile() writes fx's forward back."""
    torch.manual_seed(0)
    ids = models.token_batch(2, 16)
    amp = graphamp.rewrite(models.llama(), example_kwargs={"input_ids": ids, "labels": ids}, amp_lists=BF16)
    amp(input_ids=ids, labels=ids)
    run = amp.captures[-1].run
    bound_names = type(run).forward.__code__.co_names
    assert "ops" not in bound_names and any(name.startswith("_op_aten_") for name in bound_names)
    assert "torch.ops.aten" in run.code  # what the inspection tools show is fx's

    lifted = [source.get() for source in amp.captures[-1].lifted]
    inputs = [*lifted, ids, ids]
    bound = run(*inputs)
    run.recompile()
    assert "ops" in type(run).forward.__code__.co_names
    fx_own = run(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(bound, fx_own))
