"""A value the cast pass computed low leaves its graph low, presented as float32 (issue 39): the FP32 model's dtype for
the code after the call, autocast's bytes in memory. What the user's code reads is read upcast; what only moves or
reshapes it stays low; writes round into it; the next graph takes it low; export_program() keeps float32."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphamp
import models
from graphamp.inspection.activation_memory import saved_activation_bytes
from graphamp.inspection.recording import DtypeRecorder
from conftest import CompiledCodeRecorder
from training import relative_error


class Head(nn.Module):
    def __init__(self, classes=16):
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)))


class LossAfterABreak(Head):
    """The logits cross a graph break into the loss, as GPT-2's do in transformers 5 (its loss_function)."""

    def forward(self, x, y):
        logits = super().forward(x)
        torch._dynamo.graph_break()
        return F.cross_entropy(logits, y), logits


class KeepsItsLastHidden(Head):
    def forward(self, x):
        self.last_hidden = self.fc(x)
        return self.head(self.last_hidden)


@pytest.fixture
def head(bf16, seeded):
    model, x = Head(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    return model, twin, x


def test_a_low_output_is_float32_to_the_user_and_low_in_memory(head):
    model, _, x = head
    out = model(x)
    assert isinstance(out, graphamp.LowStorageTensor) and out.dtype == torch.float32
    stored = graphamp.stored_values(out)
    assert stored.dtype == torch.bfloat16 and stored.shape == out.shape
    assert torch.equal(out * 1, stored.float())
    assert graphamp.rewritten_graphs(model)[0].report.outputs_kept_low == [0]


def test_the_users_own_loss_reads_it_in_float32_and_trains_as_under_autocast(head):
    model, twin, x = head
    y = torch.randint(0, 16, (4,))
    out = model(x)
    with DtypeRecorder() as recorder:
        loss = F.cross_entropy(out, y)
    assert {c.in_dtypes[0] for c in recorder.calls_of("_log_softmax")} == {torch.float32}
    assert loss.item() == F.cross_entropy(graphamp.stored_values(out).float(), y).item()
    loss.backward()
    with torch.autocast("cpu", torch.bfloat16):
        F.cross_entropy(twin(x), y).backward()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert relative_error(mine.grad, theirs.grad) < 2e-2


def test_what_only_moves_or_reshapes_it_stays_low_and_casts_are_exact(head):
    model, _, x = head
    out = model(x)
    stored = graphamp.stored_values(out)
    for moved in (out[:, :3], out.detach(), out.t(), out.to("cpu"), out.clone(), out.reshape(-1), out.unsqueeze(0)):
        assert isinstance(moved, graphamp.LowStorageTensor) and moved.dtype == torch.float32
    low = out.to(torch.bfloat16)
    assert type(low) is torch.Tensor and torch.equal(low, stored)
    copied = out.to(dtype=torch.float32, copy=True)  # what HF generate does with the last logits
    assert type(copied) is torch.Tensor and torch.equal(copied, stored.float())
    assert out.float() is out  # already float32: torch returns the tensor itself


def test_a_write_into_it_rounds_into_its_storage_and_its_views_see_it(head):
    model, _, x = head
    with torch.no_grad():
        out = model(x)
        view = out[:, :2]
        expected = graphamp.stored_values(out).clone().add_(0.3).float()  # as into autocast's bfloat16 output
        out.add_(0.3)
    assert torch.equal(out * 1, expected)
    assert torch.equal(view * 1, expected[:, :2])


def test_an_op_writing_a_buffer_reads_it_upcast_also_inside_a_list(head):
    model, _, x = head
    with torch.no_grad():
        out = model(x)
        buffer = torch.empty(8, 16)
        torch.cat([out, out], out=buffer)  # the tensors to read are a list argument of a writing op
    assert torch.equal(buffer, graphamp.stored_values(out).float().repeat(2, 1))


def test_it_leaves_python_as_the_float32_tensor_it_presents(head):
    model, _, x = head
    out = model(x)
    plain = graphamp.stored_values(out).float()
    assert (out.detach().numpy() == plain.numpy()).all()
    assert out.tolist() == plain.tolist()
    assert out[0, 0].item() == plain[0, 0].item()
    assert "bfloat16" in repr(out)
    buffer = io.BytesIO()
    torch.save(out.detach(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert type(loaded) is torch.Tensor and loaded.dtype == torch.float32 and torch.equal(loaded, plain)
    assert torch.equal(copy.deepcopy(out.detach()) * 1, plain)


def test_a_value_crossing_a_graph_break_stays_low_and_the_next_graph_reads_it_as_float32(bf16, seeded):
    model, x, y = LossAfterABreak(), torch.randn(4, 8), torch.randint(0, 16, (4,))
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, (x, y), amp_lists=bf16)
    first, second = graphamp.rewritten_graphs(model)[:2]
    assert first.report.outputs_kept_low  # the logits leave the first graph low
    with CompiledCodeRecorder() as recorder:  # records what graphamp's graphs run (a plain mode: the eager policy)
        loss, logits = model(x, y)
        loss.backward()
    assert {c.in_dtypes[0] for c in recorder.calls_of("_log_softmax")} == {torch.float32}
    assert {c.out_dtypes[0] for c in recorder.calls_of("addmm")} == {torch.bfloat16}
    assert isinstance(logits, graphamp.LowStorageTensor)
    with torch.autocast("cpu", torch.bfloat16):
        twin(x, y)[0].backward()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert relative_error(mine.grad, theirs.grad) < 2e-2


class ActivationAfterABreak(Head):
    """A graph break between a GEMM and the gray ops that read its output."""

    def forward(self, x):
        hidden = self.fc(x)
        torch._dynamo.graph_break()
        return self.head(torch.tanh(hidden) * 2)


def test_gray_ops_after_a_graph_break_decide_on_the_low_value_as_without_the_break(bf16, seeded):
    model, x = ActivationAfterABreak(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    assert len(graphamp.rewritten_graphs(model)) == 2
    with CompiledCodeRecorder() as ours:
        model(x).square().mean().backward()
    with DtypeRecorder() as autocasts, torch.autocast("cpu", torch.bfloat16):
        twin(x).square().mean().backward()
    for op in ("tanh", "tanh_backward"):  # (the user's loss reads the output presented as float32: not compared)
        assert [c.in_dtypes for c in ours.calls_of(op)] == [c.in_dtypes for c in autocasts.calls_of(op)], op
        assert {d for c in ours.calls_of(op) for d in c.in_dtypes} == {torch.bfloat16}, op
    assert ours.calls_of("mul")[0].in_dtypes == (torch.bfloat16,)  # `tanh(hidden) * 2`, before the loss's ops
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert relative_error(mine.grad, theirs.grad) < 2e-2


class OnlyViewsBetweenBreaks(Head):
    """A graph that only views the low value from the graph before it, as BERT's after transformers' sdpa attention
    breaks the graph (its `output_attentions` warning): its output is a view of that graph's input."""

    def forward(self, x):
        hidden = self.fc(x)
        torch._dynamo.graph_break()
        heads = hidden.reshape(4, 2, 16).transpose(0, 1)
        torch._dynamo.graph_break()
        return self.head(heads.transpose(0, 1).reshape(4, 32))


@pytest.mark.parametrize("compile", [False, True])
def test_a_graph_that_only_views_a_low_input_passes_the_gradient_back_through_it(bf16, seeded, compile):
    model, x = OnlyViewsBetweenBreaks(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16, compile=compile)
    assert len(graphamp.rewritten_graphs(model)) == 3
    model(x).square().mean().backward()
    with torch.autocast("cpu", torch.bfloat16):
        twin(x).float().square().mean().backward()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert mine.grad is not None  # fc's was None: the middle graph's output had no gradient path
        assert relative_error(mine.grad, theirs.grad) < 2e-2


def test_it_saves_for_backward_no_more_than_autocast(bf16, seeded):
    model, x, y = LossAfterABreak(classes=512), torch.randn(64, 8), torch.randint(0, 512, (64,))
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, (x, y), amp_lists=bf16)

    def autocast_loss():
        with torch.autocast("cpu", torch.bfloat16):
            return twin(x, y)[0]

    mine = saved_activation_bytes(model, lambda: model(x, y)[0])
    assert mine <= saved_activation_bytes(twin, autocast_loss)


def test_the_model_called_on_its_own_output_takes_it_low_and_trains(bf16, seeded):
    class Square(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x)

    model, x = Square(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    model(model(x)).sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        twin(twin(x)).float().sum().backward()
    assert relative_error(model.fc.weight.grad, twin.fc.weight.grad) < 2e-2


def test_a_compiled_function_of_the_users_takes_it(head):
    model, _, x = head
    out = model(x)
    norm = torch.compile(lambda t: (t * t).sum(-1), backend="aot_eager", fullgraph=True)
    assert torch.equal(norm(out), (graphamp.stored_values(out).float() ** 2).sum(-1))


def test_what_the_model_keeps_on_itself_stays_float32_to_it(bf16, seeded):
    model, x = KeepsItsLastHidden(), torch.randn(4, 8)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    model(x)
    assert model.last_hidden.dtype == torch.float32


def test_export_program_returns_float32_tensors(bf16, seeded):
    program = graphamp.export_program(Head(), (torch.randn(4, 8),), amp_lists=bf16)
    out = program.module()(torch.randn(4, 8))
    assert type(out) is torch.Tensor and out.dtype == torch.float32


class StartsItsCacheEmpty(nn.Module):
    """A cache begun as `torch.tensor([], dtype=keys.dtype)` and grown by `cat`, as HF's DynamicCache does."""

    def __init__(self):
        super().__init__()
        self.keys = nn.Linear(8, 8)

    def forward(self, x):
        keys = self.keys(x)
        cache = torch.cat([torch.tensor([], dtype=keys.dtype), keys.flatten()])
        return cache, keys.sum()


def test_an_empty_tensor_does_not_promote_what_it_is_concatenated_with(bf16, seeded):
    """The FP32 trace froze the empty tensor's `dtype=keys.dtype` as float32; it holds no values to keep FP32, so the
    cache stays in the keys' dtype, as under autocast (a float32 cache would double its bytes)."""
    model, x = StartsItsCacheEmpty(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    with torch.autocast("cpu", torch.bfloat16):
        theirs, _ = twin(x)
    with CompiledCodeRecorder() as ours:
        mine, _ = model(x)
    assert graphamp.stored_values(mine).dtype == theirs.dtype == torch.bfloat16
    assert [c.out_dtypes for c in ours.calls_of("cat")] == [(torch.bfloat16,)]
    assert torch.equal(mine * 1, theirs.float())


def test_an_hf_decoders_kv_cache_in_training_is_stored_in_the_dtypes_autocast_gives(bf16, seeded):
    model = models.llama(num_hidden_layers=1)
    model.config.use_cache = True  # as a config built with the defaults has it: the forward returns the cache
    ids = models.token_batch()
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, (ids,), amp_lists=bf16)
    with torch.autocast("cpu", torch.bfloat16):
        theirs = twin(ids).past_key_values.layers[0]
    mine = model(ids).past_key_values.layers[0]
    assert theirs.values.dtype == torch.bfloat16
    for name in ("keys", "values"):
        assert graphamp.stored_values(getattr(mine, name)).dtype == getattr(theirs, name).dtype, name


class AttentionWithDropout(nn.Module):
    """Training-mode attention with dropout, as HF's GPT-2 and BERT have it by default: on a CPU, SDPA with dropout
    takes torch's math path, which computes in float32 inside from the low q, k and v."""

    def __init__(self, width=64, heads=4):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return self.out(attended.transpose(1, 2).flatten(2)).float().square().mean()


def test_compiled_it_saves_for_backward_no_more_than_autocast_and_compile(bf16, seeded):
    """Inductor's partitioner keeps the low q, k and v and recomputes their float32 copies in backward, as it does
    under autocast (where the math path's backward even runs low), instead of saving the float32 copies."""
    model, x = AttentionWithDropout(), torch.randn(4, 64, 64)
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16, compile=True)
    compiled = torch.compile(twin)

    def autocast_loss():
        with torch.autocast("cpu", torch.bfloat16):
            return compiled(x)

    autocast_loss().backward()  # compiled outside the measurement
    assert saved_activation_bytes(model, lambda: model(x)) <= saved_activation_bytes(twin, autocast_loss)


class TakesItsGradientFromTheSecond(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ignored, used):
        return used.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, grad


def test_no_gradient_reaching_it_runs_no_backward_as_in_eager(head):
    """A reader that gives it no gradient: as in eager code, the model's backward does not run and its parameters
    get no .grad (not float32 zeros the size of the output, cast down and sent through the whole graph)."""
    model, twin, x = head
    other = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        TakesItsGradientFromTheSecond.apply(twin(x), other).sum().backward()
    loss = TakesItsGradientFromTheSecond.apply(model(x), other).sum()
    with DtypeRecorder() as backward:
        loss.backward()
    assert [p.grad for p in model.parameters()] == [p.grad for p in twin.parameters()] == [None] * 4
    assert not backward.calls_of("zeros", "mm")


def allocated_bytes(run) -> int:
    """Bytes torch's CPU allocator hands out while `run()` runs (frees not subtracted)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    return sum(max(e.self_cpu_memory_usage, 0) for e in profiler.events())


def test_an_argmax_over_it_reads_the_stored_values_without_a_float32_copy(bf16, seeded):
    model, x = Head(classes=1024), torch.randn(64, 8)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    with torch.no_grad():
        out = model(x)  # an accuracy's logits, 128 KiB stored, 256 KiB as a float32 copy
    plain = graphamp.stored_values(out).float()
    for op, dims in ((torch.argmax, {"dim": -1}), (torch.argmin, {"dim": 0, "keepdim": True}), (torch.argmax, {})):
        indices = op(out, **dims)
        assert type(indices) is torch.Tensor and torch.equal(indices, op(plain, **dims))
        assert allocated_bytes(lambda: op(out, **dims)) <= indices.nbytes  # autocast's bytes: the indices only
    assert allocated_bytes(lambda: out.sum()) >= plain.nbytes  # a read that needs float32 still upcasts
