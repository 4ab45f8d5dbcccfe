"""bfloat16 on a CPU without native support (no AVX512-BF16/AMX) warns once that it is slower than FP32 there, whichever
entry point meets it first."""

import warnings

import torch
from torch import nn

import graphamp
from graphamp.policy import dtypes


def _warnings_of_three_conversions(bf16):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphamp.rewrite(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=bf16)
        graphamp.export_program(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=bf16)
        graphamp.rewrite(nn.Linear(4, 4), (torch.randn(2, 4),), amp_lists=bf16)
    return [str(w.message) for w in caught if "no native bfloat16" in str(w.message)]


def test_bfloat16_on_a_cpu_without_native_support_warns_once(bf16, monkeypatch):
    monkeypatch.setattr(dtypes, "_warned_bfloat16_on_cpu", False)
    monkeypatch.setattr(dtypes, "cpu_runs_bfloat16_natively", lambda: False)
    said = _warnings_of_three_conversions(bf16)
    assert len(said) == 1 and "slower than float32" in said[0]


def test_bfloat16_on_a_cpu_with_native_support_does_not_warn(bf16, monkeypatch):
    monkeypatch.setattr(dtypes, "_warned_bfloat16_on_cpu", False)
    monkeypatch.setattr(dtypes, "cpu_runs_bfloat16_natively", lambda: True)
    assert _warnings_of_three_conversions(bf16) == []
