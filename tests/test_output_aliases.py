"""Outputs that share storage in the FP32 model share it after the rewrite too (issue 38): a view of another output,
two views of one value and a view of an input leave as views, on every front end (rewrite() as fx code and under
inductor, export_program()), so a write into one shows in the other and the gradients through both are eager's."""

import copy

import pytest
import torch
from torch import nn

import graphamp
from training import relative_error

FRONT_ENDS = ("rewrite-fx", "rewrite-inductor", "export")


def converted(model, x, front_end, amp_lists, level="O1"):
    """`model` converted by one front end; the callable that runs it."""
    if front_end == "export":
        return graphamp.export_program(model, (x,), amp_lists=amp_lists, level=level).module()
    graphamp.rewrite(model, (x,), amp_lists=amp_lists, level=level, compile=front_end == "rewrite-inductor")
    return model


class SliceOfLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h, h[:, :2]


class TwoSlicesOfLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h[:, :3], h[:, 2:5]


class ViewOfInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x), x.t()[:2]


def write_then_backward(run, x, parameters):
    """h.mul_(3), then the gradients of v.sum(): v sees the write only while it is a view of h."""
    h, v = run(x)
    h.mul_(3)
    v.sum().backward()
    return v.detach().clone(), [p.grad.clone() for p in parameters]


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_an_output_that_views_another_output_stays_its_view(front_end, bf16, seeded):
    model, x = SliceOfLinear(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    run = converted(model, x, front_end, bf16)
    h, v = run(x)
    assert v._base is h
    expected, expected_grads = write_then_backward(twin, x, [twin.fc.weight, twin.fc.bias])
    module = run if front_end == "export" else model
    got, grads = write_then_backward(run, x, [module.get_parameter("fc.weight"), module.get_parameter("fc.bias")])
    assert relative_error(got, expected) < 2e-2
    for grad, expected_grad in zip(grads, expected_grads):
        assert relative_error(grad, expected_grad) < 2e-2


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_two_outputs_viewing_one_value_share_its_storage(front_end, bf16, seeded):
    model, x = TwoSlicesOfLinear(), torch.randn(4, 8)
    a, b = converted(model, x, front_end, bf16)(x)
    assert a.dtype == b.dtype == torch.float32
    a[:, 2].fill_(7.0)  # the column both slices hold
    assert torch.equal(b[:, 0], torch.full((4,), 7.0))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_an_output_that_views_an_input_stays_its_view(front_end, level, bf16, seeded):
    model, x = ViewOfInput(), torch.randn(4, 8)
    _, v = converted(model, x, front_end, bf16, level)(x)
    assert v._base is x
    assert torch.equal(v, x.t()[:2])
