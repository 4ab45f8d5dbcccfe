"""compile=True on variable lengths: once the lengths vary, one dynamic inductor graph serves every later length."""

from __future__ import annotations

import copy

import torch
from torch import nn

import graphamp
from training import relative_error

BF16_RTOL = 2e-2
LENGTHS = [12, 7, 16, 9, 5, 14]


def test_compiled_variable_lengths_compile_one_dynamic_graph_that_serves_the_later_ones(bf16, seeded):
    model = nn.Linear(32, 32)  # one C++ kernel per graph (static, then dynamic; forward, backward)
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (torch.randn(4, LENGTHS[0], 32),), amp_lists=bf16, compile=True)

    for i, length in enumerate(LENGTHS):
        x = torch.randn(4, length, 32)
        out = model(x)
        out.pow(2).mean().backward()
        assert relative_error(out, reference(x)) < BF16_RTOL
        if i == 1:  # two lengths seen: dynamo's automatic dynamic has made the length dynamic
            compiled = graphamp.rewritten_graphs(model)

    graphs = graphamp.rewritten_graphs(model)
    assert len(graphs) == len(compiled) <= 2  # the first (static, unless sizes varied before), then one dynamic
    assert all("inductor" in graph.timings for graph in graphs)
