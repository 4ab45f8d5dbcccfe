"""Copies of a rewritten model (copy.deepcopy for an EMA, pickle, torch.save/torch.load) give the original's
outputs, own their parameters, and stay converted: they compile graphs of their own, in mixed precision."""

import copy

import pytest
import torch

import graphamp
from models import TwoLayer, gpt2, token_batch
from training import COPIES, matmul_dtypes

# graphamp's warnings that code ran eagerly, in float32, outside its graphs: none may pass unless a test expects it.
pytestmark = pytest.mark.filterwarnings("error:graphamp. :UserWarning")



@pytest.fixture(scope="module")
def rewritten_gpt2():
    """A rewritten GPT-2 that the tests copy and call but never change, and its batch."""
    torch.manual_seed(0)
    ids = token_batch()
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
    return graphamp.rewrite(gpt2(n_layer=1, n_embd=32), (), {"input_ids": ids}, amp_lists=lists), ids


@pytest.mark.parametrize("make_copy", COPIES.values(), ids=COPIES.keys())
def test_copy_gives_the_same_logits_and_stays_converted(rewritten_gpt2, make_copy):
    model, ids = rewritten_gpt2
    twin = make_copy(model)
    assert type(twin) is type(model)
    with torch.no_grad():
        assert torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    assert matmul_dtypes(twin) and set(matmul_dtypes(twin)) == {torch.bfloat16}  # its own graphs, low
    assert graphamp.rewritten_graphs(twin)[0] not in graphamp.rewritten_graphs(model)


@pytest.mark.parametrize("make_copy", COPIES.values(), ids=COPIES.keys())
def test_copy_owns_its_parameters(rewritten_gpt2, make_copy):
    model, _ = rewritten_gpt2
    twin = make_copy(model)
    assert not {id(p) for p in model.parameters()} & {id(p) for p in twin.parameters()}


def test_training_the_deepcopy_leaves_the_original_alone(rewritten_gpt2):
    model, ids = rewritten_gpt2
    ema = copy.deepcopy(model)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for parameter in ema.parameters():
            parameter.mul_(0.5)
        assert not torch.equal(ema(input_ids=ids).logits, before)
        assert torch.equal(model(input_ids=ids).logits, before)


def test_a_hooked_model_copies_and_its_hooks_run_on_the_copy(bf16):
    torch.manual_seed(0)
    model, x = TwoLayer(), torch.randn(8, 16)
    calls = []
    model.fc1.register_forward_hook(lambda module, args, output: calls.append(module))
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    copied = copy.deepcopy(model)
    calls.clear()
    copied(x), model(x)
    assert calls == [copied.fc1, model.fc1]


@pytest.mark.parametrize("make_copy", COPIES.values(), ids=COPIES.keys())
def test_a_copys_compile_is_graphamps_and_keeps_the_lists(bf16, make_copy):
    """Unpickling restored torch's nn.Module.compile on the copy (a bound method is pickled by name, and was looked
    up before the copy was converted): compile(backend=...) then replaced graphamp's call, and the model ran FP32."""
    from conftest import CompiledCodeRecorder

    torch.manual_seed(0)
    model, x = TwoLayer(), torch.randn(8, 16)
    twin = make_copy(graphamp.rewrite(model, amp_lists=bf16))
    with pytest.raises(graphamp.ArgumentError, match="compiles graphamp's graphs with inductor"):
        twin.compile(backend="aot_eager")
    with CompiledCodeRecorder() as recorder:
        twin(x)
    gemm_dtypes = {call.in_dtypes[0] for call in recorder.calls_of("addmm", "mm")}
    assert gemm_dtypes == {torch.bfloat16}
