"""graphamp.doctor: the node that overflows, each op's error against FP32, and list edits that fix it.

Models built to overflow in float16 at a known node (tests/models.py): PooledSum's `pool` linear sums 256
values of about 300 (a white op: its module is kept FP32), SquaredEnergy's `h * h` squares them (a gray op:
it goes black for float16). Small tensors: float16 on CPU is slow.
"""

import copy
import math

import pytest
import torch

import graphamp
from graphamp.policy.lists import AutoMixedPrecisionLists
from graphamp.diagnosis.numerics import unit_roundoff
from graphamp.diagnosis.suggestions import BLACK_MODULE, BLACK_OP, WHITE_OP
from models import (
    Cancellation, Difference, PooledSum, SmallResNet, SquaredEnergy, digits, gpt2, large_inputs, pairs_near_1000,
    token_batch,
)
from training import relative_error

FP16_MAX = torch.finfo(torch.float16).max


def pooled_sum():
    torch.manual_seed(0)
    return PooledSum(), large_inputs(8, 256, 16)


def squared_energy():
    torch.manual_seed(0)
    return SquaredEnergy(), large_inputs(8, 16)


def gpt2_batch(batch=2, seq=16):
    ids = token_batch(batch, seq)
    return {"input_ids": ids, "labels": ids}


def one_layer_gpt2():
    """GPT-2 with one block: every kind of node the figures are about, and half the nodes to measure of two."""
    return gpt2(n_layer=1)


@pytest.fixture(scope="module")
def gpt2_bf16_report(bf16):
    torch.manual_seed(0)
    model = one_layer_gpt2()
    return model, graphamp.doctor(model, (), gpt2_batch(), amp_lists=bf16)


# -- the node that overflows -----------------------------------------------------------------------------------

def test_overflow_in_a_white_op_is_found_at_its_node(fp16):
    model, inputs = pooled_sum()

    report = graphamp.doctor(model, inputs, amp_lists=fp16)

    culprit = report.first_nonfinite
    assert (culprit.op, culprit.module, culprit.decision) == ("linear.default", "pool", "white")
    assert culprit.max_abs > FP16_MAX and culprit.overflow > 0
    assert all(not r.nonfinite for r in report.nodes[: report.nodes.index(culprit)])
    assert not report.finite and math.isnan(report.loss["amp"]) and math.isfinite(report.loss["fp32"])
    assert report.first_nonfinite_grad is None  # under a NaN loss every gradient is NaN: none is first


def test_a_white_op_that_overflows_gets_its_module_kept_fp32_verified(fp16):
    model, inputs = pooled_sum()

    report = graphamp.doctor(model, inputs, amp_lists=fp16)

    fixes = [s for s in report.suggestions if s.kind != WHITE_OP]
    assert [(s.kind, s.target, s.verified) for s in fixes] == [(BLACK_MODULE, "pool", True)]
    assert "module `pool` → custom_black_modules" in fixes[0].text
    assert "> float16 max" in fixes[0].text


def test_overflow_in_a_gray_op_is_found_and_put_on_the_black_list_for_float16(fp16):
    model, inputs = squared_energy()

    report = graphamp.doctor(model, inputs, amp_lists=fp16)

    assert (report.first_nonfinite.op, report.first_nonfinite.decision) == ("mul.Tensor", "gray")
    fixes = [s for s in report.suggestions if s.kind != WHITE_OP]
    assert [(s.kind, s.target, s.verified) for s in fixes] == [(BLACK_OP, "mul", True)]
    assert fixes[0].text.startswith("add `mul` to black.txt under [float16] (max |x| 1.")


def test_the_suggested_lists_run_finite_where_the_lists_given_do_not(fp16):
    model, inputs = squared_energy()
    report = graphamp.doctor(model, inputs, amp_lists=fp16)

    fixed = graphamp.doctor(model, inputs, amp_lists=report.suggested_lists())

    assert fixed.finite and fixed.loss["relative_error"] < 1e-2
    assert [s for s in fixed.suggestions if s.kind != WHITE_OP] == []


def test_bfloat16_does_not_overflow_where_float16_does(bf16):
    model, inputs = pooled_sum()

    report = graphamp.doctor(model, inputs, amp_lists=bf16)

    assert report.finite
    assert next(r for r in report.nodes if r.module == "pool").overflow == 0.0


@pytest.mark.parametrize("build", [pooled_sum, squared_energy], ids=["white-op", "gray-op"])
def test_applying_the_suggestion_makes_float16_training_finite(fp16, build, tmp_path):
    model, (x, target) = build()
    report = graphamp.doctor(model, (x, target), amp_lists=fp16)
    folder = report.apply(tmp_path / "fixed_lists")

    def train(lists, steps=12):
        torch.manual_seed(1)
        net = build()[0]
        amp_model = graphamp.rewrite(net, (x, target), amp_lists=lists)
        optimizer = graphamp.decorate(torch.optim.Adam(amp_model.parameters(), lr=1e-3), lists)
        losses = []
        for _ in range(steps):
            loss = amp_model(x, target)
            optimizer.minimize(loss)
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, optimizer

    broken, broken_optimizer = train(fp16)
    assert not any(math.isfinite(loss) for loss in broken)
    assert broken_optimizer.skipped_steps == 12

    losses, optimizer = train(AutoMixedPrecisionLists(dtype="float16", lists_dir=folder))
    assert all(math.isfinite(loss) for loss in losses)
    assert optimizer.skipped_steps < 12 and losses[-1] < losses[0]


# -- the measurements ------------------------------------------------------------------------------------------

def test_loss_and_parameter_gradient_errors_match_a_separate_run(bf16, gpt2_bf16_report):
    model, report = gpt2_bf16_report
    batch = gpt2_batch()
    amp_model = graphamp.rewrite(copy.deepcopy(model), (), batch, amp_lists=bf16)
    fp32_loss = model(**batch).loss
    amp_loss = amp_model(**batch).loss
    name = "transformer.h.0.mlp.c_fc.weight"
    (fp32_grad,) = torch.autograd.grad(fp32_loss, [model.get_parameter(name)])
    (amp_grad,) = torch.autograd.grad(amp_loss, [amp_model.get_parameter(name)])

    assert report.loss["fp32"] == pytest.approx(fp32_loss.item(), rel=1e-6)
    assert report.loss["amp"] == pytest.approx(amp_loss.item(), rel=1e-6)
    measured = next(p for p in report.parameters if p.name == name)
    assert measured.grad_error == pytest.approx(relative_error(amp_grad, fp32_grad), rel=1e-3)
    assert 0 < measured.grad_error < 0.05


def test_each_op_is_measured_in_the_dtype_it_runs_in(gpt2_bf16_report):
    _, report = gpt2_bf16_report
    rounding = unit_roundoff(torch.bfloat16)

    white = [r for r in report.nodes if r.decision == "white"]
    assert white and all(r.runs_in == "bfloat16" for r in white)
    # A GEMM's own error in bfloat16 is a few roundings of its inputs and output.
    assert all(rounding / 4 < r.local_error < 4 * rounding for r in white)
    # Black ops run FP32: running them low is measured apart, and costs more than they cost now.
    black = [r for r in report.nodes if r.decision == "black" and r.low_error is not None]
    assert black and all(r.runs_in == "float32" for r in black)
    assert all(r.low_error >= r.local_error for r in black)
    # Errors accumulate: the last white op is further from FP32 than its own error.
    assert white[-1].error > white[-1].local_error
    assert all(r.grad_error is not None for r in white)


def test_an_op_whose_own_error_is_large_is_kept_fp32_where_a_rerun_shows_the_loss_improve(bf16):
    torch.manual_seed(0)
    model = Difference()

    report = graphamp.doctor(model, (pairs_near_1000(),), amp_lists=bf16)

    (fix,) = [s for s in report.suggestions if s.kind != WHITE_OP]
    assert (fix.kind, fix.target, fix.verified) == (BLACK_MODULE, "diff", True)
    before, after = (float(x) for x in fix.text.rsplit("loss error ", 1)[1].split(" → "))
    assert before == pytest.approx(report.loss["relative_error"], rel=1e-2) and after < before / 2
    fixed = graphamp.doctor(model, (pairs_near_1000(),), amp_lists=report.suggested_lists())
    assert fixed.loss["relative_error"] == pytest.approx(after, rel=1e-2)


def test_an_error_made_upstream_and_only_amplified_is_not_blamed_on_the_op_that_shows_it(bf16):
    torch.manual_seed(0)

    report = graphamp.doctor(Cancellation(), (torch.randn(16, 8),), amp_lists=bf16)

    sub = next(r for r in report.nodes if r.op == "sub.Tensor")
    assert sub.local_error > 8 * unit_roundoff(torch.bfloat16)  # a candidate by its own error ...
    assert [s for s in report.suggestions if s.kind != WHITE_OP] == []  # ... that a rerun shows mends nothing


def test_black_ops_that_fit_the_low_dtype_are_offered_as_white_with_their_error(gpt2_bf16_report):
    _, report = gpt2_bf16_report

    candidates = [s for s in report.suggestions if s.kind == WHITE_OP]

    assert candidates and all(not s.verified for s in candidates)
    for suggestion in candidates:
        records = [r for r in report.nodes if r.entry == suggestion.target]
        assert all(r.decision == "black" and r.overflow == 0 for r in records)
        assert f"at most {max(r.low_error for r in records):.3g}" in suggestion.text
        assert "; loss error " in suggestion.text


def test_a_value_an_in_place_op_writes_into_later_is_measured_as_it_was(bf16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(inplace=True), torch.nn.Linear(32, 4)
    )

    report = graphamp.doctor(model, (torch.randn(8, 16),), amp_lists=bf16, loss_fn=lambda out: out.square().mean())

    norm = next(r for r in report.nodes if r.op == "batch_norm.default")
    assert norm.runs_in == "bfloat16"
    assert norm.error < 8 * unit_roundoff(torch.bfloat16)  # not relu_'s result, which overwrote it


def test_o2_runs_the_gray_ops_low_too(bf16, gpt2_bf16_report):
    model, o1 = gpt2_bf16_report

    o2 = graphamp.doctor(model, (), gpt2_batch(), amp_lists=bf16, level="O2")

    def low(report):
        return sum(r.runs_in == "bfloat16" for r in report.nodes)

    assert low(o2) > low(o1)
    assert o2.finite and o2.loss["relative_error"] < 1e-2


def test_steps_keep_the_worst_figure_of_each_node(bf16):
    torch.manual_seed(0)
    model = one_layer_gpt2()
    model.config.resid_pdrop = 0.1
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    one = graphamp.doctor(model, (), gpt2_batch(), amp_lists=bf16, steps=1)
    three = graphamp.doctor(model, (), gpt2_batch(), amp_lists=bf16, steps=3)

    pairs = [(a, b) for a, b in zip(one.nodes, three.nodes) if a.error is not None]
    assert [a.name for a, _ in pairs] == [b.name for _, b in pairs]
    assert all(b.error >= a.error for a, b in pairs)
    assert any(b.error > a.error for a, b in pairs)  # dropout drew other masks in the later steps
    first_step = {p.name: p.grad_error for p in one.parameters}
    assert sorted(first_step) == sorted(p.name for p in three.parameters)
    assert all(p.grad_error >= first_step[p.name] for p in three.parameters)  # each parameter's own, by name
    errors = [p.grad_error for p in three.parameters]
    assert errors == sorted(errors, reverse=True)


def test_a_gradient_that_overflows_is_found_in_backward(fp16):
    torch.manual_seed(0)
    model = one_layer_gpt2()

    # One short sequence: float16 runs slowly on CPU, and a loss scaled by 2**40 overflows any batch's gradients.
    report = graphamp.doctor(model, (), gpt2_batch(1, 8), amp_lists=fp16, loss_scaling=2.0**40)

    assert report.first_nonfinite is None
    culprit = report.first_nonfinite_grad
    assert culprit is not None and culprit.grad_nonfinite and culprit.runs_in == "float16"


def test_steps_keep_a_figure_no_step_could_measure_as_not_measured(fp16):
    torch.manual_seed(0)
    model = one_layer_gpt2()

    # Every gradient overflows at this scale: no step has a finite entry to measure a parameter's largest by.
    report = graphamp.doctor(model, (), gpt2_batch(1, 8), amp_lists=fp16, loss_scaling=2.0**40, steps=2)

    assert report.parameters and all(p.grad_nonfinite for p in report.parameters)
    unmeasured = [p for p in report.parameters if p.grad_max_abs is None]
    assert unmeasured  # they stay "not measured" after the merge, not a largest |gradient| of -1
    assert all(p.grad_max_abs >= 0 for p in report.parameters if p.grad_max_abs is not None)


def test_doctor_leaves_the_model_as_it_was(bf16):
    torch.manual_seed(0)
    model = SmallResNet().train()
    images, labels = digits(16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()

    graphamp.doctor(model, (images,), amp_lists=bf16, loss_fn=lambda logits: torch.nn.functional.cross_entropy(logits, labels))

    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_model_without_a_loss_is_measured_forward_and_with_loss_fn_backward_too(bf16):
    torch.manual_seed(0)
    model = SmallResNet()
    images, labels = digits(16)

    forward_only = graphamp.doctor(model, (images,), amp_lists=bf16)
    with_loss = graphamp.doctor(model, (images,), amp_lists=bf16, loss_fn=lambda out: out.logsumexp(-1).mean())

    assert not forward_only.backward and forward_only.loss is None and forward_only.parameters == []
    assert forward_only.output_error < 0.05
    assert with_loss.backward and with_loss.parameters
    assert with_loss.loss["relative_error"] < 0.05


def test_doctor_rejects_a_step_count_that_is_not_positive():
    model, inputs = squared_energy()

    with pytest.raises(graphamp.ArgumentError, match="steps=0"):
        graphamp.doctor(model, inputs, steps=0)


def test_report_prints_the_culprit_the_offenders_and_the_fix(fp16):
    model, inputs = pooled_sum()

    text = str(graphamp.doctor(model, inputs, amp_lists=fp16))

    assert "first inf/NaN (forward): linear_1 = linear.default in pool, FP32 max |x| 8.8" in text
    offenders = text.split("top ")[1].splitlines()
    assert offenders[2].split()[:3] == ["linear_1", "linear.default", "pool"]  # the worst first
    assert "module `pool` → custom_black_modules" in text and "[verified" in text


def test_dynamic_doctor_diagnoses_the_symbolic_graph_as_the_static_one(bf16, gpt2_bf16_report):
    """doctor(dynamic=True) runs the graph captured with symbolic sizes: symbolic dims, the same figures."""
    model, static = gpt2_bf16_report
    torch.manual_seed(0)
    dynamic = graphamp.doctor(model, (), gpt2_batch(), amp_lists=bf16, dynamic=True)
    probe = graphamp.diagnosis.probe.Probe(model, (), gpt2_batch(), dynamic=True, promote_ops=bf16.promote_ops)
    probe_graph = probe.graph_module
    sizes = [n.meta["val"].shape for n in probe_graph.graph.nodes if n.op == "placeholder" and "input_ids" in n.name]
    assert sizes and all(isinstance(d, torch.SymInt) for d in sizes[0])
    assert dynamic.loss["amp"] == pytest.approx(static.loss["amp"], rel=1e-5)
    assert dynamic.loss["fp32"] == pytest.approx(static.loss["fp32"], rel=1e-6)
    # the symbolic graph has a few more shape ops (arange, view of sizes); its white and black ops are the same
    decided = lambda report: sorted((r.op, r.decision) for r in report.nodes if r.decision in ("white", "black"))  # noqa: E731
    assert decided(dynamic) == decided(static) and decided(static)
