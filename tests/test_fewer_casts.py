"""Black ops that can compute in FP32 inside their kernel get no cast kernel, so graphamp casts no more than autocast,
on both front ends (rewrite under torch.compile, export_program)."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphamp
from conftest import FrontEnd
import encoder_models
from graphamp.inspection.recording import DtypeRecorder, floating
from graphamp.passes.marks import mark_of
from graphamp.policy.kernel_support import _probe, rounded_once, runs_low_on
from training import relative_error

RUNS_LOW_ON = "graphamp.passes.cast_pass.runs_low_on"
# MobileViT with one block a stage (shallow_mobilevit): its convolutions beside attention, in a third of the ops.
ENCODERS = {**encoder_models.ENCODERS, "mobilevit": encoder_models.shallow_mobilevit}


class ConvNeXtBlockTail(nn.Module):
    """conv -> layer_norm -> linear, as in ConvNeXt: the norm reads the conv's low output."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x).permute(0, 2, 3, 1)))


def test_norm_feeding_only_a_gemm_reads_the_low_input_with_fp32_parameters(rewritten, bf16, seeded):
    model, x = ConvNeXtBlockTail(), torch.randn(2, 8, 6, 6)
    expected = model(x)
    amp = rewritten.convert(model, (x,), amp_lists=bf16)
    with amp.recording() as rec:
        out = amp.run(x)
    (norm,) = rec.calls_of("native_layer_norm")
    assert norm.in_dtypes == (torch.bfloat16, torch.float32, torch.float32)
    (node,) = [n for n in amp.graph_module.graph.nodes if n.target == torch.ops.aten.layer_norm.default]
    neighbours = [*node.all_input_nodes, *node.users]  # autocast casts the input up and the output back down
    assert not [n for n in neighbours if getattr(mark_of(n), "decision", None) == "inserted-cast"]
    assert relative_error(out, expected) < 2e-2


class PostNorm(nn.Module):
    """BERT's post-norm block: the norm's output is both the next GEMM's input and the residual."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.out = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(self.fc(x))
        return self.out(h) + h


def test_norm_reads_its_low_input_with_fp32_parameters_and_its_output_follows(rewritten, bf16, seeded):
    model, x = PostNorm(), torch.randn(2, 8)
    expected = model(x)
    with DtypeRecorder() as autocast_rec, torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(x)
    amp = rewritten.convert(model, (x,), amp_lists=bf16)
    with amp.recording() as rec:
        out = amp.run(x)
    (norm,) = rec.calls_of("native_layer_norm")
    assert norm.in_dtypes == (torch.bfloat16, torch.float32, torch.float32) and norm.out_dtypes[0] == torch.bfloat16
    assert norm == autocast_rec.calls_of("native_layer_norm")[0]  # CPU autocast runs it the same way
    assert rec.casts <= autocast_rec.casts + 1  # + the output cast back to the FP32 the model returns
    assert relative_error(out, expected) < 2e-2 and relative_error(out, reference.float()) < 1e-2


def test_a_norm_the_user_puts_on_the_black_list_runs_fp32(rewritten, seeded):
    lists = graphamp.AutoMixedPrecisionLists(custom_black_list=["layer_norm"], dtype="bfloat16")
    model, x = PostNorm(), torch.randn(2, 8)
    amp = rewritten.convert(model, (x,), amp_lists=lists)
    with amp.recording() as rec:
        amp.run(x)
    (norm,) = rec.calls_of("native_layer_norm")
    assert floating(norm.in_dtypes) == {torch.float32} and norm.out_dtypes[0] == torch.float32


def test_where_the_device_kernel_cannot_mix_dtypes_the_norm_reads_fp32(rewritten, bf16, seeded, monkeypatch):
    """Every device's norm kernel is asked whether it takes a low X with FP32 parameters; a no casts X up."""
    monkeypatch.setattr(RUNS_LOW_ON, lambda op, device, dtype: "norm" not in op)
    model, x = PostNorm(), torch.randn(2, 8)
    expected = model(x)
    amp = rewritten.convert(model, (x,), amp_lists=bf16)
    with amp.recording() as rec:
        out = amp.run(x)
    (norm,) = rec.calls_of("native_layer_norm")
    assert floating(norm.in_dtypes) == {torch.float32}
    assert relative_error(out, expected) < 2e-2


def test_the_probes_answer_for_this_cpu():
    for op in ("native_layer_norm", "native_group_norm", "batch_norm", "upsample_bilinear2d", "upsample_nearest2d"):
        assert runs_low_on(op, torch.device("cpu"), torch.bfloat16), op  # CPU kernels: FP32 inside
    assert runs_low_on("addmm", torch.device("cpu"), torch.bfloat16)  # no probe for other ops
    assert not runs_low_on("native_layer_norm", torch.device("meta"), torch.bfloat16)


@pytest.mark.parametrize("first_asked_in", ["torch.func.grad", "torch.func.vmap", "a checkpoint region"])
def test_the_probes_answer_does_not_depend_on_where_it_was_first_asked(first_asked_in):
    """The answer is kept for the process: first asked inside a torch.func transform (which refuses the probe's
    requires_grad_) it was False for good, and every later normalization ran in FP32; inside a checkpoint region
    the probe's tensors went through the region's saved-tensor hooks, and its backward raised CheckpointError."""
    answers = []

    def ask(x):
        answers.append(runs_low_on("native_layer_norm", torch.device("cpu"), torch.bfloat16))
        return x.sin().sum()

    _probe.cache_clear()
    try:
        x = torch.randn(3, requires_grad=True)
        if first_asked_in == "torch.func.grad":
            torch.func.grad(ask)(x)
        elif first_asked_in == "torch.func.vmap":
            torch.func.vmap(ask)(x.detach())
        else:
            checkpoint(ask, x, use_reentrant=False).backward()
        assert answers[0] and runs_low_on("native_layer_norm", torch.device("cpu"), torch.bfloat16)
    finally:
        _probe.cache_clear()  # a wrong answer must not reach the next tests


def test_the_accumulation_probe_tells_an_fp32_accumulator_from_a_low_one():
    values = torch.sin(torch.arange(512.0)).bfloat16().float()
    exact = values.cumsum(0)
    running, low = torch.zeros((), dtype=torch.bfloat16), []
    for value in values.bfloat16():  # adds in bfloat16, rounding at every step, as atomicAdd into bf16 does
        running = running + value
        low.append(running)
    assert rounded_once(exact.bfloat16(), exact, torch.bfloat16)
    assert not rounded_once(torch.stack(low), exact, torch.bfloat16)


class Attention(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.qkv, self.dropout = nn.Linear(8, 24), nn.Dropout(p)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = self.dropout(torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1))
        return probs @ v, torch.softmax(q.sum(-1), dim=-1)  # the second feeds no GEMM: FP32


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_softmax_feeding_a_matmul_reads_and_writes_low(rewritten, bf16, seeded, p):
    model, x = Attention(p), torch.randn(2, 5, 8)
    reference = copy.deepcopy(model)
    amp = rewritten.convert(model, (x,), amp_lists=bf16)
    torch.manual_seed(1)
    with amp.recording() as rec:
        out, weights = amp.run(x)
    attention, pooled = rec.calls_of("_softmax")
    assert attention.in_dtypes == (torch.bfloat16,) and attention.out_dtypes == (torch.bfloat16,)
    assert pooled.out_dtypes == (torch.float32,)
    torch.manual_seed(1)  # the same dropout mask: the rewritten graph draws it as eager does
    expected, expected_weights = reference(x)
    assert relative_error(out, expected) < 2e-2 and relative_error(weights, expected_weights) < 1e-2


class PooledHead(nn.Module):
    """ConvNeXt's head: a spatial mean, a LayerNorm, the classifier."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.classifier = nn.Conv2d(3, 8, 3), nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.classifier(self.norm(self.conv(x).mean(dim=(-2, -1))))


def test_a_mean_read_by_a_norm_then_a_gemm_reads_and_writes_low(rewritten, bf16, seeded):
    """The norm reads its low X as it is, so the mean's FP32 result would only be cast back down for the GEMM."""
    model, x = PooledHead(), torch.randn(2, 3, 8, 8)
    expected = model(x)
    amp = rewritten.convert(model, (x,), amp_lists=bf16)
    with amp.recording() as rec:
        out = amp.run(x)
    (mean,) = rec.calls_of("mean")
    assert mean.in_dtypes == (torch.bfloat16,) and mean.out_dtypes == (torch.bfloat16,)
    # The input, the weights and biases of conv and classifier; export_program casts the logits back up, where a
    # rewritten model returns them low, presented as float32 (upcast where read).
    assert rec.casts == 1 + 4 + (rewritten.name == "export")
    assert relative_error(out, expected) < 2e-2


class Upsampler(nn.Module):
    def __init__(self):
        super().__init__()
        self.down, self.up = nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x):
        return self.up(nn.functional.interpolate(self.down(x), scale_factor=2, mode="bilinear"))


def test_interpolation_follows_its_input_where_backward_accumulates_in_fp32(rewritten, bf16, seeded, monkeypatch):
    model, x = Upsampler(), torch.randn(2, 3, 8, 8)
    expected = model(x)
    kernels = {}
    for probe_says in (True, False):
        monkeypatch.setattr(RUNS_LOW_ON, lambda op, device, dtype, ok=probe_says: ok)
        amp = rewritten.convert(copy.deepcopy(model), (x,), amp_lists=bf16)
        with amp.recording() as rec:
            out = amp.run(x)
            out.sum().backward()
        kernels[probe_says] = (rec.calls_of("upsample_bilinear2d")[0], rec.calls_of("upsample_bilinear2d_backward")[0])
        assert relative_error(out, expected) < 2e-2
    assert kernels[True][0].in_dtypes == (torch.bfloat16,) and kernels[True][1].in_dtypes == (torch.bfloat16,)
    assert kernels[False][0].in_dtypes == (torch.float32,) and kernels[False][1].in_dtypes == (torch.float32,)


def test_sum_of_a_low_value_accumulates_in_fp32_through_its_dtype_argument(rewritten, bf16, seeded):
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    expected = model(x).mean(-1)
    amp = rewritten.convert(nn.Sequential(model, Mean()), (x,), amp_lists=bf16)
    with amp.recording() as rec:
        out = amp.run(x)
    (mean,) = rec.calls_of("mean")
    assert mean.in_dtypes == (torch.bfloat16,) and mean.out_dtypes == (torch.float32,)
    assert relative_error(out, expected) < 1e-2


class Mean(nn.Module):
    def forward(self, h):
        return h.mean(-1)


# Each front end is held to autocast on its own path: rewrite (torch.compile) for training steps, export_program
# for eval steps (the deployed program); the cheaper encoders are counted both ways in both modes, to show the two
# front ends execute the same casts (converting MobileViT and SegFormer under dynamo takes the longest).
BOTH_WAYS = ("convnext", "albert", "resnet", "vit")
_COUNTED = {}


def casts_per_step(name: str, train: bool, front_end: str) -> int:
    """Casts one step (forward and backward) of the encoder executes: through `front_end` ("compile", "export"),
    or under torch.autocast ("autocast"); counted once per model, mode and front end."""
    key = (name, train, front_end)
    if key not in _COUNTED:
        torch.manual_seed(0)
        model, batch = ENCODERS[name]()
        model.train(train)
        if front_end == "autocast":
            with DtypeRecorder() as rec, torch.autocast("cpu", dtype=torch.bfloat16):
                model(**batch).logits.float().pow(2).mean().backward()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
                amp = FrontEnd(front_end).convert(model, (), batch, amp_lists=lists)
            with amp.recording() as rec:
                amp.run(**batch).logits.float().pow(2).mean().backward()
        _COUNTED[key] = rec.casts
    return _COUNTED[key]


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", BOTH_WAYS)
def test_casts_per_step_are_the_same_on_both_front_ends(name, train):
    # Where export_program casts the logits up once and the step's `pow` saves that copy, a rewritten model's logits
    # stay low and are upcast where read: by `pow`, and by its backward again (recomputed, not stored).
    assert casts_per_step(name, train, "compile") == casts_per_step(name, train, "export") + 1 > 1


@pytest.mark.parametrize("name", ENCODERS)
def test_casts_per_exported_eval_step_are_no_more_than_autocasts(name):
    assert casts_per_step(name, False, "export") <= casts_per_step(name, False, "autocast")


# Segformer's stochastic depth draws `torch.rand(shape, dtype=x.dtype)`, which the FP32 trace freezes as float32:
# the draw follows the low values it meets, as autocast's does, and adds no casts (cast_pass.py, _draws).
@pytest.mark.parametrize("name", ENCODERS)
def test_casts_per_rewritten_training_step_are_no_more_than_autocasts(name):
    # Under autocast the step's `logits.float()` is a float32 copy that `pow` saves for backward; a rewritten model's
    # logits stay low and `pow`'s backward reads them again, upcast: one cast more, autocast's memory.
    assert casts_per_step(name, True, "compile") <= casts_per_step(name, True, "autocast") + 1
