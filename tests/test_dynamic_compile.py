"""compile=True on variable lengths: a dynamic graph goes to inductor with dynamic=True and recompiles at most once."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.callback import CallbackTrigger, callback_handler

import graphamp
from tests.training import relative_error

BF16_RTOL = 2e-2
LENGTHS = [12, 7, 16, 9, 5, 14]


class TokenMLP(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


@pytest.fixture
def forward_compiles():
    """A list that grows by one per dynamo (forward) compile while the test runs."""
    compiles = []

    def count(args):
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            compiles.append(args.compile_id)

    callback_handler.register_start_callback(count)
    yield compiles
    callback_handler.remove_start_callback(count)


def test_compiled_variable_lengths_compile_once_per_graph(bf16, seeded, forward_compiles):
    model = TokenMLP()
    amp = graphamp.rewrite(model, (torch.randn(4, LENGTHS[0], 32),), amp_lists=bf16, compile=True)

    for length in LENGTHS:
        x = torch.randn(4, length, 32)
        out = amp(x)
        out.pow(2).mean().backward()
        assert relative_error(out, model(x)) < BF16_RTOL

    assert len(amp.captures) == 2  # static, then dynamic
    assert len(forward_compiles) == 2  # one inductor compile each; the dynamic one serves every later length

