"""A rewrite() that fails leaves the model as it was; its one example call changes nothing of the model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphamp
from conftest import CompiledCodeRecorder


class Counting(nn.Module):
    """A forward that reassigns a buffer (not an in-place write)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls = self.calls + 1
        return self.linear(x)


def test_the_example_call_restores_a_buffer_the_forward_reassigns(bf16):
    model = Counting()
    buffer = model.calls
    graphamp.rewrite(model, (torch.randn(2, 8),), amp_lists=bf16)
    assert model.calls is buffer and model.calls.item() == 0
    model(torch.randn(2, 8))
    assert model.calls.item() == 1


def test_an_example_that_does_not_fit_the_model_names_the_examples(bf16):
    model = nn.Sequential(nn.Linear(8, 4))
    with pytest.raises(graphamp.ArgumentError, match="example inputs do not fit Sequential") as raised:
        graphamp.rewrite(model, (torch.randn(2, 5),), amp_lists=bf16)
    assert "make that construct traceable" not in str(raised.value)


class RefusingTwoRows(nn.Module):
    """A model whose own FP32 code raises on a batch of two rows, after updating BatchNorm's running statistics."""

    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.BatchNorm1d(8), nn.Linear(8, 4)

    def forward(self, x):
        x = self.norm(x)
        if x.shape[0] == 2:
            raise ValueError("this model takes batches of three rows")
        return self.linear(x)


@pytest.mark.parametrize("entry_point", [graphamp.export_program, graphamp.doctor])
def test_export_program_and_doctor_name_examples_the_models_own_code_refuses(entry_point, bf16):
    """As rewrite() says (its error an ArgumentError, theirs the CaptureError of every failed capture): the model's own
    code refuses the examples, not torch.export a construct; the check's own call leaves BatchNorm's statistics."""
    model = RefusingTwoRows()
    statistics = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with pytest.raises(graphamp.CaptureError, match="example inputs do not fit RefusingTwoRows: its own FP32 code "
                                                     "raises on them .ValueError: this model takes batches") as raised:
        entry_point(model, (torch.randn(2, 8),), amp_lists=bf16)
    assert "make that construct traceable" not in str(raised.value)
    assert all(torch.equal(buffer, statistics[name]) for name, buffer in model.named_buffers())


def test_a_failed_rewrite_leaves_the_model_as_it_was_and_a_retry_works(bf16):
    model = nn.Sequential(nn.Linear(8, 4))
    before = dict(model.__dict__)
    with pytest.raises(graphamp.ArgumentError):
        graphamp.rewrite(model, (torch.randn(2, 5),), amp_lists=bf16)
    assert model.__dict__.keys() == before.keys() and model._compiled_call_impl is None
    assert not graphamp.is_rewritten(model)
    graphamp.rewrite(model, (torch.randn(2, 8),), amp_lists=bf16)  # not refused as "already rewritten"
    with CompiledCodeRecorder() as recorder:
        model(torch.randn(2, 8))
    assert [c.in_dtypes[0] for c in recorder.calls_of("addmm")] == [torch.bfloat16]


def test_an_interrupted_rewrite_leaves_the_model_as_it_was(bf16):
    class Interrupted(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(8, 8)

        def forward(self, x):
            raise KeyboardInterrupt  # Ctrl-C during the example call

    model = Interrupted()
    before = set(model.__dict__)
    with pytest.raises(KeyboardInterrupt):
        graphamp.rewrite(model, (torch.randn(2, 8),), amp_lists=bf16, checkpoint="block")
    assert "forward" not in model.block.__dict__ and model._compiled_call_impl is None
    assert set(model.__dict__) == before and not graphamp.is_rewritten(model)


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler, as in a fresh process: a test before this one on the same worker (a trainer's)
    may have left another installed. The earlier handler is back afterwards."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Python's own "Exception ignored"
def test_ctrl_c_that_lands_where_python_ignores_exceptions_still_reaches_the_caller(bf16, python_sigint_handler):
    """A first call's compile runs many weakref callbacks and __del__s, where Python prints an interrupt and goes
    on ("Exception ignored in ..."): the KeyboardInterrupt is raised after the call."""
    import signal

    class InterruptedWhileCollected:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            collect_one()
            return self.linear(x)

    @torch.compiler.disable  # run as Python runs it, so the object is collected within the call, whatever dynamo keeps
    def collect_one():
        InterruptedWhileCollected()  # collected at once: SIGINT inside its __del__

    model = graphamp.rewrite(Model(), amp_lists=bf16)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 8))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class NormalizesItsInputInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        x.sub_(x.mean())  # a forward that writes into its input
        return self.linear(x)


def test_the_example_call_leaves_the_callers_examples_as_they_were(bf16):
    x = torch.randn(2, 8)
    given = x.clone()
    model = graphamp.rewrite(NormalizesItsInputInPlace(), (x,), amp_lists=bf16)
    assert torch.equal(x, given)  # as export_program and torch.export leave them
    model(x)
    torch.testing.assert_close(x, given - given.mean())
