"""graphamp.auto_cast: the lists as a runtime policy, and a rewritten model's code that dynamo runs itself.

Every dtype here is the one a kernel ran in (a dispatch mode records them), against the cast pass on the same model
or against torch.autocast.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import threading
from collections import Counter
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import graphamp
import models
from models import Broken
from encoder_models import ENCODERS, shallow_mobilevit
from conftest import CompiledCodeRecorder, FrontEnd, write_list_folder
from training import relative_error
from graphamp.inspection.recording import DtypeRecorder
from graphamp.passes.marks import mark_of

# The kernels the lists decide and a dtype shows: GEMMs, convolutions, attention, recurrent cells (white); the loss
# and log-softmax (black).
DECIDED_KERNELS = {
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
    "_thnn_fused_lstm_cell", "mkldnn_rnn_layer", "_log_softmax", "nll_loss_forward",
}


def decided_kernels(recorder: DtypeRecorder, ops=DECIDED_KERNELS) -> Counter:
    """(op, dtypes of its first three floating inputs) of each decided kernel that ran: an attention mask the
    compiled HF code builds and the eager code leaves to is_causal is not a decision of graphamp's."""
    return Counter(
        (call.op, tuple(d for d in call.in_dtypes if d.is_floating_point)[:3])
        for call in recorder.calls if call.op in ops
    )


def low_and_fp32(recorder: DtypeRecorder, ops=("addmm", "mm")) -> tuple[int, int]:
    """How many of these GEMM kernels ran in bfloat16 and how many in float32."""
    calls = recorder.calls_of(*ops)
    low = sum(all(d == torch.bfloat16 for d in c.in_dtypes if d.is_floating_point) for c in calls)
    return low, len(calls) - low


# The transformers with one block: each block is decided alike, and dynamo's time grows with the blocks.
MODEL_SET = {
    "gpt2": (lambda: models.gpt2(n_layer=1), lambda: ((models.token_batch(),), {})),
    "bert": (lambda: models.bert(num_hidden_layers=1), lambda: ((models.token_batch(),), {})),
    "llama": (lambda: models.llama(num_hidden_layers=1), lambda: ((models.token_batch(),), {})),
    "resnet": (models.SmallResNet, lambda: ((torch.randn(2, 1, 8, 8),), {})),
    "lstm": (models.LSTMClassifier, lambda: ((models.token_batch(),), {})),
    "custom_op": (models.CustomOpModel, lambda: ((torch.randn(4, 8),), {})),
    "blocks": (models.BlockStack, lambda: ((models.token_batch(), models.token_batch()), {})),
    # held out from the rest of the file: shifted-window attention, and convolutions beside attention (MobileViT
    # with one block a stage: the same mix, a third of the ops)
    **{name: (lambda build=build: build()[0], lambda build=build: ((), build()[1]))
       for name, build in (("swin", ENCODERS["swin"]), ("mobilevit", shallow_mobilevit))},
}


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", sorted(MODEL_SET))
def test_auto_cast_decides_like_the_cast_pass(bf16, name, level):
    make, example = MODEL_SET[name]
    torch.manual_seed(0)
    model = make().eval()
    args, kwargs = example()
    eager = copy.deepcopy(model)
    with CompiledCodeRecorder() as by_policy, graphamp.auto_cast(bf16, level, model=eager):
        eager(*args, **kwargs)
    FrontEnd("compile").convert(model, args, kwargs, amp_lists=bf16, level=level)
    with CompiledCodeRecorder() as by_pass:
        model(*args, **kwargs)
    assert decided_kernels(by_policy) == decided_kernels(by_pass)
    assert any(torch.bfloat16 in dtypes for _, dtypes in decided_kernels(by_policy))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_auto_cast_decides_like_the_cast_pass_in_training_with_stochastic_depth(bf16, level):
    """HF's drop_path draws its mask with `dtype=x.dtype`: low under auto_cast where x is low, and low in the
    rewritten graph too, though the FP32 trace froze that dtype as float32 (else the mask promotes the stream)."""
    torch.manual_seed(0)
    model, pixels = ENCODERS["segformer"]()  # drop_path_rate 0.1: the second block draws a mask
    model.train()
    eager = copy.deepcopy(model)
    with CompiledCodeRecorder() as by_policy, graphamp.auto_cast(bf16, level, model=eager):
        eager(**pixels)
    FrontEnd("compile").convert(model, (), pixels, amp_lists=bf16, level=level)
    with CompiledCodeRecorder() as by_pass:
        model(**pixels)
    decided = DECIDED_KERNELS | {"rand", "floor_", "mul", "add"}
    assert decided_kernels(by_policy, decided) == decided_kernels(by_pass, decided)
    masks = [call.out_dtypes for call in by_pass.calls_of("rand")]
    assert masks and set(masks) == {(torch.bfloat16,)}


# Ops that only move, view or cast values (casts differ where the graph shares one): every other kernel is compared.
MOVES_AND_CASTS = {
    "_to_copy", "detach", "view", "t", "transpose", "expand", "permute", "clone", "_unsafe_view", "unsqueeze",
    "squeeze", "reshape", "slice", "select", "split", "as_strided", "copy_", "empty", "empty_strided", "alias",
    "split_with_sizes", "unbind", "contiguous", "lift_fresh", "ones_like", "zeros_like", "fill_", "zero_",
}


# The attention mask some torch versions' compiled HF code builds (its ops, and attention's mask input), where the
# eager code leaves masking to the kernel: HF's choice, not a decision of graphamp's.
MASK_OPS = {"scalar_tensor", "where"}
ATTENTION_INPUTS_BUT_THE_MASK = {
    "_scaled_dot_product_flash_attention_for_cpu": 3, "_scaled_dot_product_flash_attention_for_cpu_backward": 6,
}


def floating_kernels(recorder: DtypeRecorder) -> Counter:
    return Counter(
        (call.op, tuple(d for d in call.in_dtypes if d.is_floating_point)[:ATTENTION_INPUTS_BUT_THE_MASK.get(call.op)],
         call.out_dtypes)
        for call in recorder.calls
        if call.op not in MOVES_AND_CASTS | MASK_OPS
        and any(d.is_floating_point for d in call.in_dtypes + call.out_dtypes)
    )


@pytest.mark.parametrize("name", ["bert", "vit", "convnext", "swin"])
def test_a_train_step_under_auto_cast_runs_every_kernel_in_the_dtypes_the_rewritten_graphs_run_it(bf16, name):
    """Forward and backward, every kernel but moves and casts: dropout, residual sums, gradient sums included."""
    torch.manual_seed(0)
    if name == "bert":  # one block, as in MODEL_SET
        model, kwargs = models.bert(num_hidden_layers=1), {"input_ids": models.token_batch()}
    else:
        model, kwargs = ENCODERS[name]()
    model.train()
    eager = copy.deepcopy(model)
    with CompiledCodeRecorder() as by_policy:
        with graphamp.auto_cast(bf16, model=eager):
            output = eager(**kwargs)
        output.logits.float().square().mean().backward()
    graphamp.rewrite(model, (), kwargs, amp_lists=bf16)
    with CompiledCodeRecorder() as by_pass:
        model(**kwargs).logits.float().square().mean().backward()
    assert floating_kernels(by_policy) == floating_kernels(by_pass)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def test_auto_cast_trains_like_torch_autocast(bf16):
    torch.manual_seed(0)
    ours, theirs = Head(), Head()
    theirs.load_state_dict(ours.state_dict())
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with graphamp.auto_cast(bf16):
        loss = F.cross_entropy(ours(x), y)
    loss.backward()
    with torch.autocast("cpu", torch.bfloat16):
        reference = F.cross_entropy(theirs(x), y)
    reference.backward()
    assert loss.dtype == reference.dtype == torch.float32
    torch.testing.assert_close(loss, reference)
    for mine, autocasts in zip(ours.parameters(), theirs.parameters()):
        assert mine.dtype == mine.grad.dtype == torch.float32
        torch.testing.assert_close(mine.grad, autocasts.grad)


class SharedInput(nn.Module):
    """One FP32 activation (a norm's output) read by three GEMMs, as q, k and v are."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q, self.k, self.v = (nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return (self.q(h) * self.k(h)) @ self.v(h).transpose(0, 1)


def test_auto_cast_casts_an_activation_several_ops_read_once_as_the_cast_pass_does(bf16):
    torch.manual_seed(0)
    ours, x = SharedInput(), torch.randn(8, 16)
    theirs, in_graph = copy.deepcopy(ours), copy.deepcopy(ours)
    with DtypeRecorder() as eager_run:
        with graphamp.auto_cast(bf16):
            out = ours(x)
        out.sum().backward()
    with DtypeRecorder() as autocasts:
        with torch.autocast("cpu", torch.bfloat16):
            expected = theirs(x)
        expected.sum().backward()
    graphamp.rewrite(in_graph, (x,), amp_lists=bf16)
    with CompiledCodeRecorder() as graph_run:
        in_graph(x).sum().backward()
    # the norm's output is cast down once (autocast: three times), and its readers' three gradients are summed low
    # before one cast back (autocast: three casts back, summed in float32), as in the graph
    assert eager_run.casts == autocasts.casts - 4
    summed = [c.in_dtypes for c in eager_run.calls_of("add")]
    assert summed == [c.in_dtypes for c in graph_run.calls_of("add")] == [(torch.bfloat16, torch.bfloat16)] * 2
    assert [c.in_dtypes for c in autocasts.calls_of("add")] == [(torch.float32, torch.float32)] * 2
    for mine, want in zip(ours.parameters(), theirs.parameters()):
        assert relative_error(mine.grad, want.grad) < 2e-2


def test_auto_cast_recasts_an_activation_written_in_place_since_its_cast(bf16):
    torch.manual_seed(0)
    model, x = Head(), torch.randn(8, 16, requires_grad=True)
    with graphamp.auto_cast(bf16):
        h = x * 1.0  # an FP32 activation, not a leaf
        first = model.body(h)  # its cast is saved for backward: alive
        h.mul_(2)  # a write: the next read is cast anew
        second = model.body(h)
    (first.sum() + second.sum()).backward()
    torch.testing.assert_close(second.float(), model.body(2 * x).detach(), atol=0.1, rtol=0.05)
    torch.testing.assert_close(x.grad, 3 * model.body.weight.sum(0).expand_as(x), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("first_forward_under", [torch.no_grad, torch.inference_mode])
def test_a_weight_cast_made_without_grad_is_not_reused_by_a_forward_with_grad(bf16, first_forward_under):
    """An evaluation (a teacher's, a rollout's) forward first, then a training forward in the same context: the
    cached weight casts of the first have no history (or are inference tensors), and the weights got no gradient."""
    torch.manual_seed(0)
    model, x = Head(), torch.randn(4, 16)
    twin = copy.deepcopy(model)
    with graphamp.auto_cast(bf16):
        with first_forward_under():
            model(x)
        model(x).float().sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        with first_forward_under():
            twin(x)
        twin(x).float().sum().backward()
    for (name, mine), theirs in zip(model.named_parameters(), twin.parameters()):
        assert mine.grad is not None, name
        assert relative_error(mine.grad, theirs.grad) < 2e-2, name


def test_auto_cast_under_inference_mode_casts_an_input_made_outside_it(bf16):
    model, x = Head(), torch.randn(4, 16)  # x: a batch made outside inference mode
    with DtypeRecorder() as recorder, torch.inference_mode(), graphamp.auto_cast(bf16):
        model(x)
    assert low_and_fp32(recorder, ops=("linear",)) == (2, 0)  # inference mode dispatches linear whole


def test_auto_cast_keeps_custom_black_ops_and_the_models_fp32_regions(bf16):
    lists = bf16.with_changes(black=["linear"])

    class Regions(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                kept = self.a(x)
            return self.b(x) @ kept.t()

    with DtypeRecorder() as recorder, graphamp.auto_cast(lists):
        Regions()(torch.randn(4, 8))
    assert [c.in_dtypes for c in recorder.calls_of("addmm")] == [(torch.float32,) * 3] * 2
    assert [c.in_dtypes for c in recorder.calls_of("mm")] == [(torch.bfloat16,) * 2]


def test_auto_cast_keeps_black_modules_of_the_model_in_fp32(bf16):
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16", custom_black_modules=["head"])
    model = Head()
    with DtypeRecorder() as recorder, graphamp.auto_cast(lists, model=model):
        model(torch.randn(4, 16))
    dtypes = [c.in_dtypes[0] for c in recorder.calls_of("addmm")]
    assert dtypes == [torch.bfloat16, torch.float32]


class PackedGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.gru = nn.Embedding(models.VOCAB, 16), nn.GRU(16, 16, batch_first=True)

    def forward(self, tokens, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths, batch_first=True)
        return self.gru(packed)[1].sum()


def test_o2_feeds_an_rnn_a_low_input_through_its_dtype_check_and_trains(bf16):
    model, tokens, lengths = PackedGRU(), models.token_batch(), torch.tensor([6, 3])
    with DtypeRecorder() as recorder, graphamp.auto_cast(bf16, "O2", model=model):
        model(tokens, lengths).backward()
    low, fp32 = low_and_fp32(recorder)  # a packed GRU runs as GEMMs, one per step
    assert low > 0 and fp32 == 0
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with graphamp.auto_cast(bf16, model=model), pytest.raises(ValueError, match="does not match weight dtype"):
        model.gru(torch.randn(2, 3, 16, dtype=torch.bfloat16))  # O1 passes the model's own dtypes through as written


def test_a_rewritten_o2_lstm_under_a_dispatch_mode_runs_low_eagerly(bf16):
    model, tokens = models.LSTMClassifier(), models.token_batch()
    graphamp.rewrite(model, (tokens,), amp_lists=bf16, level="O2")
    with FlopCounterMode(display=False), DtypeRecorder() as recorder:  # dynamo runs the model's code eagerly
        model(tokens).sum().backward()
    assert {c.in_dtypes[0] for c in recorder.calls_of("mkldnn_rnn_layer", "addmm")} == {torch.bfloat16}
    assert all(p.grad is not None for p in model.parameters())


class FNetMixing(nn.Module):
    """FNet's token mixing: a linear, a 2-D FFT over the sequence and hidden dims, its real part, a linear."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.fft.fftn(self.a(x), dim=(1, 2)).real)


def fft_kernels(recorder: DtypeRecorder) -> list[tuple]:
    """The input dtypes of each FFT kernel that ran, forward and backward."""
    return [call.in_dtypes for call in recorder.calls if call.op.startswith("_fft_")]


@pytest.mark.parametrize("front", ["rewrite", "auto_cast"])
def test_an_fnet_trains_with_its_ffts_in_float32_as_under_torch_autocast(bf16, front):
    torch.manual_seed(0)
    ours, x = FNetMixing(), torch.randn(2, 8, 16)
    theirs = copy.deepcopy(ours)
    with DtypeRecorder() as autocasts:
        with torch.autocast("cpu", torch.bfloat16):
            expected = theirs(x)
        expected.sum().backward()
    if front == "rewrite":
        graphamp.rewrite(ours, (x,), amp_lists=bf16)
    with CompiledCodeRecorder() if front == "rewrite" else DtypeRecorder() as recorder:
        with graphamp.auto_cast(bf16) if front == "auto_cast" else contextlib.nullcontext():
            out = ours(x)
        out.sum().backward()
    assert fft_kernels(recorder) == fft_kernels(autocasts) == [(torch.complex64,)] * 2  # float32 pairs
    assert low_and_fp32(recorder) == low_and_fp32(autocasts) and low_and_fp32(recorder)[0] > 0  # the linears ran low
    for mine, want in zip(ours.parameters(), theirs.parameters()):
        assert mine.grad.dtype == torch.float32 and relative_error(mine.grad, want.grad) < 2e-2


class SpectralAndNuclearNorms(nn.Module):
    """matrix_norm of ord 2 and 'nuc' of a linear's low output: black, with a dtype argument, yet its kernel refuses
    low inputs for these orders whatever the dtype."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return torch.linalg.matrix_norm(h, 2) + torch.linalg.matrix_norm(h, "nuc")


def run_through(front: str, model: nn.Module, x: torch.Tensor, lists) -> Callable:
    """`model` run by one front end: rewrite() given `x`, export_program(...).module(), or auto_cast as a decorator."""
    if front == "rewrite":
        return graphamp.rewrite(model, (x,), amp_lists=lists)
    if front == "export":
        return graphamp.export_program(model, (x,), amp_lists=lists).module()
    return graphamp.auto_cast(lists)(model)


@pytest.mark.parametrize("front", ["rewrite", "export", "auto_cast"])
def test_a_black_op_whose_kernel_refuses_low_inputs_with_dtype_float32_reads_them_cast_up(bf16, front):
    torch.manual_seed(0)
    model, x = SpectralAndNuclearNorms(), torch.randn(2, 8, 8)
    expected = model(x)
    run = run_through(front, model, x, bf16)
    with CompiledCodeRecorder() as recorder:
        out = run(x)
    assert [call.in_dtypes for call in recorder.calls_of("_linalg_svd")] == [(torch.float32,)] * 2
    assert low_and_fp32(recorder, ("addmm", "mm", "bmm")) == (1, 0)  # the linear ran low
    assert relative_error(out, expected) < 2e-2


class Doubled(nn.Module):
    """A linear's low output added to itself (add.Tensor) and to a number (add.Tensor too, the number wrapped)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return (h + h) + 1.0


@pytest.mark.parametrize("front", ["rewrite", "export", "auto_cast"])
def test_an_overload_entry_decides_its_overload_eagerly_as_in_the_graphs(front):
    """'add.Tensor' black beside the shipped gray 'add': the more specific entry decides (lists/README.md), though a
    torch call names only the packet."""
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16", custom_black_list=["add.Tensor"])
    model, x = Doubled(), torch.randn(2, 8)
    run = run_through(front, model, x, lists)
    with CompiledCodeRecorder() as recorder:
        run(x)
    assert low_and_fp32(recorder) == (1, 0)
    assert [c.in_dtypes for c in recorder.calls_of("add")] == [(torch.float32,) * 2, (torch.float32,)]


class Normalized(nn.Module):
    """F.normalize of a linear's low output: its Tensor.norm passes `dtype=None` on to torch.norm (black)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return F.normalize(self.proj(x), dim=-1)


def test_a_black_op_passed_dtype_none_computes_in_float32_through_it_as_in_the_graph(bf16):
    torch.manual_seed(0)
    model, x = Normalized(), torch.randn(4, 8)
    eager = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    with CompiledCodeRecorder() as in_graph:
        model(x).sum().backward()
    with DtypeRecorder() as under_policy:
        with graphamp.auto_cast(bf16):
            out = eager(x)
        out.sum().backward()
    kernels = [Counter((c.op, c.in_dtypes) for c in recorder.calls_of("linalg_vector_norm", "div", "add"))
               for recorder in (in_graph, under_policy)]
    assert kernels[0] == kernels[1] and (("linalg_vector_norm", (torch.bfloat16,)), 1) in kernels[1].items()


class LinearAlgebra(nn.Module):
    """A linear's low output through LAPACK ops that CPU autocast runs FP32: none has a bfloat16 kernel on CPU."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        spd = torch.baddbmm(4 * torch.eye(4), h, h.transpose(-1, -2))  # white: low
        return (torch.linalg.inv(spd).sum() + torch.linalg.solve(spd, h).sum() + torch.linalg.cholesky(spd).sum() +
                torch.linalg.eigvalsh(spd).sum() + torch.linalg.svdvals(h).sum() + torch.linalg.qr(h)[0].sum())


def lapack_kernels(recorder: DtypeRecorder) -> Counter:
    return Counter((call.op, call.in_dtypes) for call in recorder.calls
                   if call.op.startswith(("linalg_", "_linalg_")) and call.op != "linalg_vector_norm")


@pytest.mark.parametrize("front", ["rewrite", "export", "auto_cast"])
def test_linear_algebra_runs_in_float32_as_under_torch_autocast(bf16, front):
    torch.manual_seed(0)
    ours, x = LinearAlgebra(), torch.randn(2, 4, 4)
    theirs = copy.deepcopy(ours)
    with DtypeRecorder() as autocasts:
        with torch.autocast("cpu", torch.bfloat16):
            expected = theirs(x)
        expected.backward()
    run = run_through(front, ours, x, bf16)
    with CompiledCodeRecorder() as recorder:
        out = run(x)
        out.backward()
    assert lapack_kernels(recorder) == lapack_kernels(autocasts) and len(lapack_kernels(recorder)) >= 6
    assert all(set(dtypes) <= {torch.float32, torch.int32, torch.int64} for _, dtypes in lapack_kernels(recorder))
    assert low_and_fp32(recorder, ("baddbmm",)) == low_and_fp32(autocasts, ("baddbmm",)) == (1, 0)
    assert relative_error(out, expected) < 2e-2
    grads = [p.grad for p in (run.parameters() if front == "export" else ours.parameters())]
    for mine, want in zip(grads, theirs.parameters()):
        assert relative_error(mine, want.grad) < 5e-2


Operands = collections.namedtuple("Operands", "left right")


@pytest.mark.parametrize("operands", [list, tuple, lambda ts: Operands(*ts)], ids=["list", "tuple", "named-tuple"])
@pytest.mark.parametrize("call", [lambda ops: torch.einsum("ij,jk->ik", ops), torch.linalg.multi_dot],
                         ids=["einsum", "multi_dot"])
def test_a_white_op_given_its_operands_in_a_sequence_runs_low_as_under_torch_autocast(bf16, operands, call):
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    with DtypeRecorder() as autocasts, torch.autocast("cpu", torch.bfloat16):
        expected = call(operands([a, b]))
    with DtypeRecorder() as recorder, graphamp.auto_cast(bf16):
        out = call(operands([a, b]))
    assert decided_kernels(recorder, {"mm", "bmm"}) == decided_kernels(autocasts, {"mm", "bmm"})
    assert [dtypes for _, dtypes in decided_kernels(recorder, {"mm", "bmm"})] == [(torch.bfloat16, torch.bfloat16)]
    assert out.dtype == expected.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().sum().backward()
    assert a.grad is not None and b.grad is not None


@pytest.mark.parametrize("op, arguments", [(torch.layer_norm, {"normalized_shape": [8]}),
                                           (torch.group_norm, {"num_groups": 2})], ids=["layer_norm", "group_norm"])
def test_a_normalization_given_its_input_by_keyword_after_its_weight_casts_the_input_under_o2(bf16, op, arguments):
    x, w, b = (torch.randn(*shape, requires_grad=True) for shape in ((4, 8), (8,), (8,)))
    runs = []
    for first in ({"input": x}, {"weight": w, "bias": b}):  # the same call, the input's keyword first, then last
        with DtypeRecorder() as recorder, graphamp.auto_cast(bf16, level="O2"):
            out = op(**{**first, "input": x, "weight": w, "bias": b, **arguments})
        out.float().sum().backward()
        runs.append(([c.in_dtypes[:3] for c in recorder.calls_of(f"native_{op.__name__}")], out, x.grad, w.grad))
        x.grad = w.grad = b.grad = None
    (kernels, out, *grads), (kernels_weight_first, out_weight_first, *grads_weight_first) = runs
    assert kernels == kernels_weight_first == [(torch.bfloat16, torch.float32, torch.float32)]
    assert torch.equal(out, out_weight_first)
    assert all(torch.equal(g, h) for g, h in zip(grads, grads_weight_first))


def test_a_normalization_given_a_graphs_low_output_by_keyword_after_its_weight_decides_by_its_storage(bf16):
    head, w = graphamp.rewrite(nn.Linear(8, 8), amp_lists=bf16), torch.ones(8, requires_grad=True)
    runs = []
    with graphamp.auto_cast(bf16):
        h = head(torch.randn(4, 8))  # stored bfloat16, presented as float32
        for call in (lambda: torch.layer_norm(h, [8], w),
                     lambda: torch.layer_norm(weight=w, input=h, normalized_shape=[8])):
            with DtypeRecorder() as recorder:
                out = call()
            runs.append(([c.in_dtypes[:2] for c in recorder.calls_of("native_layer_norm")], out))
    assert runs[0][0] == runs[1][0] == [(torch.bfloat16, torch.float32)]
    assert torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("front", ["rewrite", "auto_cast"])
def test_an_unlisted_op_without_a_low_kernel_is_a_rewrite_error_saying_to_put_it_on_the_black_list(front, tmp_path):
    folder = write_list_folder(tmp_path, white="linear\n")  # fft_fftn on no list: it follows the linear's low output
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=folder)
    fix = r"Fix: keep it FP32 with custom_black_list=\['fft_fftn'\] \(or add it to black\.txt\)\.$"
    with pytest.raises(graphamp.RewriteError, match=r"fft_fftn.* cannot run on bfloat16 inputs.*" + fix):
        if front == "rewrite":
            graphamp.rewrite(FNetMixing(), (torch.randn(2, 8, 16),), amp_lists=lists)
        else:
            with graphamp.auto_cast(lists):
                FNetMixing()(torch.randn(2, 8, 16))


def test_auto_cast_disabled_runs_as_written(bf16):
    with DtypeRecorder() as recorder, graphamp.auto_cast(bf16, enabled=False):
        Head()(torch.randn(4, 16))
    assert low_and_fp32(recorder) == (0, 2)


def test_auto_cast_decorates_a_function_as_torch_autocast_does_and_each_call_trains_the_weights(bf16):
    torch.manual_seed(0)
    ours, theirs = Head(), Head()
    theirs.load_state_dict(ours.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, theirs)]
    x = torch.randn(4, 16)

    @graphamp.auto_cast(bf16)
    def our_loss():
        return ours(x).float().square().mean()

    @torch.autocast("cpu", torch.bfloat16)
    def their_loss():
        return theirs(x).float().square().mean()

    for _ in range(3):  # a step between calls: a cast kept from the last call would train on the old weights
        with DtypeRecorder() as recorder:
            loss = our_loss()
        assert low_and_fp32(recorder) == (2, 0)
        loss.backward()
        their_loss().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert our_loss.__name__ == "our_loss"
    for mine, reference in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(mine, reference)
    with DtypeRecorder() as recorder:
        ours(x)  # outside the decorated function: as written
    assert low_and_fp32(recorder) == (0, 2)


def test_auto_cast_disabled_inside_an_enabled_one_runs_as_written_as_torch_autocast_does(bf16):
    with graphamp.auto_cast(bf16), graphamp.auto_cast(bf16, enabled=False), DtypeRecorder() as recorder:
        Head()(torch.randn(4, 16))
    assert low_and_fp32(recorder) == (0, 2)


def test_a_policy_entered_again_inside_an_autocast_disabled_region_keeps_deciding_after_it(bf16):
    policy, model = graphamp.auto_cast(bf16), Head()
    with policy:
        with torch.autocast("cpu", enabled=False), policy:  # the same policy object, once more (a recursive call)
            pass
        with DtypeRecorder() as recorder:
            model(torch.randn(4, 16))
    assert low_and_fp32(recorder) == (2, 0)


def test_auto_cast_inside_torch_autocast_is_a_double_amp_error(bf16):
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(graphamp.DoubleAmpError, match="drop the torch.autocast"):
        with graphamp.auto_cast(bf16):
            pass


def test_torch_autocast_turned_on_inside_auto_cast_is_a_double_amp_error(bf16):
    with graphamp.auto_cast(bf16), pytest.raises(graphamp.DoubleAmpError, match="mixed_precision='no'"):
        with torch.autocast("cpu", torch.bfloat16):
            Head()(torch.randn(2, 16))


def test_plain_autocast_and_torch_compile_are_unchanged_beside_graphamp(bf16):
    def kernels(run):
        with CompiledCodeRecorder() as recorder:
            run()
        return [(c.op, c.in_dtypes) for c in recorder.calls if c.op == "addmm"]

    torch.manual_seed(0)
    model, x = Head(), torch.randn(4, 16)

    def under_autocast():
        with torch.autocast("cpu", torch.bfloat16):
            model(x)

    compiled = torch.compile(copy.deepcopy(model), backend="aot_eager")
    before = kernels(under_autocast), kernels(lambda: compiled(x))
    rewritten = graphamp.rewrite(copy.deepcopy(model), (x,), amp_lists=bf16)
    with graphamp.auto_cast(bf16):
        rewritten(x)
    assert (kernels(under_autocast), kernels(lambda: compiled(x))) == before
    assert {dtypes for _, dtypes in before[0]} == {(torch.bfloat16,) * 3}
    assert {dtypes for _, dtypes in before[1]} == {(torch.float32,) * 3}


# -- a rewritten model's code that dynamo runs itself follows the lists -------------------------------------------

class OutsideTheGraphs(nn.Module):
    """A graph break, and a method dynamo never traces: both run eagerly under torch.compile."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        return self.outside(torch.relu(self.second(h)))

    @torch.compiler.disable
    def outside(self, h):
        return self.third(h)


def test_code_between_graphs_and_skipped_code_run_low(bf16):
    torch.manual_seed(0)
    model, x = OutsideTheGraphs(), torch.randn(4, 16)
    with DtypeRecorder() as fp32:
        copy.deepcopy(model)(x).sum().backward()
    graphamp.rewrite(model, amp_lists=bf16)
    for _ in range(2):
        with CompiledCodeRecorder() as recorder:
            model(x).sum().backward()
        assert low_and_fp32(recorder) == (len(fp32.calls_of("addmm", "mm")), 0)


class ActivationOutsideTheGraphs(Head):
    """A GEMM's low output read by gray ops in code dynamo skips, then by a GEMM in the next graph."""

    def forward(self, x):
        return self.head(self.activation(self.body(x)))

    @torch.compiler.disable
    def activation(self, h):
        return torch.tanh(h) * 2


def steps_rewritten_and_under_auto_cast(model: nn.Module, x: torch.Tensor, amp_lists) -> tuple:
    """The kernels of one training step of the model rewritten and of its twin under auto_cast, whose gradients
    agree."""
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=amp_lists)
    with CompiledCodeRecorder() as ours:
        model(x).sum().backward()
    with CompiledCodeRecorder() as eager, graphamp.auto_cast(amp_lists):
        twin(x).sum().backward()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert relative_error(mine.grad, theirs.grad) < 2e-2
    return ours, eager


def test_skipped_code_decides_on_a_graphs_low_output_by_its_storage_as_without_the_graphs(bf16):
    torch.manual_seed(0)
    model, x = ActivationOutsideTheGraphs(), torch.randn(4, 16)
    ours, eager = steps_rewritten_and_under_auto_cast(model, x, bf16)
    for op in ("tanh", "tanh_backward"):
        assert [c.in_dtypes for c in ours.calls_of(op)] == [c.in_dtypes for c in eager.calls_of(op)], op
        assert {d for c in ours.calls_of(op) for d in c.in_dtypes} == {torch.bfloat16}, op
    assert ours.calls_of("mul")[0].in_dtypes == (torch.bfloat16,)


class JoinOutsideTheGraphs(nn.Module):
    """Two GEMMs' low outputs joined by gray ops in code dynamo skips, each taking them as it takes them: in a
    list, in a tuple, positionally."""

    def __init__(self, join):
        super().__init__()
        self.join_by = join
        self.left, self.right, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.join(self.left(x), self.right(x)))

    @torch.compiler.disable
    def join(self, a, b):
        return self.join_by(a, b)


@pytest.mark.parametrize("join", [
    lambda a, b: torch.cat([a, b], -1), lambda a, b: torch.cat((a, b), -1),
    lambda a, b: torch.stack([a, b], -1).flatten(-2), lambda a, b: torch.hstack([a, b])],
    ids=["cat-list", "cat-tuple", "stack", "hstack"])
def test_skipped_code_decides_on_low_outputs_in_a_list_by_their_storage_as_without_the_graphs(bf16, join):
    torch.manual_seed(0)
    model, x = JoinOutsideTheGraphs(join), torch.randn(4, 8)
    ours, eager = steps_rewritten_and_under_auto_cast(model, x, bf16)
    joined = {"cat", "stack"}
    assert decided_kernels(ours, joined) == decided_kernels(eager, joined)
    assert {dtypes for _, dtypes in decided_kernels(ours, joined)} == {(torch.bfloat16, torch.bfloat16)}


class CheckpointedBlock(nn.Module):
    """A block under torch.utils.checkpoint (non-reentrant, HF's default), with a graph break inside it when asked:
    dynamo then runs the checkpoint eagerly, and its region is rerun in backward."""

    def __init__(self, graph_break: bool):
        super().__init__()
        self.graph_break = graph_break
        self.block, self.head = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(checkpoint(self.region, x, use_reentrant=False))

    def region(self, x):
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.block(x)


@pytest.mark.parametrize("front_end", ["auto_cast", "rewrite"])
def test_a_checkpointed_region_is_recomputed_under_the_policy_it_ran_under(bf16, front_end):
    torch.manual_seed(0)
    model, x = CheckpointedBlock(graph_break=front_end == "rewrite"), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    if front_end == "rewrite":
        graphamp.rewrite(model, amp_lists=bf16)
        with CompiledCodeRecorder() as ours:
            model(x).sum().backward()
    else:
        with CompiledCodeRecorder() as ours:
            with graphamp.auto_cast(bf16):
                out = model(x)
            out.sum().backward()  # torch checks the recomputed values' dtypes against the saved ones
    with DtypeRecorder() as autocasts:
        with torch.autocast("cpu", torch.bfloat16):
            expected = twin(x)
        expected.sum().backward()
    # the forward's GEMMs, and the region's again, as far as torch's recomputation goes (it stops early)
    assert [c.in_dtypes for c in ours.calls_of("addmm")] == [c.in_dtypes for c in autocasts.calls_of("addmm")]
    assert {d for c in ours.calls_of("addmm") for d in c.in_dtypes} == {torch.bfloat16}
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert relative_error(mine.grad, theirs.grad) < 2e-2


class RaisesOnNegativeBatches(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.first(x)
        if bool((x.sum() < -100).item()):
            raise ValueError("a bad batch")
        return self.second(h)


def test_a_forward_that_raised_once_keeps_running_low(bf16):
    model = graphamp.rewrite(RaisesOnNegativeBatches(), amp_lists=bf16)
    model(torch.randn(4, 8))
    with pytest.raises(ValueError, match="a bad batch"):
        model(torch.full((4, 8), -10.0))
    for _ in range(3):
        with CompiledCodeRecorder() as recorder:
            model(torch.randn(4, 8))
        assert low_and_fp32(recorder) == (2, 0)


def test_a_rewritten_model_under_a_dispatch_mode_runs_low_and_keeps_its_graphs(bf16):
    model = graphamp.rewrite(Head(), (torch.randn(4, 16),), amp_lists=bf16)
    (graph,) = graphamp.rewritten_graphs(model)
    with FlopCounterMode(display=False) as flops:
        model(torch.randn(4, 16))
    assert flops.get_total_flops() > 0
    with DtypeRecorder() as recorder:  # a plain dispatch mode: dynamo would run the call eagerly
        model(torch.randn(4, 16))
    assert low_and_fp32(recorder) == (2, 0)
    runs = graph.runs
    model(torch.randn(4, 16))
    assert graph.runs == runs + 1  # dynamo did not mark the compiled code skipped


def test_calls_while_another_thread_compiles_run_low(bf16):
    model = graphamp.rewrite(Head(), (torch.randn(2, 16),), amp_lists=bf16, dynamic=False)
    done, failures = threading.Event(), []

    def caller():
        while not done.is_set():
            with CompiledCodeRecorder() as recorder:
                model(torch.randn(2, 16))
            if low_and_fp32(recorder)[1]:
                failures.append(recorder.calls_of("addmm"))

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        for batch in range(3, 9):  # each a new compile while the other thread calls
            model(torch.randn(batch, 16))
    finally:
        done.set()
        thread.join()
    assert failures == []


class Tagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, tag: str):
        return self.linear(x) * len(tag)


def test_calls_past_dynamos_recompile_limit_run_low_and_say_why_once(bf16):
    model = graphamp.rewrite(Tagged(), amp_lists=bf16)
    limit = torch._dynamo.config.recompile_limit
    with pytest.warns(UserWarning, match="ran none of graphamp's graphs") as caught:
        for length in range(limit + 3):  # a Python string argument: one graph per value
            with CompiledCodeRecorder() as recorder:
                model(torch.randn(2, 8), "x" * length)
            assert low_and_fp32(recorder) == (1, 0)
    eager = [str(w.message) for w in caught if "ran none of graphamp's graphs" in str(w.message)]
    assert len(eager) == 1 and "recompile_limit" in eager[0] and "dynamic=True" in eager[0]


def test_a_model_dynamo_compiles_no_graph_of_runs_low_and_the_warning_names_the_graph_break(bf16):
    """BatchNorm with momentum=None reads `float(num_batches_tracked)` inside nn.Sequential's loop: dynamo cannot
    resume there and runs every call eagerly, before any graph exists, so no recompile limit is involved."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=None), nn.Linear(16, 4))
    graphamp.rewrite(model, amp_lists=bf16)
    with pytest.warns(UserWarning, match="ran none of graphamp's graphs") as caught:
        with CompiledCodeRecorder() as recorder:
            model(torch.randn(4, 8))
    assert low_and_fp32(recorder) == (2, 0)
    eager = [str(w.message) for w in caught if "ran none of graphamp's graphs" in str(w.message)]
    assert len(eager) == 1 and "graph break" in eager[0] and "TORCH_LOGS=graph_breaks" in eager[0]
    assert "recompile_limit" not in eager[0]


@pytest.mark.parametrize("stance", ["force_eager", "eager_on_recompile"])
def test_a_call_under_a_forced_eager_stance_runs_low_and_the_warning_names_the_stance(bf16, stance):
    model = graphamp.rewrite(Head(), amp_lists=bf16)
    model(torch.randn(2, 16))  # one graph: eager_on_recompile runs a new shape eagerly
    with torch.compiler.set_stance(stance), pytest.warns(UserWarning, match="ran none of graphamp's graphs") as caught:
        with CompiledCodeRecorder() as recorder:
            model(torch.randn(3, 16))
    assert low_and_fp32(recorder) == (2, 0)
    eager = [str(w.message) for w in caught if "ran none of graphamp's graphs" in str(w.message)]
    assert len(eager) == 1 and f"set_stance({stance!r})" in eager[0] and "recompile_limit" not in eager[0]


def test_a_bare_backend_past_the_recompile_limit_runs_low_under_auto_cast(bf16):
    compiled = torch.compile(Head(), backend=graphamp.backend(bf16, inductor=False), dynamic=False)
    for batch in range(1, torch._dynamo.config.recompile_limit + 4):
        with CompiledCodeRecorder() as recorder, graphamp.auto_cast(bf16):
            compiled(torch.randn(batch, 16))
        assert low_and_fp32(recorder) == (2, 0)


# -- model.compile() and copies ------------------------------------------------------------------------------------

def test_model_compile_after_rewrite_keeps_graphamps_lists(bf16):
    lists = bf16.with_changes(black=["linear"])
    model = graphamp.rewrite(Head(), (torch.randn(4, 16),), amp_lists=lists)
    model.compile(backend="graphamp")
    model(torch.randn(4, 16))
    graph = graphamp.rewritten_graphs(model)[-1]
    assert graph.report.dtype == torch.bfloat16 and "inductor" in graph.timings
    sources = {mark_of(n).source for n in graph.graph_module.graph.nodes if mark_of(n) is not None}
    assert "custom_black_list" in sources


def test_model_compile_with_another_backend_after_rewrite_is_refused(bf16):
    model = graphamp.rewrite(Head(), amp_lists=bf16)
    with pytest.raises(graphamp.ArgumentError, match="model.compile\\(\\) or model.compile\\(mode=..."):
        model.compile(backend="aot_eager")
    with CompiledCodeRecorder() as recorder:
        model(torch.randn(4, 16))
    assert low_and_fp32(recorder) == (2, 0)


def test_a_shallow_copy_is_converted_on_its_own_and_shares_the_parameters(bf16):
    model = graphamp.rewrite(Head(), (torch.randn(4, 16),), amp_lists=bf16)
    twin = copy.copy(model)
    assert twin.body.weight is model.body.weight
    with CompiledCodeRecorder() as recorder:
        twin(torch.randn(4, 16))
    assert low_and_fp32(recorder) == (2, 0)
    twin_graphs = {id(graph) for graph in graphamp.rewritten_graphs(twin)}
    assert graphamp.is_rewritten(twin) and twin_graphs
    assert twin_graphs.isdisjoint(id(graph) for graph in graphamp.rewritten_graphs(model))  # graphs of its own
    with CompiledCodeRecorder() as recorder:
        model(torch.randn(4, 16))
    assert low_and_fp32(recorder) == (2, 0)


def test_by_name_a_black_module_pattern_matching_after_a_graph_break_is_not_reported_unmatched():
    import warnings

    model = Broken()
    compiled = torch.compile(model, backend="graphamp", options={
        "dtype": "bfloat16", "custom_black_modules": ["second"], "compile_threads": 1,
    })
    with warnings.catch_warnings(record=True) as caught, CompiledCodeRecorder() as recorder:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(torch.randn(4, 8))
    assert not [w for w in caught if "matches no module" in str(w.message)]
    dtypes = [c.in_dtypes[0] for c in recorder.calls_of("addmm")]
    assert dtypes == [torch.bfloat16, torch.float32] * 2


def test_auto_cast_writes_a_low_source_into_a_float32_buffer_in_the_buffers_dtype(bf16):
    """buffer.index_copy_(0, i, linear(x)): the kernel wants one dtype; the write keeps the buffer's, as eager's."""
    torch.manual_seed(0)
    linear, x = nn.Linear(8, 8), torch.randn(3, 8)
    buffer, index = torch.zeros(5, 8), torch.tensor([0, 2, 4])
    with graphamp.auto_cast(bf16):
        buffer.index_copy_(0, index, linear(x))
        buffer.index_add_(0, index, linear(x))
        buffer.index_put_((index,), linear(x), accumulate=True)
    with torch.autocast("cpu", torch.bfloat16):
        expected = linear(x).float()
    assert buffer.dtype == torch.float32
    torch.testing.assert_close(buffer[index], 3 * expected)


class GrowsACacheFromEmpty(nn.Module):
    """A cache begun empty in float32 (`torch.tensor([])`) and grown by `cat` with a GEMM's output."""

    def __init__(self):
        super().__init__()
        self.keys = nn.Linear(8, 8)

    def forward(self, x):
        return torch.cat([torch.tensor([]), self.keys(x).flatten()]).square().sum()


def test_an_empty_tensor_has_no_say_in_a_gray_ops_dtype_eagerly_as_in_the_graph(bf16):
    """It holds no values to keep in FP32: the cat runs in the GEMM's dtype under auto_cast and in the rewritten graph
    alike (where the FP32 trace froze HF's `torch.tensor([], dtype=keys.dtype)` as float32)."""
    torch.manual_seed(0)
    model, x = GrowsACacheFromEmpty(), torch.randn(4, 8)
    eager = copy.deepcopy(model)
    with DtypeRecorder() as by_policy, graphamp.auto_cast(bf16):
        eager(x)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    with CompiledCodeRecorder() as by_pass:
        model(x)
    assert [c.out_dtypes for c in by_policy.calls_of("cat")] == [c.out_dtypes for c in by_pass.calls_of("cat")] \
        == [(torch.bfloat16,)]


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: `1 + self.weight.float()`, where `.float()` of the FP32 weight is the weight itself."""

    def __init__(self, width=8):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class LinearThenOffsetNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), OffsetRMSNorm()

    def forward(self, x):
        return self.norm(self.fc(x)).sum()


def test_o2_keeps_a_norm_weight_read_through_a_no_op_float_in_fp32_eagerly_as_in_the_graph(bf16):
    torch.manual_seed(0)
    model, x = LinearThenOffsetNorm(), torch.randn(4, 8)
    eager = copy.deepcopy(model)
    with DtypeRecorder() as by_policy, graphamp.auto_cast(bf16, "O2", model=eager):
        eager(x)
    graphamp.rewrite(model, (x,), amp_lists=bf16, level="O2")
    with CompiledCodeRecorder() as by_pass:
        model(x)
    adds = [c.in_dtypes for c in by_pass.calls_of("add")]
    assert adds == [c.in_dtypes for c in by_policy.calls_of("add")]
    assert adds[-1] == (torch.float32,)  # 1.0 + the weight


@torch.library.custom_op("graphamp_eager_policy::accumulate_into", mutates_args=("total",))
def accumulate_into(total: torch.Tensor, values: torch.Tensor) -> None:
    total.add_(values)


@accumulate_into.register_fake
def _(total, values):
    return None


class AccumulatesWithACustomOp(nn.Module):
    """A torch.library op on the white list that writes its first argument (an FP32 statistics buffer)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("total", torch.zeros(4, 16))

    def forward(self, x):
        hidden = self.fc(x)
        accumulate_into(self.total, hidden.detach())
        return hidden


@pytest.mark.parametrize("front_end", ["auto_cast", "rewrite"])
def test_a_custom_op_keeps_the_tensor_it_writes_and_the_write_lands_as_under_autocast(front_end, seeded):
    """Its mutates_args are what it writes: never cast, as the cast pass leaves written inputs alone (a cast copy
    would take the write, and the buffer would stay zero)."""
    lists = graphamp.AutoMixedPrecisionLists(
        dtype="bfloat16", custom_white_list=["graphamp_eager_policy::accumulate_into"]
    )
    model, x = AccumulatesWithACustomOp(), torch.randn(4, 16)
    twin = copy.deepcopy(model)
    with torch.autocast("cpu", torch.bfloat16):
        twin(x)
    if front_end == "rewrite":
        graphamp.rewrite(model, amp_lists=lists)
    with graphamp.auto_cast(lists, model=model) if front_end == "auto_cast" else contextlib.nullcontext():
        model(x)
    assert model.total.dtype == torch.float32
    assert torch.equal(model.total, twin.total)
