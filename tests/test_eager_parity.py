"""With default settings a rewritten model gives eager autocast's results wherever the user writes to the model
between calls: EMA weights copied in and out through `.data`, in-place `.data` edits (clamping, pruning),
`param.data = t`, submodules swapped for new ones (even where Python reuses the old one's id()), threads calling
while another compiles, torch.compile around the rewritten model, peft's merge after training, and a forward a
trainer patches onto the model."""

import copy
import threading
import types

import pytest
import torch
from torch import nn

import graphamp
from conftest import CompiledCodeRecorder
from graphamp.inspection.recording import floating
from models import TwoLayer
from training import relative_error


def model_and_batch(seed=0):
    torch.manual_seed(seed)
    return TwoLayer(), torch.randn(8, 16)


def autocast_output(model, x):
    """torch.autocast's output of the model's own forward on its current weights and submodules, run eagerly (the
    rewritten model's call refuses an outer autocast)."""
    with torch.autocast("cpu", torch.bfloat16):
        return type(model).forward(model, x).float()


def train_step(amp, optimizer, x):
    amp(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_ema_store_copy_to_restore_cycles_give_eagers_outputs(bf16):
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ema = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        train_step(amp, optimizer, x)
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.5).add_(p.detach(), alpha=0.5)
        stored = [p.data.clone() for p in model.parameters()]  # store
        for e, p in zip(ema, model.parameters()):  # copy_to: evaluate with the EMA weights
            p.data.copy_(e)
        assert relative_error(amp(x), autocast_output(model, x)) < 3e-2
        for s, p in zip(stored, model.parameters()):  # restore, keep training
            p.data.copy_(s)
        assert relative_error(amp(x), autocast_output(model, x)) < 3e-2


@pytest.mark.parametrize("edit", ["clamp", "mul", "assign"])
def test_writes_through_data_between_forwards_give_eagers_outputs(bf16, edit):
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    for _ in range(2):
        amp(x)
        for p in model.parameters():
            if edit == "clamp":
                p.data.clamp_(-0.05, 0.05)
            elif edit == "mul":
                p.data.mul_(-1.5)
            else:
                p.data = p.data * 2
        assert relative_error(amp(x), autocast_output(model, x)) < 3e-2


class WithActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_a_swapped_in_submodule_is_used_even_at_the_old_ones_address(bf16):
    torch.manual_seed(0)
    model, x = WithActivation(), torch.randn(8, 16)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    for activation in (nn.Tanh, nn.ReLU, nn.Sigmoid, nn.ReLU, nn.Tanh, nn.GELU):
        del model.act  # a module with no tensors dies here: CPython often builds the next one at its address
        model.act = activation()
        assert relative_error(amp(x), autocast_output(model, x)) < 3e-2


def test_threads_calling_while_another_compiles_never_see_fake_parameters(bf16):
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16, dynamic=False)  # each new batch size is a compile
    parameters = list(model.parameters())
    batches = {n: torch.randn(n, 16, generator=torch.Generator().manual_seed(n)) for n in (3, 5, 7, 9, 8, 6)}
    outputs, errors = {}, []

    def call(batch_size):
        try:
            outputs[batch_size] = amp(batches[batch_size])
        except Exception as error:  # noqa: BLE001 - reported below, with the thread's batch size
            errors.append((batch_size, error))

    # The threads only call the rewritten model: a fake mode is process-wide while dynamo traces, so eager work in
    # other threads at that moment is outside what any lock can guard.
    threads = [threading.Thread(target=call, args=(n,)) for n in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert all(a is b for a, b in zip(model.parameters(), parameters))
    assert not any(type(p.data).__name__ == "FakeTensor" for p in model.parameters())
    for n, batch in batches.items():
        assert relative_error(outputs[n], autocast_output(model, batch)) < 3e-2


EXPORTING_SEEN_WHILE_LOWERING = []


@torch.library.custom_op("graphamp_eager_parity::noted", mutates_args=())
def noted(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@noted.register_fake
def _(x):
    EXPORTING_SEEN_WHILE_LOWERING.append(torch.compiler.is_exporting())
    return torch.empty_like(x)


def test_compiling_a_graph_without_a_vmap_leaves_torchs_process_wide_exporting_flag_down(bf16):
    """torch.compiler.is_exporting() is one flag for the whole process: while it is up, every other thread's calls of
    a rewritten model took the export path (the FP32 code, without the model's lock) and raced in torch's own
    torch.compiler.disable wrapper (KeyError: 'custom'). graphamp raises it only to lower a graph with a vmap."""
    class Noting(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return noted(self.linear(x))

    EXPORTING_SEEN_WHILE_LOWERING.clear()
    graphamp.rewrite(Noting(), (torch.randn(2, 8),), amp_lists=bf16)
    assert EXPORTING_SEEN_WHILE_LOWERING and not any(EXPORTING_SEEN_WHILE_LOWERING)


class WaitsWhileExported(nn.Module):
    """A model whose forward, traced by torch.export in another thread, holds the export open until released."""

    def __init__(self):
        super().__init__()
        self.linear, self.entered, self.release = nn.Linear(4, 4), threading.Event(), threading.Event()

    def forward(self, x):
        self.entered.set()
        self.release.wait(timeout=60)
        return self.linear(x)


def test_a_torch_export_in_another_thread_leaves_a_rewritten_models_calls_low(bf16):
    """torch.compiler.is_exporting() is up for the whole process while any thread exports: the export path (the model's
    FP32 code) is for the thread that exports, not for a training thread that calls meanwhile, and the export goes on."""
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    exported, programs = WaitsWhileExported(), []
    exporter = threading.Thread(target=lambda: programs.append(torch.export.export(exported, (torch.randn(2, 4),))))
    exporter.start()
    try:
        assert exported.entered.wait(timeout=60) and torch.compiler.is_exporting()
        with CompiledCodeRecorder() as recorder:
            amp(x).sum().backward()
        with graphamp.auto_cast(bf16):  # the policy's first look at these ops asks torch outside this thread's modes
            torch.cumsum(torch.randn(3, dtype=torch.float64), 0).bfloat16().atan2(torch.randn(3))
    finally:
        exported.release.set()
        exporter.join()
    gemms = recorder.calls_of("addmm", "mm")
    assert gemms and all(floating(call.in_dtypes) == {torch.bfloat16} for call in gemms)
    assert len(programs) == 1  # the export finished: its tracer's modes stayed on torch's process-wide stack


def test_torch_compile_around_a_rewritten_model_trains_and_takes_new_shapes(bf16):
    """An outer torch.compile (a trainer's torch_compile=True) reaches the rewritten model's own compiled call."""
    model, x = model_and_batch()
    reference = copy.deepcopy(model)
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    compiled = torch.compile(amp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in (x, x, x[:5]):
        with CompiledCodeRecorder() as recorder:
            compiled(batch).square().mean().backward()
        assert floating(recorder.calls_of("addmm")[0].in_dtypes) == {torch.bfloat16}
        optimizer.step()
        optimizer.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            reference(batch).float().square().mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert relative_error(p, q) < 3e-2


def test_peft_merge_and_unload_after_training_gives_the_merged_models_outputs(bf16):
    peft = pytest.importorskip("peft")
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)  # the base model first, then the adapters
    lora = peft.get_peft_model(amp, peft.LoraConfig(r=4, target_modules=["fc1", "fc2"], init_lora_weights=False))
    optimizer = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        train_step(lora, optimizer, x)
    before = lora(x)
    merged = lora.merge_and_unload()
    assert merged is amp
    assert relative_error(merged(x), autocast_output(merged, x)) < 3e-2
    assert relative_error(before, autocast_output(merged, x)) < 3e-2


def test_a_forward_a_trainer_patches_onto_the_rewritten_model_runs_in_mixed_precision(bf16):
    """torch.compile traces whatever `forward` the model has when called: a patched one is rewritten too."""
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)

    def trainer_forward(self, x):  # a trainer's patch: runs the submodules itself
        return self.fc2(torch.relu(self.fc1(x))) * 2

    amp.forward = types.MethodType(trainer_forward, amp)
    with CompiledCodeRecorder() as recorder:
        out = amp(x)
    gemms = recorder.calls_of("addmm")
    assert len(gemms) == 2 and all(floating(call.in_dtypes) == {torch.bfloat16} for call in gemms)
    assert relative_error(out, 2 * autocast_output(model, x)) < 3e-2


def test_a_forward_wrapper_that_calls_the_models_forward_runs_silently(bf16, recwarn):
    model, x = model_and_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=bf16)
    inner = amp.forward

    def to_fp32(*args, **kwargs):  # accelerate's convert_outputs_to_fp32 does this
        return inner(*args, **kwargs).float()

    amp.forward = to_fp32
    assert relative_error(amp(x), autocast_output(model, x)) < 3e-2
    assert not [w for w in recwarn if "graphamp" in str(w.message)]
