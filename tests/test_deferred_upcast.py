"""A large float32 output of a compiled training call is cast up from its low-precision value when first read.

Each behaviour is checked against the eager cast `low.to(torch.float32)` on the same values: what the caller can
observe (values, dtype, gradients, aliasing, copies) must be the same whether or not the cast was deferred.
"""

import copy
import pickle
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
import models
from graphamp import AutoMixedPrecisionLists
from graphamp.runtime import compiled as compiled_module
from graphamp.runtime.compiled import _fresh_outputs
from graphamp.runtime.deferred_upcast import DeferredUpcast, deferred_upcast

BF16 = AutoMixedPrecisionLists(dtype="bfloat16")
ALWAYS, NEVER = 0, float("inf")  # DEFERRED_CAST_MIN_BYTES: the tests' outputs are far below the real threshold


class CountedCast:
    """The cast a deferred output makes, counted."""

    def __init__(self):
        self.calls = 0

    def __call__(self, low):
        self.calls += 1
        return low.to(torch.float32)


def _pair(seed=0, shape=(4, 8)):
    """(deferred output, eager cast, the counted cast, the two low-precision leaves they came from)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(*shape, generator=generator).to(torch.bfloat16)
    low, reference_low = values.clone().requires_grad_(), values.clone().requires_grad_()
    cast = CountedCast()
    deferred = deferred_upcast(low * 3, torch.float32, cast)
    return deferred, (reference_low * 3).to(torch.float32), cast, (low, reference_low)


def _metadata(t):
    return t.dtype, t.shape, t.stride(), t.device, t.requires_grad, t.is_leaf, t.dim(), len(t), t.numel()


def test_reading_only_metadata_makes_no_cast():
    deferred, eager, cast, _ = _pair()
    assert _metadata(deferred) == _metadata(eager)
    assert deferred.is_contiguous() and deferred.is_floating_point() and deferred.element_size() == 4
    assert cast.calls == 0 and type(deferred) is DeferredUpcast


def test_the_first_read_swaps_the_eager_cast_into_the_same_object():
    deferred, eager, cast, _ = _pair()
    identity = id(deferred)
    total = deferred.sum()
    assert type(deferred) is torch.Tensor and id(deferred) == identity
    assert torch.equal(deferred, eager) and torch.equal(total, eager.sum())
    assert cast.calls == 1  # once, however often it is read afterwards


@pytest.mark.parametrize(
    "loss_of",
    [
        lambda t: t.sum() * 2,
        lambda t: F.cross_entropy(t, torch.tensor([0, 3, 5, 7])),
        lambda t: t.mul_(2).square().mean(),  # written in place first
        lambda t: t[1:].log_softmax(-1).mean(),  # through a view
    ],
    ids=["sum", "cross_entropy", "in_place", "view"],
)
def test_gradients_are_the_eager_cast_s(loss_of):
    deferred, eager, _, (low, reference_low) = _pair()
    loss_of(deferred).backward()
    loss_of(eager).backward()
    assert low.grad.dtype == torch.bfloat16 and torch.equal(low.grad, reference_low.grad)


@pytest.mark.parametrize("read_under", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_first_read_under_no_grad_keeps_the_training_output_s_history(read_under):
    """A metric computed first (under no_grad) must not cut the loss computed after it from the graph."""
    deferred, eager, _, (low, reference_low) = _pair()
    with read_under():
        assert torch.equal(deferred.argmax(-1), eager.argmax(-1))
    assert not deferred.is_inference() and deferred.grad_fn is not None
    deferred.square().sum().backward()
    eager.square().sum().backward()
    assert torch.equal(low.grad, reference_low.grad)


def test_a_write_through_a_view_reaches_the_output():
    deferred, eager, _, _ = _pair()
    for tensor in (deferred, eager):
        view = tensor[0]
        with torch.no_grad():
            view.zero_()
    assert torch.equal(deferred, eager) and deferred[0].abs().sum() == 0


class _CloneInputs(torch.autograd.Function):
    """DDP's _DDPSink pattern: a Function whose forward reads its inputs while torch holds them."""

    @staticmethod
    def forward(ctx, *inputs):
        return tuple(t.clone() for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        return grads


@pytest.mark.parametrize("held_by", ["autograd_function", "weakref"])
def test_an_output_torch_holds_keeps_its_cast_and_behaves_the_same(held_by):
    """Where the swap cannot be made, the cast is kept inside and every op reads it: same values, gradients, writes."""
    deferred, eager, cast, (low, reference_low) = _pair()
    if held_by == "weakref":
        reference = weakref.ref(deferred)
        result, expected = deferred * 1, eager * 1
    else:
        (result,), (expected,) = _CloneInputs.apply(deferred), _CloneInputs.apply(eager)
    assert type(deferred) is DeferredUpcast and cast.calls == 1
    with torch.no_grad():
        deferred[0] = 5.0
        eager[0] = 5.0
    assert torch.equal(deferred, eager) and cast.calls == 1
    (result.sum() + deferred.square().sum()).backward()
    (expected.sum() + eager.square().sum()).backward()
    assert torch.equal(low.grad, reference_low.grad)
    if held_by == "weakref":
        assert reference() is deferred


@pytest.mark.parametrize(
    "copy_of",
    [
        lambda t: t.detach().numpy(),
        lambda t: np.asarray(t.detach()),
        lambda t: copy.deepcopy(t.detach()),
        lambda t: pickle.loads(pickle.dumps(t.detach())),
        lambda t: t.tolist(),
    ],
    ids=["numpy", "asarray", "deepcopy", "pickle", "tolist"],
)
def test_copies_and_conversions_are_those_of_the_eager_cast(copy_of):
    deferred, eager, _, _ = _pair()
    assert np.array_equal(np.asarray(copy_of(deferred)), np.asarray(copy_of(eager)))


def test_torch_save_and_repr_read_the_values(tmp_path):
    deferred, eager, _, _ = _pair()
    assert repr(deferred) == repr(eager)  # grad_fn too: the eager cast's ToCopyBackward0
    deferred, eager, _, _ = _pair()
    torch.save(deferred.detach(), tmp_path / "t.pt")
    assert torch.equal(torch.load(tmp_path / "t.pt"), eager)


def test_a_torch_compiled_function_reads_it():
    deferred, eager, _, (low, reference_low) = _pair()
    function = torch.compile(lambda t: F.log_softmax(t, -1).mean(), backend="aot_eager")
    loss, expected = function(deferred), function(eager)
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    assert torch.equal(low.grad, reference_low.grad)


# ----------------------------------------------------------------------------------- in a compiled AmpModule


class LanguageHead(nn.Module):
    """HF's shape with a size of its own: the loss is computed inside from `logits.float()`, logits are returned."""

    VOCAB = 131

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 24)
        self.body = nn.Linear(24, 24)
        self.head = nn.Linear(24, self.VOCAB)

    def forward(self, tokens, labels):
        logits = self.head(torch.relu(self.body(self.embed(tokens))))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()), logits


def _tokens():
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, LanguageHead.VOCAB, (5, 7), generator=generator) for _ in range(2))


@pytest.fixture(scope="module")
def compiled_head():
    torch.manual_seed(0)
    model = LanguageHead()
    return model, graphamp.rewrite(model, _tokens(), amp_lists=BF16, compile=True, progress=False)


def _step(model, amp, threshold, monkeypatch, read_logits=None):
    """One forward and backward of the loss with deferral on (threshold 0) or off; the gradients and the outputs."""
    monkeypatch.setattr(compiled_module, "DEFERRED_CAST_MIN_BYTES", threshold)
    model.zero_grad(set_to_none=True)
    loss, logits = amp(*_tokens())
    extra = read_logits(logits) if read_logits is not None else 0
    (loss + extra).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, loss.detach(), logits


def test_unread_logits_are_never_cast_and_the_gradients_are_unchanged(compiled_head, monkeypatch):
    model, amp = compiled_head
    deferred_grads, deferred_loss, logits = _step(model, amp, ALWAYS, monkeypatch)
    assert type(logits) is DeferredUpcast
    assert logits.dtype == torch.float32 and logits.shape == (5, 7, LanguageHead.VOCAB)
    eager_grads, eager_loss, eager_logits = _step(model, amp, NEVER, monkeypatch)
    assert type(eager_logits) is torch.Tensor
    assert torch.equal(deferred_loss, eager_loss)
    assert all(torch.equal(deferred_grads[name], eager_grads[name]) for name in eager_grads)
    assert torch.equal(logits, eager_logits)  # read after the backward: the same float32 values


def test_logits_read_by_a_loss_outside_give_the_eager_cast_s_gradients(compiled_head, monkeypatch):
    """A second loss term on the returned logits (a distillation term, a z-loss) after the graph's own loss."""
    model, amp = compiled_head
    extra = lambda logits: 1e-2 * torch.logsumexp(logits, -1).square().mean()  # noqa: E731
    deferred_grads, _, logits = _step(model, amp, ALWAYS, monkeypatch, read_logits=extra)
    assert type(logits) is torch.Tensor  # read: swapped for the eager cast
    eager_grads, _, _ = _step(model, amp, NEVER, monkeypatch, read_logits=extra)
    assert all(torch.equal(deferred_grads[name], eager_grads[name]) for name in eager_grads)


def _float32_allocations_of(step, numel: int) -> int:
    """How many float32 buffers of `numel` elements the step allocates (torch.profiler's allocation events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    sizes = [event.nbytes() for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    return sum(size == numel * 4 for size in sizes)  # frees are negative


def test_a_step_that_only_reads_the_loss_allocates_no_float32_logits(compiled_head, monkeypatch):
    """What autocast's step allocates: the logits exist in bfloat16 only, as the loss saved them."""
    model, amp = compiled_head
    numel = 5 * 7 * LanguageHead.VOCAB
    _step(model, amp, ALWAYS, monkeypatch)  # compiled, forward and backward, before counting

    def two_steps_holding_the_logits():  # held: the second cast cannot reuse the first one's storage
        held = []
        for _ in range(2):
            loss, logits = amp(*_tokens())
            held.append(logits)
            loss.backward()

    assert _float32_allocations_of(two_steps_holding_the_logits, numel) == 0
    monkeypatch.setattr(compiled_module, "DEFERRED_CAST_MIN_BYTES", NEVER)
    assert _float32_allocations_of(two_steps_holding_the_logits, numel) >= 1  # the check sees a cast that is made


def test_calls_without_gradients_and_small_outputs_cast_at_once(compiled_head, monkeypatch):
    model, amp = compiled_head
    monkeypatch.setattr(compiled_module, "DEFERRED_CAST_MIN_BYTES", ALWAYS)
    with torch.no_grad():
        assert type(amp(*_tokens())[1]) is torch.Tensor
    monkeypatch.setattr(compiled_module, "DEFERRED_CAST_MIN_BYTES", 5 * 7 * LanguageHead.VOCAB * 4 + 1)
    assert type(amp(*_tokens())[1]) is torch.Tensor


def test_float16_loss_scaling_in_the_graph_with_deferred_outputs_matches_it_without(monkeypatch):
    """decorate() scales the gradient entering the outputs in the graph: a Function reads the outputs in its forward
    (the cast is then made at once and kept), and the gradients are those without deferral."""
    lists = AutoMixedPrecisionLists(dtype="float16")
    grads = []
    for threshold in (ALWAYS, NEVER):
        torch.manual_seed(0)
        model = LanguageHead()
        amp = graphamp.rewrite(model, _tokens(), amp_lists=lists, compile=True, progress=False)
        optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.0), lists, init_loss_scaling=2.0**8)
        monkeypatch.setattr(compiled_module, "DEFERRED_CAST_MIN_BYTES", threshold)
        assert optimizer is not None  # linked: the gradient entering the outputs is scaled in the graph
        loss, logits = amp(*_tokens())
        (loss + 1e-2 * logits.square().mean()).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[1])


@pytest.mark.parametrize("weakly_referenced", [False, True], ids=["swapped", "kept"])
def test_an_output_fed_to_another_amp_module_is_read_as_its_float32_values(
    compiled_head, monkeypatch, weakly_referenced
):
    model, amp = compiled_head
    torch.manual_seed(1)
    follower_model = nn.Linear(LanguageHead.VOCAB, 3)
    example = (torch.randn(5, 7, LanguageHead.VOCAB),)
    follower = graphamp.rewrite(follower_model, example, amp_lists=BF16, compile=True, progress=False)
    results = []
    for threshold in (ALWAYS, NEVER):
        monkeypatch.setattr(compiled_module, "DEFERRED_CAST_MIN_BYTES", threshold)
        model.zero_grad(set_to_none=True)
        follower_model.zero_grad(set_to_none=True)
        loss, logits = amp(*_tokens())
        reference = weakref.ref(logits) if weakly_referenced else None
        out = follower(logits)
        (loss + out.square().mean()).backward()
        grads = {name: p.grad.clone() for name, p in [*model.named_parameters(), *follower_model.named_parameters()]}
        results.append((out.detach(), grads))
        del reference
    (deferred_out, deferred_grads), (eager_out, eager_grads) = results
    assert torch.equal(deferred_out, eager_out)
    assert all(torch.equal(deferred_grads[name], eager_grads[name]) for name in eager_grads)


def test_only_outputs_computed_into_storage_of_their_own_may_wait():
    """An output cast up from an input, or from a view of one, could be written by the caller before it is read."""
    graph = torch.fx.Graph()
    aten = torch.ops.aten
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 4, dtype=torch.bfloat16)

    def op(target, *args, **kwargs):
        node = graph.call_function(target, args, kwargs)
        node.meta["val"] = target(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args), **kwargs)
        return node

    transposed = op(aten.t.default, x)
    product = op(aten.mm.default, x, x)
    first_half = graph.call_function(__import__("operator").getitem, (op(aten.split.Tensor, product, 2), 0))
    first_half.meta["val"] = product.meta["val"][:2]
    casts = [op(aten._to_copy.default, value, dtype=torch.float32) for value in (transposed, product, first_half, x)]
    graph.output(tuple(casts))
    assert _fresh_outputs(torch.fx.GraphModule(nn.Module(), graph)) == {1, 2}


def test_under_cuda_graph_modes_outputs_are_cast_at_once(monkeypatch):
    """A CUDA graph's next replay writes over its last outputs: the low value cannot wait for a read there."""
    torch.manual_seed(0)
    amp = graphamp.rewrite(
        LanguageHead(), _tokens(), amp_lists=BF16, compile=True, compile_mode="reduce-overhead", progress=False
    )
    monkeypatch.setattr(compiled_module, "DEFERRED_CAST_MIN_BYTES", ALWAYS)
    loss, logits = amp(*_tokens())
    assert type(logits) is torch.Tensor and logits.dtype == torch.float32
    assert not amp.captures[-1].run.deferrable


def test_hf_trainer_on_a_compiled_amp_module_trains_as_without_deferred_casts(tmp_path, monkeypatch):
    """The Trainer reads `outputs["loss"]` and never the logits: each step's loss is the same either way."""
    transformers = pytest.importorskip("transformers")

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, index):
            ids = torch.randint(1, models.VOCAB, (16,), generator=torch.Generator().manual_seed(index))
            return {"input_ids": ids, "labels": ids}

    created = []
    monkeypatch.setattr(compiled_module, "deferred_upcast", lambda *a: created.append(1) or deferred_upcast(*a))
    runs = []
    for threshold in (ALWAYS, NEVER):
        monkeypatch.setattr(compiled_module, "DEFERRED_CAST_MIN_BYTES", threshold)
        torch.manual_seed(0)
        example = {k: v.repeat(2, 1) for k, v in Tokens()[0].items()}
        example["num_items_in_batch"] = torch.tensor(32.0)
        amp = graphamp.rewrite(models.llama(), example_kwargs=example, amp_lists=BF16, compile=True, progress=False)
        losses = []

        class Losses(transformers.TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                losses.extend([logs["loss"]] if logs and "loss" in logs else [])

        arguments = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(threshold)), max_steps=3, per_device_train_batch_size=2, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=1e-3,
        )
        transformers.Trainer(model=amp, args=arguments, train_dataset=Tokens(), callbacks=[Losses()]).train()
        runs.append(losses)
    assert len(created) >= 3  # every training step's logits waited (the first run)
    assert len(runs[0]) == 3 and runs[0] == runs[1]
