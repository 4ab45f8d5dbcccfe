"""Outputs cast up to float32 after a compiled graph reuse the storage the caller let go of, never one it holds."""

import numpy as np
import torch

from graphamp.runtime.recycled_outputs import RecycledOutputs


def _low(requires_grad=False):
    return torch.randn(4, 6, dtype=torch.bfloat16, requires_grad=requires_grad)


def test_a_dropped_output_s_storage_is_written_again():
    outputs = RecycledOutputs()
    first = outputs.cast(0, _low(), torch.float32)
    address = first.data_ptr()
    del first
    value = _low()
    second = outputs.cast(0, value, torch.float32)
    assert second.data_ptr() == address
    assert second.dtype == torch.float32 and torch.equal(second, value.to(torch.float32))


def test_an_output_the_caller_holds_in_any_form_is_never_overwritten():
    outputs = RecycledOutputs()
    for keep in (lambda t: t, lambda t: t[1:], lambda t: t.numpy(), lambda t: t.view(-1)):
        first = outputs.cast(0, _low(), torch.float32)
        kept, expected = keep(first), torch.as_tensor(keep(first.clone())).clone()
        del first
        second = outputs.cast(0, _low(), torch.float32)
        held = torch.as_tensor(kept)  # shares a NumPy array's memory
        assert held.data_ptr() != second.data_ptr() and torch.equal(held, expected)
        del kept, held, second


def test_a_value_autograd_saved_for_a_pending_backward_is_not_overwritten():
    outputs = RecycledOutputs()
    first_input, second_input = _low(True), _low(True)
    first = outputs.cast(0, first_input, torch.float32)
    pending = (first * first).sum()  # mul saves `first` for its backward
    del first
    second = outputs.cast(0, second_input, torch.float32)
    pending.backward()
    assert torch.equal(first_input.grad, (2 * first_input.to(torch.float32)).to(torch.bfloat16))
    assert torch.equal(second, second_input.detach().to(torch.float32))


def test_the_gradient_through_a_reused_storage_is_the_cast_s():
    outputs = RecycledOutputs()
    address = outputs.cast(0, _low(), torch.float32).data_ptr()  # dropped at once: the next cast reuses it
    value = _low(True)
    reference = value.detach().clone().requires_grad_()
    weights = torch.randn(4, 6)
    reused = outputs.cast(0, value, torch.float32)
    assert reused.data_ptr() == address
    (reused * weights).sum().backward()
    (reference.to(torch.float32) * weights).sum().backward()
    assert value.grad.dtype == torch.bfloat16 and torch.equal(value.grad, reference.grad)


def test_strides_a_larger_shape_and_inference_mode_each_get_what_to_gives():
    outputs = RecycledOutputs()
    channels_last = torch.randn(2, 3, 4, 5, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    out = outputs.cast(0, channels_last, torch.float32)
    assert out.stride() == channels_last.to(torch.float32).stride() and torch.equal(out, channels_last.float())
    del out
    bigger = torch.randn(8, 8, dtype=torch.bfloat16)
    assert torch.equal(outputs.cast(0, bigger, torch.float32), bigger.float())
    with torch.inference_mode():
        inferred = outputs.cast(0, _low(), torch.float32)
    del inferred
    after = outputs.cast(0, _low(True), torch.float32)  # not an inference tensor written outside inference mode
    after.sum().backward()
    transposed = _low().t()
    assert torch.equal(outputs.cast(1, transposed, torch.float32), transposed.float())
