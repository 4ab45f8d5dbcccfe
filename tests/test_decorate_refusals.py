"""decorate() refuses what would train silently wrong: lists of another dtype than the model's, arguments of the
wrong type, and optimizers of one model decorated one by one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
from graphamp import LossScalingError
from models import regression_batch as batch
from training import relative_error, rewritten_regression as rewritten
from training import rewritten_regression_and_eager as rewritten_and_eager


class TinyLoss(nn.Module):
    """A Tanh MLP whose loss is scaled down to 1e-6: its float16 gradients underflow to 0 without loss scaling."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y) * 1e-6


# -- the decorated lists' dtype against the model's ----------------------------------------------------------------


def test_bfloat16_lists_on_a_float16_model_are_refused_naming_both_dtypes(fp16, bf16):
    model = rewritten(fp16)
    with pytest.raises(LossScalingError, match=r"got bfloat16 lists, but this Regression was rewritten with float16 "
                                               r"lists.*decorate with the same AutoMixedPrecisionLists"):
        graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), bf16)


def test_float16_lists_on_a_bfloat16_model_are_refused_naming_both_dtypes(fp16, bf16):
    model = rewritten(bf16)
    with pytest.raises(LossScalingError, match=r"got float16 lists, but this Regression was rewritten with bfloat16"):
        graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16)


def test_lists_of_another_dtype_are_refused_for_the_model_given_to_decorate(fp16, bf16):
    model = rewritten(fp16)
    outer = nn.ModuleDict({"inner": model})
    with pytest.raises(LossScalingError, match=r"got bfloat16 lists.*rewritten with float16 lists"):
        graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), bf16, model=outer)


def test_a_refused_decorate_leaves_the_model_linked_to_no_optimizer(fp16, bf16):
    """Linked, the refused optimizer's scale (2**16, held alive by the traceback) would keep the tiny gradients."""
    torch.manual_seed(0)
    x, y = batch(0)
    model = graphamp.rewrite(TinyLoss(), (x, y), amp_lists=fp16)
    with pytest.raises(LossScalingError) as refused:
        graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), bf16, init_loss_scaling=2.0**16,
                          use_dynamic_loss_scaling=False, model=model)
    model(x, y).backward()
    assert any(bool((p.grad == 0).any()) for p in model.parameters())  # unscaled: float16 gradients underflow
    assert "rewritten with float16 lists" in str(refused.value)


def test_float16_model_decorated_with_its_own_lists_keeps_gradients_of_a_tiny_loss(fp16):
    """The control of the refusals above: with the model's lists, loss scaling keeps 1e-6-sized gradients."""
    torch.manual_seed(0)
    x, y = batch(0)
    model = graphamp.rewrite(TinyLoss(), (x, y), amp_lists=fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16, model=model)
    model(x, y).backward()
    assert all(bool((p.grad != 0).all()) for p in model.parameters())
    opt.step()
    assert not opt.found_inf


def test_a_half_model_with_an_unscaled_decorated_optimizer_is_refused_at_step_not_stepped_on_zeros(bf16):
    """bfloat16's default scale is 1.0: a plain backward of a .half() model passes the scaling check, and its
    float16 gradients (zeros where they underflow) must still never reach the update."""
    torch.manual_seed(0)
    model = TinyLoss().half()
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), bf16)
    x, y = batch(0)
    model(x.half(), y.half()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(LossScalingError, match=r"has a float16 gradient.*Keep the model in float32"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# -- decorate()'s argument types ------------------------------------------------------------------------------------

BAD_ARGUMENTS = [
    pytest.param({"use_dynamic_loss_scaling": "no"},
                 r"decorate\(use_dynamic_loss_scaling='no'\): pass True, False, or None", id="bool-as-a-string"),
    pytest.param({"use_dynamic_loss_scaling": 0},
                 r"decorate\(use_dynamic_loss_scaling=0\): pass True, False, or None", id="bool-as-an-int"),
    pytest.param({"init_loss_scaling": "1024"}, r"init_loss_scaling='1024' is a str: pass a number",
                 id="init_loss_scaling-a-string"),
    pytest.param({"incr_ratio": True}, r"incr_ratio=True is a bool: pass a number", id="incr_ratio-a-bool"),
    pytest.param({"decr_ratio": "0.5"}, r"decr_ratio='0.5' is a str: pass a number", id="decr_ratio-a-string"),
    pytest.param({"max_loss_scaling": "inf"}, r"max_loss_scaling='inf' is a str: pass a number",
                 id="max_loss_scaling-a-string"),
    pytest.param({"process_group": "nccl"}, r"decorate\(process_group=\.\.\.\) got a str: pass a torch\.distributed "
                 r"ProcessGroup", id="process_group-a-string"),
    pytest.param({"model": "model"}, r"decorate\(model=\.\.\.\) got a str: pass the nn\.Module graphamp\.rewrite\(\)",
                 id="model-a-string"),
]


@pytest.mark.parametrize("arguments, message", BAD_ARGUMENTS)
def test_an_argument_of_the_wrong_type_raises_an_argument_error_naming_it_and_the_fix(fp16, arguments, message):
    with pytest.raises(graphamp.ArgumentError, match=message):
        graphamp.decorate(torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1), fp16, **arguments)


def test_the_string_no_does_not_turn_bfloat16_loss_scaling_on(bf16):
    """The report: use_dynamic_loss_scaling="no" was truthy, so bfloat16 lists got a dynamic scale of 65536."""
    with pytest.raises(graphamp.ArgumentError, match="use_dynamic_loss_scaling"):
        graphamp.decorate(torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1), bf16, use_dynamic_loss_scaling="no")


def test_the_loss_scaler_itself_refuses_a_non_bool_use_dynamic_loss_scaling():
    from graphamp.training.loss_scaler import LossScaler

    with pytest.raises(graphamp.ArgumentError, match=r"use_dynamic_loss_scaling='yes': pass True .* or False"):
        LossScaler(use_dynamic_loss_scaling="yes")


# -- two optimizers of one model -------------------------------------------------------------------------------


def decorated_one_by_one(lists):
    model = rewritten(lists)
    first = graphamp.decorate(torch.optim.SGD(model.net[0].parameters(), lr=0.1), lists, model=model)
    second = graphamp.decorate(torch.optim.SGD(model.net[2].parameters(), lr=0.1), lists, model=model)
    return model, first, second


def test_optimizers_of_one_model_decorated_one_by_one_are_told_to_decorate_them_in_one_call(fp16):
    model, first, second = decorated_one_by_one(fp16)
    model(*batch(1)).backward()
    with pytest.raises(LossScalingError) as error:
        first.step()
    message = str(error.value)
    assert r"graphamp.decorate([opt_a, opt_b], amp_lists)" in message
    assert "Regression" in message
    assert "rewrite() the model before decorate()" not in message  # done already: not a fix to suggest


def test_optimizers_of_one_model_decorated_in_one_call_step_after_a_plain_backward(fp16):
    model = rewritten(fp16)
    first, second = graphamp.decorate(
        [torch.optim.SGD(model.net[0].parameters(), lr=0.1), torch.optim.SGD(model.net[2].parameters(), lr=0.1)], fp16,
        model=model,
    )
    before = [p.detach().clone() for p in model.parameters()]
    model(*batch(1)).backward()
    first.step()
    second.step()
    assert not (first.found_inf or second.found_inf)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("between", ["nothing", "zero_grad(set_to_none=False)"])
def test_a_second_step_with_no_backward_says_so_and_names_the_wrapped_optimizers_step(fp16, between):
    """FP32 takes the same gradients again; float16 loss scaling has no scaled backward to check them by. The refusal
    said the loss came from no linked model, naming fixes done already (rewrite, link, opt.backward)."""
    model, eager = rewritten_and_eager(fp16)
    opt = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), fp16, model=model)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    for net, optimizer in ((model, opt), (eager, eager_opt)):
        net(*batch(1)).backward()
        optimizer.step()
        if between != "nothing":
            optimizer.zero_grad(set_to_none=False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(LossScalingError) as error:
        opt.step()
    message = str(error.value)
    assert "no backward through the linked Regression since the last step()" in message
    assert "rewrite() the model before decorate()" not in message  # done already: not a fix to suggest
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.optimizer.step()  # the fix it names: the same (true) gradients again, as FP32's second step
    eager_opt.step()
    assert all(relative_error(p, q) < 1e-2 for p, q in zip(model.parameters(), eager.parameters()))
