"""CUDA: float16 and bfloat16 training of the real models on a GPU, checked against FP32 on the same GPU.

The model is moved to the GPU before rewrite, as users do. float16 trains through graphamp.decorate (dynamic loss
scaling), bfloat16 with the plain optimizer. TF32 is off, so the FP32 runs are FP32.
"""

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import graphamp
from conftest import CompiledCodeRecorder
from models import LSTMClassifier, PooledSum, SmallResNet, bert, digits, gpt2, large_inputs, token_batch
from graphamp.inspection.recording import DtypeRecorder
from training import adamw, hf_loss, mean_loss_of_first_and_last_epoch, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}

# The CUDA kernels of white ops: GEMMs, convolutions, the fused attention backends, the cuDNN LSTM.
WHITE_KERNELS = (
    "mm", "addmm", "bmm", "convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "_cudnn_rnn",
)

TRAINING_STEPS = 8
# The last epoch's mean loss against the FP32 run's, relative. The runs drift apart as updates compound, and on
# SmallResNet and the LSTM that drift outweighs the dtype's own rounding. Measured on an H100 (torch 2.13, cuDNN
# attention), at seed 0 and [worst of 5 seeds]: float16 GPT-2 4.6e-6 [1.1e-5], BERT 1.9e-5 [4.4e-5], SmallResNet
# 5.9e-4 [1.7e-3], LSTM 1.6e-4 [2.4e-3]; bfloat16 GPT-2 1.7e-4 [1.7e-4], BERT 1.5e-4 [2.6e-4], SmallResNet
# 2.8e-4 [1.9e-3], LSTM 8.2e-4 [1.4e-3]. No float16 step was skipped. 2x the worst seed.
TRAINING_LOSS_RTOL = 5e-3


@pytest.fixture(autouse=True)
def fp32_without_tf32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def gpt2_case():
    ids = token_batch(4, 16).to(DEVICE)
    return gpt2, [((), {"input_ids": ids, "labels": ids}, None)], hf_loss, adamw(1e-3)


def bert_case():
    ids = token_batch(4, 16).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[:, 12:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 1], device=DEVICE)}
    return bert, [((), batch, None)], hf_loss, adamw(1e-3)


def resnet_digits_case():
    images, labels = digits(256)
    images, labels = images.to(DEVICE), labels.to(DEVICE)
    batches = [((images[i : i + 64],), {}, labels[i : i + 64]) for i in range(0, 256, 64)]
    return SmallResNet, batches, F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)


def lstm_case():
    tokens = token_batch(16, 12, seed=3).to(DEVICE)
    return LSTMClassifier, [((tokens,), {}, tokens[:, -1] % 4)], F.cross_entropy, adamw(1e-2)


CASES = {"gpt2": gpt2_case, "bert": bert_case, "resnet-digits": resnet_digits_case, "lstm": lstm_case}
PARAMS = [pytest.param(dtype, case, id=f"{dtype}-{name}") for dtype in DTYPES for name, case in CASES.items()]


def built(case):
    """(model on the GPU, an FP32 copy with the same weights, batches, loss function, optimizer factory)."""
    build, batches, loss_fn, make_optimizer = case()
    torch.manual_seed(0)
    model = build().to(DEVICE)
    return model, copy.deepcopy(model), batches, loss_fn, make_optimizer


def train(net, parameters, batches, loss_fn, make_optimizer, amp_lists=None):
    """TRAINING_STEPS steps cycling over `batches` (float16: with loss scaling); first and last epoch's mean loss."""
    optimizer = make_optimizer(parameters)
    if amp_lists is not None and amp_lists.dtype == torch.float16:
        optimizer = graphamp.decorate(optimizer, amp_lists=amp_lists)
    return mean_loss_of_first_and_last_epoch(net, optimizer, batches, loss_fn, TRAINING_STEPS)


def assert_tracks_fp32(first, last, expected_last, model=None):
    """The run's loss fell, finite, to within TRAINING_LOSS_RTOL of FP32's; the master weights stayed FP32."""
    assert torch.isfinite(torch.tensor([first, last])).all()
    assert last < first
    assert relative_error(last, expected_last) < TRAINING_LOSS_RTOL
    for parameter in model.parameters() if model is not None else ():
        assert parameter.dtype == torch.float32 and parameter.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype, case", PARAMS)
def test_white_kernels_run_in_the_low_dtype_on_cuda(dtype, case):
    model, _, batches, loss_fn, _ = built(case)
    args, kwargs, target = batches[0]
    amp = graphamp.rewrite(model, args, kwargs, amp_lists=graphamp.AutoMixedPrecisionLists(dtype=dtype))

    with DtypeRecorder() as recorder:
        loss_fn(amp(*args, **kwargs), target).backward()

    white_calls = recorder.calls_of(*WHITE_KERNELS)
    assert white_calls
    for call in white_calls:
        assert {d for d in call.in_dtypes if d.is_floating_point} == {DTYPES[dtype]}, call


@pytest.mark.parametrize("dtype, case", PARAMS)
def test_cuda_training_loss_decreases_and_tracks_fp32(dtype, case):
    model, reference, batches, loss_fn, make_optimizer = built(case)
    amp_lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    amp = graphamp.rewrite(model, *batches[0][:2], amp_lists=amp_lists)

    first, last = train(amp, model.parameters(), batches, loss_fn, make_optimizer, amp_lists)
    _, expected_last = train(reference, reference.parameters(), batches, loss_fn, make_optimizer)

    assert_tracks_fp32(first, last, expected_last)


@pytest.mark.parametrize("dtype, case", PARAMS)
def test_cuda_parameters_and_gradients_stay_fp32_on_the_gpu(dtype, case):
    model, _, batches, loss_fn, make_optimizer = built(case)
    amp_lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    amp = graphamp.rewrite(model, *batches[0][:2], amp_lists=amp_lists)

    train(amp, model.parameters(), batches[:1], loss_fn, make_optimizer, amp_lists)

    for name, parameter in model.named_parameters():
        assert parameter.dtype == torch.float32 and parameter.device.type == DEVICE, name
        assert parameter.grad is not None and parameter.grad.dtype == torch.float32, name


COMPILED_PARAMS = [
    pytest.param(dtype, CASES[name], id=f"{dtype}-{name}") for dtype in DTYPES for name in ("gpt2", "resnet-digits")
]


@pytest.mark.parametrize("dtype, case", COMPILED_PARAMS)
def test_cuda_compiled_training_loss_decreases_and_tracks_fp32(dtype, case):
    """compile=True on the GPU: inductor's kernels, float16 through decorate's loss scaling."""
    model, reference, batches, loss_fn, make_optimizer = built(case)
    amp_lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    amp = graphamp.rewrite(model, *batches[0][:2], amp_lists=amp_lists, compile=True)

    first, last = train(amp, model.parameters(), batches, loss_fn, make_optimizer, amp_lists)
    _, expected_last = train(reference, reference.parameters(), batches, loss_fn, make_optimizer)

    assert_tracks_fp32(first, last, expected_last, model)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_compiled_backward_keeps_black_modules_in_fp32(dtype):
    """pytorch#179804 on the GPU: the head listed in custom_black_modules stays FP32 in inductor's backward."""
    post_grad_graphs = []

    def record(graph):
        post_grad_graphs.append(
            {tuple(n.meta["val"].shape): n.meta["val"].dtype for n in graph.nodes if n.target == torch.ops.aten.mm.default}
        )

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 24), torch.nn.LogSoftmax(-1)
    ).to(DEVICE)
    x = torch.randn(16, 32, device=DEVICE)
    lists = graphamp.AutoMixedPrecisionLists(dtype=dtype, custom_black_modules=["2"])
    with torch._inductor.config.patch(post_grad_custom_post_pass=record, fx_graph_cache=False):
        amp = graphamp.rewrite(model, (x,), amp_lists=lists, compile=True)
        amp(x).sum().backward()

    backward_matmuls = post_grad_graphs[-1]
    assert backward_matmuls == {(16, 48): torch.float32, (24, 48): torch.float32, (48, 32): DTYPES[dtype]}


def test_cuda_doctor_finds_the_float16_overflow_and_its_verified_fix():
    torch.manual_seed(0)
    model = PooledSum().to(DEVICE)
    x, target = (t.to(DEVICE) for t in large_inputs(8, 256, 16))

    report = graphamp.doctor(model, (x, target), amp_lists=graphamp.AutoMixedPrecisionLists(dtype="float16"))

    assert (report.first_nonfinite.module, report.first_nonfinite.runs_in) == ("pool", "float16")
    fixes = [(s.kind, s.target, s.verified) for s in report.suggestions if s.kind != "white_op"]
    assert fixes == [("black_module", "pool", True)]
    assert graphamp.doctor(model, (x, target), amp_lists=report.suggested_lists()).finite


# The kernels whose dtypes the lists decide on CUDA: the white ones, and the loss's log-softmax and NLL (black).
DECIDED_KERNELS = (*WHITE_KERNELS, "_log_softmax", "nll_loss_forward")


def decided_kernels(recorder):
    return Counter(
        (call.op, tuple(d for d in call.in_dtypes if d.is_floating_point)[:3])
        for call in recorder.calls if call.op in DECIDED_KERNELS
    )


def under_auto_cast(model, amp_lists, loss_fn):
    """(net, loss_fn) for train(): the forward and the loss run together under graphamp.auto_cast, as torch.autocast's
    recipe puts them (a loss outside the context would take the low logits as they are)."""

    def inputs(*args, **kwargs):
        return args, kwargs

    def loss(batch, target):
        args, kwargs = batch
        with graphamp.auto_cast(amp_lists, model=model):
            return loss_fn(model(*args, **kwargs), target)

    return inputs, loss


@pytest.mark.parametrize("dtype, case", PARAMS)
def test_cuda_auto_cast_runs_each_decided_kernel_in_the_dtype_the_rewritten_graphs_run_it(dtype, case):
    """Forward and backward on the GPU: the eager policy and the cast pass decide alike, op by op."""
    model, eager, batches, loss_fn, _ = built(case)
    args, kwargs, target = batches[0]
    amp_lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    net, loss = under_auto_cast(eager, amp_lists, loss_fn)
    with CompiledCodeRecorder() as by_policy:
        loss(net(*args, **kwargs), target).backward()
    graphamp.rewrite(model, args, kwargs, amp_lists=amp_lists)
    with CompiledCodeRecorder() as by_pass:
        loss_fn(model(*args, **kwargs), target).backward()
    assert decided_kernels(by_policy) == decided_kernels(by_pass)
    assert any(DTYPES[dtype] in dtypes for _, dtypes in decided_kernels(by_policy))


@pytest.mark.parametrize("dtype, case", PARAMS)
def test_cuda_auto_cast_training_loss_decreases_and_tracks_fp32(dtype, case):
    """graphamp.auto_cast on the GPU, float16 through decorate's loss scaling outside any graph."""
    model, reference, batches, loss_fn, make_optimizer = built(case)
    amp_lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)

    net, loss = under_auto_cast(model, amp_lists, loss_fn)
    first, last = train(net, model.parameters(), batches, loss, make_optimizer, amp_lists)
    _, expected_last = train(reference, reference.parameters(), batches, loss_fn, make_optimizer)

    assert_tracks_fp32(first, last, expected_last, model)


def test_cuda_compiled_outputs_keep_low_storage_and_train_with_loss_scaling():
    """A compiled float16 GPT-2's logits present float32 over float16 storage (no float32 copy of the largest
    activation), and the in-graph loss scaling leaves true, finite FP32 gradients."""
    model, reference, batches, loss_fn, make_optimizer = built(gpt2_case)
    args, kwargs, target = batches[0]
    amp_lists = graphamp.AutoMixedPrecisionLists(dtype="float16")
    amp = graphamp.rewrite(model, args, kwargs, amp_lists=amp_lists, compile=True)
    optimizer = graphamp.decorate(make_optimizer(model.parameters()), amp_lists=amp_lists, model=amp)

    output = amp(*args, **kwargs)
    loss_fn(output, target).backward()
    loss_fn(reference(*args, **kwargs), target).backward()

    assert output.logits.dtype == torch.float32
    assert graphamp.stored_values(output.logits).dtype == torch.float16
    for mine, fp32 in zip(model.parameters(), reference.parameters()):
        assert mine.grad.dtype == torch.float32 and torch.isfinite(mine.grad).all()
        assert relative_error(mine.grad.norm(), fp32.grad.norm()) < 5e-2
    optimizer.step()
    assert optimizer.loss_scaler.bad_steps == 0
