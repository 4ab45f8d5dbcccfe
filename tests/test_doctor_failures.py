"""doctor on runs it cannot compare: a rewritten graph that raises, and a model already inf/NaN in FP32."""

import pytest
import torch
from torch import nn

import graphamp


class Inverse(nn.Module):
    """linalg.inv has no bfloat16 kernel on CPU: on the white list, the rewritten graph raises there."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.linalg.inv(self.proj(x) + 4 * torch.eye(4)).sum()


class LogOfNegative(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return (self.proj(x) - 100).log().mean()


def test_doctor_reports_the_node_where_the_rewritten_graph_raises(seeded):
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16", custom_white_list=["linalg_inv"])
    report = graphamp.doctor(Inverse(), (torch.randn(3, 4, 4),), amp_lists=lists)
    assert "linalg_inv" in report.failure and "custom_black_list=['linalg_inv']" in report.failure
    assert not report.finite
    assert "cannot run" in str(report) and report.suggestions == []


def test_doctor_page_names_the_failure(seeded, tmp_path):
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16", custom_white_list=["linalg_inv"])
    report = graphamp.doctor(Inverse(), (torch.randn(3, 4, 4),), amp_lists=lists)
    page = (report.write(tmp_path) / "report.html").read_text()
    assert "The rewritten graph cannot run" in page


def test_rewrite_names_the_op_without_a_low_precision_kernel(seeded):
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16", custom_white_list=["linalg_inv"])
    with pytest.raises(graphamp.RewriteError, match=r"linalg_inv.*custom_black_list"):
        graphamp.rewrite(Inverse(), (torch.randn(3, 4, 4),), amp_lists=lists)


def test_doctor_says_a_loss_already_nan_in_fp32_and_suggests_nothing(bf16, seeded):
    report = graphamp.doctor(LogOfNegative(), (torch.randn(8, 4),), amp_lists=bf16)
    assert report.fp32_nonfinite == "loss"
    assert report.suggestions == []
    assert "already inf/NaN in FP32" in str(report)
    assert "no inf/NaN" not in str(report)


def test_a_loss_already_nan_in_fp32_makes_the_report_not_finite(bf16, seeded):
    report = graphamp.doctor(LogOfNegative(), (torch.randn(8, 4),), amp_lists=bf16)
    assert not report.finite


class NanInFp32OnTheSecondStep(nn.Module):
    """doctor seeds step k with k: torch.rand gives 0.50 on the first step (finite) and 0.76 on the second (NaN)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        shift = (torch.rand(()) > 0.6).float() * 100
        return (self.proj(x).abs() + 1 - shift).log().mean()


def test_a_loss_nan_in_fp32_on_a_later_step_makes_the_report_not_finite(bf16, seeded):
    report = graphamp.doctor(NanInFp32OnTheSecondStep(), (torch.randn(8, 4),), amp_lists=bf16, steps=2)
    assert report.fp32_nonfinite == "loss" and not report.finite
