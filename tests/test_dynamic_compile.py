"""compile=True on variable lengths: once the lengths vary, one dynamic inductor graph serves every later length."""

from __future__ import annotations

import copy

import torch
from torch import nn

import graphamp
from training import relative_error

BF16_RTOL = 2e-2
LENGTHS = [12, 7, 16, 9, 5, 14]


class TokenMLP(nn.Module):
    """A residual MLP: few kernels, since each is a C++ compile per graph (static, then dynamic; forward, backward)."""

    def __init__(self, width=32):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_compiled_variable_lengths_compile_one_dynamic_graph_that_serves_the_later_ones(bf16, seeded):
    model = TokenMLP()
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
