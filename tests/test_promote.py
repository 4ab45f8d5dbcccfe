"""autocast's promote rule: mixed float16/bfloat16/float32 inputs of promote.txt's ops meet at the widest dtype."""

import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import graphamp
from autocast_table import entries
from graphamp.inspection.recording import DtypeRecorder, floating


class Call(nn.Module):
    """One call of `function`, its tensors as the module's inputs and everything else fixed."""

    def __init__(self, function, args, kwargs):
        super().__init__()
        self.function = function
        self.leaves, self.spec = pytree.tree_flatten((args, kwargs))

    def forward(self, *tensors):
        given = iter(tensors)
        leaves = [next(given) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.function(*args, **kwargs)


def _runs_on_cpu(function, args, kwargs) -> bool:
    """cudnn_convolution and the like have no CPU kernel at all: the table cannot be read on CPU for them."""
    as_fp32 = pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                              (args, kwargs))
    try:
        function(*as_fp32[0], **as_fp32[1])
        return True
    except (NotImplementedError, RuntimeError, TypeError):
        return False


def _graphamp_output_dtype(function, args, kwargs, lists):
    tensors = tuple(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    try:
        amp = graphamp.rewrite(Call(function, args, kwargs), tensors, amp_lists=lists, fp32_outputs=False, progress=False)
        out = amp(*tensors)
    except Exception:  # a model graphamp cannot capture or run counts as a disagreement
        return None
    return next(t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def test_agreement_with_pytorchs_autocast_test_table_is_at_least_95_percent(fp16):
    agree, disagree = 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for group, op, function, args, kwargs, expected in entries():
            if isinstance(args, str) or not _runs_on_cpu(function, args, kwargs):
                continue  # einsum's entry is skipped by PyTorch's own test too
            if _graphamp_output_dtype(function, args, kwargs, fp16) == expected:
                agree += 1
            else:
                disagree.append(f"{group}.{op}")
    share = agree / (agree + len(disagree))
    assert share >= 0.95, (share, disagree)


@pytest.mark.parametrize("op", [torch.dot, torch.vdot, torch.atan2, torch.cross])
def test_mixed_precision_inputs_of_a_promote_op_capture_and_compute_in_fp32(op, fp16):
    a, b = torch.randn(3, dtype=torch.float16), torch.randn(3)
    amp = graphamp.rewrite(Call(op, (a, b), {}), (a, b), amp_lists=fp16, fp32_outputs=False)
    out = amp(a, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, op(a.float(), b))


class ScoresIntoFP32Buffer(nn.Module):
    """A low-precision linear's output written into an FP32 tensor: index_put's kernel wants one dtype."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, rows):
        return torch.index_put(torch.zeros(4, 8), (rows,), self.fc(x))


def test_promote_op_gets_explicit_casts_in_the_pass(bf16, seeded):
    model, x, rows = ScoresIntoFP32Buffer(), torch.randn(2, 8), torch.tensor([1, 3])
    amp = graphamp.rewrite(model, (x, rows), amp_lists=bf16)
    with DtypeRecorder() as rec:
        out = amp(x, rows)
    (put,) = rec.calls_of("index_put")
    assert floating(put.in_dtypes) == {torch.float32}
    torch.testing.assert_close(out, model(x, rows), atol=2e-2, rtol=2e-2)


def test_lists_folder_without_promote_file_promotes_nothing(write_lists, tmp_path):
    folder = write_lists(tmp_path / "mine", gray="cat\n")
    assert graphamp.AutoMixedPrecisionLists(lists_dir=folder).promote_ops == frozenset()
