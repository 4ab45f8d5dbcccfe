"""The weight cache (opt-in: off by default): each weight cast once per optimizer step, recast whenever it changes
through the tensor (writes through `.data` are its documented limit)."""

import pytest
import torch
from torch import nn

import graphamp
import models
from graphamp.inspection.recording import DtypeRecorder

BF16 = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def mlp_batch(seed=0):
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))


def gpt2_and_batch():
    torch.manual_seed(0)
    ids = models.token_batch()
    return models.gpt2(), dict(input_ids=ids, labels=ids)


def train(model, batch, weight_cache, micro_batches, steps, make_optimizer=torch.optim.AdamW):
    """Parameters after `steps` optimizer steps of `micro_batches` accumulated backwards; casts of each step."""
    amp = graphamp.rewrite(model, example_kwargs=batch, amp_lists=BF16, weight_cache=weight_cache)
    optimizer = make_optimizer(model.parameters(), lr=1e-2)
    casts = []
    for _ in range(steps):
        with DtypeRecorder() as recorder:
            for _ in range(micro_batches):
                amp(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        casts.append(recorder.casts)
    return [p.detach().clone() for p in model.parameters()], casts, amp


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_each_weight_is_cast_once_per_optimizer_step(micro_batches):
    _, uncached, _ = train(*gpt2_and_batch(), False, micro_batches, steps=2)
    _, cached, amp = train(*gpt2_and_batch(), True, micro_batches, steps=2)
    weights = len(amp.captures[0].fed_weights)
    assert weights >= 17  # 2 blocks x 8 matrices and biases, and the tied embedding once
    # The steady step: the per-forward casts of every weight, N times, become one recast after the step.
    assert cached[-1] == uncached[-1] - (micro_batches - 1) * weights


def test_training_with_the_cache_equals_training_without_it_bitwise():
    cached, _, _ = train(*gpt2_and_batch(), True, micro_batches=2, steps=3)
    uncached, _, _ = train(*gpt2_and_batch(), False, micro_batches=2, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(cached, uncached))


def test_a_fused_optimizer_step_recasts_the_weights():
    # A fused step writes the weights without bumping their _version: the optimizer step hook must see it.
    fused = lambda params, lr: torch.optim.AdamW(params, lr=lr, fused=True)  # noqa: E731
    cached, _, _ = train(*gpt2_and_batch(), True, 2, 3, make_optimizer=fused)
    uncached, _, _ = train(*gpt2_and_batch(), False, 2, 3, make_optimizer=fused)
    assert all(torch.equal(a, b) for a, b in zip(cached, uncached))


def test_accumulated_gradients_reach_the_master_weights_in_fp32_as_without_the_cache():
    grads = {}
    for weight_cache in (True, False):
        model, batch = gpt2_and_batch()
        amp = graphamp.rewrite(model, example_kwargs=batch, amp_lists=BF16, weight_cache=weight_cache)
        for _ in range(3):
            amp(**batch).loss.backward()
        grads[weight_cache] = [p.grad for p in model.parameters()]
    assert all(g.dtype == torch.float32 for g in grads[True])
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def outputs_with_and_without_cache(change):
    """The cached module's output after `change(model)`, and a fresh uncached rewrite's on the same weights."""
    model, x = mlp(), mlp_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16, weight_cache=True)
    amp(x)  # the copies are made
    change(model)
    cached = amp(x)
    fresh = graphamp.rewrite(model, (x,), amp_lists=BF16, weight_cache=False)(x)
    return cached, fresh, amp


def double_under_no_grad(model):
    with torch.no_grad():
        model[0].weight.mul_(2)


def test_an_in_place_write_to_a_weight_is_seen():
    cached, fresh, _ = outputs_with_and_without_cache(double_under_no_grad)
    assert torch.equal(cached, fresh)


def test_load_state_dict_is_seen():
    other = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    cached, fresh, _ = outputs_with_and_without_cache(lambda model: model.load_state_dict(other.state_dict()))
    assert torch.equal(cached, fresh)


def test_replacing_a_weights_data_is_seen():
    def replace(model):
        model[2].weight.data = torch.randn(32, 32)

    cached, fresh, _ = outputs_with_and_without_cache(replace)
    assert torch.equal(cached, fresh)


def test_in_place_writes_through_data_are_not_seen_until_clear():
    # The documented limit: param.data has a version counter of its own, so nothing tells the cache.
    def write_through_data(model):
        model[0].weight.data.mul_(2)

    cached, fresh, amp = outputs_with_and_without_cache(write_through_data)
    assert not torch.equal(cached, fresh)
    amp.weight_cache.clear()
    assert torch.equal(amp(mlp_batch()), fresh)


def test_a_skipped_step_keeps_the_copies():
    model, x = mlp(), mlp_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16, weight_cache=True)
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), BF16, use_dynamic_loss_scaling=True)
    with DtypeRecorder() as warm:
        amp(x)  # the copies are made, then a warm forward casts only its input and output
    optimizer.minimize(amp(x).square().mean() * float("inf"))
    assert optimizer.found_inf
    with DtypeRecorder() as recorder:
        amp(x)
    assert recorder.casts == warm.casts - 6  # no weight was written, so none is recast


def test_an_optimizer_step_recasts_the_trained_weights_and_keeps_the_frozen_ones():
    model, x = mlp(), mlp_batch()
    model[0].requires_grad_(False)  # a frozen layer (a LoRA base, say): no optimizer can change it
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16, weight_cache=True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    amp(x).square().mean().backward()
    optimizer.step()
    with DtypeRecorder() as recorder:
        amp(x)
    assert recorder.casts == 2 + 4  # the input, the output and the two trained layers' weights and biases


def test_the_cache_holds_one_low_copy_per_cast_weight():
    model, x = mlp(), mlp_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16, weight_cache=True)
    amp(x)
    assert len(amp.weight_cache) == 6
    assert amp.weight_cache.nbytes == sum(p.numel() * 2 for p in model.parameters())


def test_copies_made_under_inference_mode_serve_training_afterwards():
    model, x = mlp(), mlp_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16, weight_cache=True)
    with torch.inference_mode():
        amp(x)
    amp(x).square().mean().backward()
    reference = mlp()
    graphamp.rewrite(reference, (x,), amp_lists=BF16, weight_cache=False)(x).square().mean().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))


def test_functional_call_with_other_tensors_casts_them_afresh():
    model, x = mlp(), mlp_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16, weight_cache=True)
    amp(x)
    doubled = {name: p.detach() * 2 for name, p in model.named_parameters()}
    ours = torch.func.functional_call(amp, doubled, (x,))
    uncached = graphamp.rewrite(mlp(), (x,), amp_lists=BF16, weight_cache=False)
    assert torch.equal(ours, torch.func.functional_call(uncached, doubled, (x,)))


def test_weight_cache_false_casts_inside_the_graph():
    model, x = mlp(), mlp_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16, weight_cache=False)
    assert amp.weight_cache is None
    assert amp.captures[0].fed_weights == []
    with DtypeRecorder() as first:
        amp(x)
    with DtypeRecorder() as second:
        amp(x)
    assert first.casts == second.casts == 6 + 2  # every weight, the input and the output, at each forward


def test_the_graph_shown_keeps_the_weight_casts():
    # export, the picture and the report show the cast pass's graph; only the graph that runs takes the copies.
    model, x = mlp(), mlp_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16, weight_cache=True)
    cast_op = torch.ops.aten._to_copy.default
    assert len(amp.graph_module.graph.find_nodes(op="call_function", target=cast_op)) == amp.report.casts_inserted


# -- on a GPU ------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_mlp_stepped_once():
    """An fp16-rewritten MLP on the GPU whose copies are stale: one forward made them, one step changed the weights."""
    model, x = mlp().cuda(), mlp_batch().cuda()
    amp = graphamp.rewrite(model, (x,), amp_lists=graphamp.AutoMixedPrecisionLists(dtype="float16"), weight_cache=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp(x).float().square().mean().backward()
    optimizer.step()
    return amp, x


@needs_cuda
def test_the_recast_makes_no_host_sync_on_cuda():
    amp, x = cuda_mlp_stepped_once()
    torch.cuda.set_sync_debug_mode("error")
    try:
        amp(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
def test_the_recast_takes_fewer_kernels_than_weights_on_cuda():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    amp, x = cuda_mlp_stepped_once()
    captured = amp.captures[0]
    lifted = [source.get() for source in captured.lifted]
    weights = [(lifted[i], dtype) for i, dtype in captured.fed_weights]
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        amp.weight_cache.casts_of(weights)
        torch.cuda.synchronize()
    kernels = [e for e in profiler.events() if e.device_type == DeviceType.CUDA]
    assert 0 < len(kernels) < len(weights)


@needs_cuda
def test_reduce_overhead_with_the_cache_trains_as_the_eager_rewrite_on_cuda():
    results = []
    for compile_mode, weight_cache in (("reduce-overhead", True), (None, False)):
        model, x = mlp().cuda(), mlp_batch().cuda()
        amp = graphamp.rewrite(
            model, (x,), amp_lists=BF16, weight_cache=weight_cache, compile=compile_mode is not None,
            compile_mode=compile_mode, progress=False,
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for _ in range(3):
            for _ in range(2):
                torch.compiler.cudagraph_mark_step_begin()
                amp(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-3, atol=1e-4)


def test_the_cache_is_off_by_default():
    model, x = mlp(), mlp_batch()
    amp = graphamp.rewrite(model, (x,), amp_lists=BF16)
    assert amp.weight_cache is None
    model[0].weight.data.mul_(2)  # the write the cache could not see
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(x).float()
    assert torch.allclose(amp(x), expected, rtol=2e-2, atol=1e-3)
