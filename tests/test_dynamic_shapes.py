"""New batch sizes and sequence lengths: dynamo's automatic dynamic (or rewrite(dynamic=True/False)) decides which
graph serves them; every size trains as the FP32 model does, and graphamp says when a call ran none of its graphs.

Dynamo remembers the sizes a code object has seen across every model of the process, so whether a model's first
graph is static depends on the models before it: the tests count graphs only with dynamic=True/False, or after the
sizes have varied (when automatic dynamic has made them dynamic either way).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import graphamp
from models import gpt2, token_batch
from training import relative_error

BF16_RTOL = 2e-2
# (batch, sequence length) of an epoch of variable-length batches; the batch size varies too (a partial batch).
EPOCH = [(4, 12), (3, 7), (4, 16), (4, 9), (3, 5), (4, 14), (2, 11)]


def graph_count(model) -> int:
    return len(graphamp.rewritten_graphs(model))


def is_dynamic(graph) -> bool:
    """Whether any input of the graph has a symbolic size."""
    values = [node.meta.get("val") for node in graph.graph_module.graph.find_nodes(op="placeholder")]
    return any(isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape) for v in values)


def epoch_batches():
    return [token_batch(batch, length, seed=seed) for seed, (batch, length) in enumerate(EPOCH)]


@pytest.fixture(scope="module")
def gpt2_epochs(bf16):
    """GPT-2 and its FP32 copy through two training epochs of variable-length batches, then two eval epochs:
    the losses and logits of each, and the number of graphs after each epoch."""
    torch.manual_seed(0)
    model = gpt2(n_layer=1)  # the sizes are what varies: one block compiles each graph in two thirds of the time
    reference = copy.deepcopy(model)
    ids = token_batch(*EPOCH[0])
    graphamp.rewrite(model, (), {"input_ids": ids, "labels": ids}, amp_lists=bf16)
    losses, expected_losses, graphs = [], [], []
    for _ in range(2):
        for ids in epoch_batches():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
            expected_losses.append(reference(input_ids=ids, labels=ids).loss.detach())
        graphs.append(graph_count(model))
    model.eval(), reference.eval()
    logits, expected_logits = [], []
    with torch.no_grad():
        for _ in range(2):
            for ids in epoch_batches():
                logits.append(model(input_ids=ids).logits)
                expected_logits.append(reference(input_ids=ids).logits)
            graphs.append(graph_count(model))
    return {"losses": (losses, expected_losses), "logits": (logits, expected_logits), "graphs": graphs}


def test_every_batch_of_a_variable_length_epoch_trains_with_the_fp32_loss(gpt2_epochs):
    losses, expected = gpt2_epochs["losses"]
    assert len(losses) == 2 * len(EPOCH)
    for loss, expected_loss in zip(losses, expected):
        assert relative_error(loss, expected_loss) < BF16_RTOL


def test_the_second_epoch_of_variable_lengths_compiles_no_new_graph(gpt2_epochs):
    first_epoch, second_epoch, _, _ = gpt2_epochs["graphs"]
    assert second_epoch == first_epoch


def test_eval_over_variable_lengths_gives_the_fp32_logits_and_compiles_once(gpt2_epochs):
    logits, expected = gpt2_epochs["logits"]
    for ours, theirs in zip(logits, expected):
        assert ours.shape == theirs.shape and ours.dtype == torch.float32
        assert relative_error(ours, theirs) < BF16_RTOL
    _, trained, first_eval, second_eval = gpt2_epochs["graphs"]
    assert first_eval > trained  # eval mode is a graph of its own (dropout, no loss) ...
    assert second_eval == first_eval  # ... already dynamic in the sizes training varied


# -- rewrite(dynamic=...) -------------------------------------------------------------------------------------------


class TinyAttention(nn.Module):
    """Embedding, one attention head (views, transposes, batched matmuls, a broadcast mask), a loss."""

    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.embed, self.qkv, self.head = nn.Embedding(vocab, width), nn.Linear(width, 3 * width), nn.Linear(width, vocab)
        self.norm = nn.LayerNorm(width)

    def forward(self, ids, labels):
        batch, length = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(batch, length, 3, -1).unbind(2)
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        scores = (q @ k.transpose(1, 2) / 4).masked_fill(~causal, float("-inf"))
        logits = self.head(self.norm(scores.softmax(-1) @ v))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def tiny_attention_and_reference(bf16, **rewrite_arguments):
    torch.manual_seed(0)
    model = TinyAttention()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 32, (4, 8))
    return graphamp.rewrite(model, (ids, ids), amp_lists=bf16, **rewrite_arguments), reference


def assert_trains_as_fp32(model, reference, ids):
    (logits, loss), (expected_logits, expected_loss) = model(ids, ids), reference(ids, ids)
    model.zero_grad(), reference.zero_grad()
    loss.backward()
    expected_loss.backward()
    assert logits.shape == expected_logits.shape
    assert relative_error(logits, expected_logits) < BF16_RTOL
    assert relative_error(loss, expected_loss) < BF16_RTOL
    for parameter, expected in zip(model.parameters(), reference.parameters()):
        assert relative_error(parameter.grad, expected.grad) < 5 * BF16_RTOL


def test_dynamic_true_serves_every_batch_and_length_from_one_graph(bf16):
    model, reference = tiny_attention_and_reference(bf16, dynamic=True)
    for batch, length in [(4, 8), (3, 8), (5, 6), (2, 11), (7, 3)]:
        assert_trains_as_fp32(model, reference, torch.randint(0, 32, (batch, length)))
    (graph,) = graphamp.rewritten_graphs(model)
    assert is_dynamic(graph)


def test_dynamic_false_compiles_a_static_graph_per_shape(bf16):
    model, reference = tiny_attention_and_reference(bf16, dynamic=False)
    for length in (9, 10, 11):
        assert_trains_as_fp32(model, reference, torch.randint(0, 32, (4, length)))
    graphs = graphamp.rewritten_graphs(model)
    assert len(graphs) == 4  # the example's shape, then one per length
    assert not any(is_dynamic(graph) for graph in graphs)


def test_static_and_dynamic_graphs_give_the_same_outputs_and_gradients(bf16):
    ids = torch.randint(0, 32, (3, 10), generator=torch.Generator().manual_seed(5))
    results = []
    for dynamic in (False, True):
        model, _ = tiny_attention_and_reference(bf16, dynamic=dynamic)
        logits, loss = model(ids, ids)
        loss.backward()
        results.append((logits, loss, [p.grad for p in model.parameters()]))
    (static_logits, static_loss, static_grads), (dynamic_logits, dynamic_loss, dynamic_grads) = results
    assert relative_error(dynamic_logits, static_logits) < 1e-5
    assert relative_error(dynamic_loss, static_loss) < 1e-6
    for dynamic_grad, static_grad in zip(dynamic_grads, static_grads):
        assert relative_error(dynamic_grad, static_grad) < 1e-5


def test_past_dynamos_recompile_limit_graphamp_warns_once_and_the_call_runs_low_eagerly(bf16):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16, dynamic=False)
    limit = torch._dynamo.config.recompile_limit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in range(1, limit + 3):
            x = torch.randn(batch, 8)
            out = model(x)
    said = [w for w in caught if str(w.message).startswith("graphamp: this call of")]
    assert len(said) == 1 and "dynamic=True" in str(said[0].message)
    assert graph_count(model) == limit
    # dynamo ran the model's own forward, under graphamp's eager policy: the linear in bfloat16, as autocast's
    with torch.autocast("cpu", torch.bfloat16):
        expected = reference(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_a_dynamic_graph_exports_its_files(bf16, tmp_path):
    model, _ = tiny_attention_and_reference(bf16, dynamic=True)
    graphamp.export(model, tmp_path)
    code = (tmp_path / "graph_0" / "graph.py").read_text()
    assert "_to_copy" in code and '"Sym(s' in code  # symbolic sizes in the graph's signature


# -- sizes of 1 and 0 ------------------------------------------------------------------------------------------------


def test_batch_sizes_from_one_up_train_as_fp32_and_a_second_pass_compiles_nothing(bf16):
    model, reference = tiny_attention_and_reference(bf16)
    sizes = (4, 3, 1, 5, 2, 7, 1, 6, 8)
    for batch in sizes:
        assert_trains_as_fp32(model, reference, torch.randint(0, 32, (batch, 8)))
    graphs = graph_count(model)
    for batch in sizes:
        model(*(torch.randint(0, 32, (batch, 8)),) * 2)
    assert graph_count(model) == graphs


class SqueezesTheBatch(nn.Module):
    """`squeeze(0)` drops the batch dim only when it is 1: the graph must do what eager does at that size."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).squeeze(0)


class DoublesABatchOfOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * 2 if x.shape[0] == 1 else self.fc(x)


@pytest.mark.parametrize("build", [SqueezesTheBatch, DoublesABatchOfOne], ids=["squeeze", "branch"])
def test_code_that_treats_a_batch_of_one_apart_does_what_eager_does(bf16, seeded, build):
    model = build()
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (torch.randn(4, 8),), amp_lists=bf16)
    model(torch.randn(3, 8))  # sizes varied: a dynamic graph
    for batch in (1, 5, 1):
        x = torch.randn(batch, 8)
        out, expected = model(x), reference(x)
        assert out.shape == expected.shape
        assert relative_error(out, expected) < BF16_RTOL


class AddsTwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.fc(x) + y


def test_a_batch_of_one_that_broadcasts_against_another_input_matches_eager(bf16, seeded):
    model = AddsTwoInputs()
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (torch.randn(4, 8), torch.randn(4, 8)), amp_lists=bf16)
    model(torch.randn(3, 8), torch.randn(3, 8))  # sizes varied: a dynamic graph, both batches one size

    x, y = torch.randn(1, 8), torch.randn(3, 8)  # eager broadcasts x's batch of 1
    out = model(x, y)

    assert out.shape == reference(x, y).shape == (3, 8)
    assert relative_error(out, reference(x, y)) < BF16_RTOL


def test_an_empty_batch_gives_eagers_empty_output(bf16, seeded):
    model = nn.Linear(8, 8)
    graphamp.rewrite(model, (torch.randn(2, 8),), amp_lists=bf16)
    model(torch.randn(3, 8))
    out = model(torch.randn(0, 8))
    assert out.shape == (0, 8) and out.dtype == torch.float32


# -- arguments that come and go -------------------------------------------------------------------------------------


class Scaled(nn.Module):
    """An optional mask and a Python float argument: each value and each presence a guard of its own."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale=1.0):
        out = self.fc(x) * scale
        return out if mask is None else out * mask


def test_an_optional_argument_that_comes_and_goes_matches_eager(bf16, seeded):
    model = Scaled()
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (torch.randn(2, 4),), amp_lists=bf16)
    for batch in (2, 5, 3):
        x, mask = torch.randn(batch, 4), (torch.rand(batch, 4) > 0.5).float()
        assert relative_error(model(x, mask=mask), reference(x, mask=mask)) < BF16_RTOL
        assert relative_error(model(x), reference(x)) < BF16_RTOL
    assert all(graph.runs > 0 for graph in graphamp.rewritten_graphs(model))  # each ran in graphamp's graphs


def test_each_value_of_a_python_float_argument_matches_eager(bf16, seeded):
    model = Scaled()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    graphamp.rewrite(model, (x,), {"scale": 2.0}, amp_lists=bf16)
    for scale in (2.0, 3.0, 0.5):
        assert relative_error(model(x, scale=scale), reference(x, scale=scale)) < BF16_RTOL
