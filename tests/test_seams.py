"""Under torch.compile graphamp never silently loses mixed precision or gradients (issue 32): custom autograd
Functions keep their backward, RNNs and scans are captured, calls dynamo runs eagerly are reported, an outer
autocast is refused, module patterns mean the model's own paths, and torch.compile's own arguments arrive."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

import graphamp
from conftest import CompiledCodeRecorder
from graphamp.frontends.rewrite import TORCH_ISOLATES_RECOMPILES
from graphamp.inspection.recording import DtypeRecorder, floating, recording_inside
from graphamp.passes.marks import mark_of
from encoder_models import ENCODERS, shallow_mobilevit
from models import VOCAB, Broken, bert, deberta_v2, gpt2, llama, token_batch

pytestmark = pytest.mark.filterwarnings("ignore:this CPU has no native bfloat16")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- the outside models: every gradient present and close to autocast's ------------------------------------------

def bloom():
    config = tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4, use_cache=False)
    return tf.BloomForCausalLM(config)  # its GELU is a custom torch.autograd.Function


def mamba():
    config = tf.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=1, expand=2,
                            conv_kernel=4, use_cache=False)
    return tf.MambaForCausalLM(config)  # under dynamo transformers scans with associative_scan


class Recurrent(nn.Module):
    """A token model around nn.LSTM or nn.GRU, modules dynamo runs eagerly unless told to trace them."""

    def __init__(self, kind):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = kind(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.head(self.rnn(self.embed(input_ids))[0])
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _decoder(build):
    ids = token_batch()
    return build(), {"input_ids": ids, "labels": ids}


# One layer where it saves time (GPT-2's, Llama's, Mamba's scan, DeBERTa's, BERT's and Bloom's layers; MobileViT's
# first block of each stage): a model's seams are the same in every layer.
OUTSIDE_MODELS = {
    **ENCODERS,
    "mobilevit": shallow_mobilevit,
    "gpt2": lambda: _decoder(lambda: gpt2(n_layer=1)),
    "llama": lambda: _decoder(lambda: llama(num_hidden_layers=1)),
    "bert": lambda: (bert(num_hidden_layers=1), {"input_ids": token_batch(), "labels": torch.tensor([0, 2])}),
    "deberta_v2": lambda: (
        deberta_v2(num_hidden_layers=1), {"input_ids": token_batch(), "labels": torch.tensor([1, 0])}
    ),
    "bloom": lambda: _decoder(bloom),
    "mamba": lambda: _decoder(mamba),
    "lstm": lambda: _decoder(lambda: Recurrent(nn.LSTM)),
    "gru": lambda: _decoder(lambda: Recurrent(nn.GRU)),
}
# oneDNN has no bfloat16 RNN kernel for torch.autocast on a CPU without AVX512-BF16: the reference is FP32 there.
RNN_MODELS = ("lstm", "gru")


def loss_of(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output.loss if getattr(output, "loss", None) is not None else output.logits.float().square().mean()


def gradients_after_one_step(model, batch, autocast: bool) -> dict[str, torch.Tensor | None]:
    torch.manual_seed(1)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = loss_of(model(**batch))
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", OUTSIDE_MODELS)
def test_an_outside_model_trains_with_every_gradient_present_and_close_to_autocasts(bf16, name):
    torch.manual_seed(0)
    model, batch = OUTSIDE_MODELS[name]()
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (), batch, amp_lists=bf16)
    graphamp_grads = gradients_after_one_step(model, batch, autocast=False)
    expected = gradients_after_one_step(reference, batch, autocast=name not in RNN_MODELS)
    missing = [n for n, g in graphamp_grads.items() if g is None and expected[n] is not None]
    assert missing == []
    largest = max(g.norm() for g in expected.values() if g is not None)
    for parameter, grad in graphamp_grads.items():
        want = expected[parameter]
        if want is None:
            continue
        assert grad.dtype == torch.float32
        # A gradient that is zero in exact arithmetic (a key bias under softmax) is rounding noise in both runs.
        scale = torch.maximum(want.norm(), 1e-4 * largest)
        assert (grad - want).norm() / scale < 0.1, parameter


# -- custom autograd Functions keep their backward ----------------------------------------------------------------

class RoundStraightThrough(torch.autograd.Function):
    """Rounds in forward; passes the gradient straight through in backward (what the ops alone would give is 0)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class QuantizedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.down(RoundStraightThrough.apply(self.up(x)))


@pytest.mark.parametrize("front_end", ["rewrite", "rewrite+inductor", "backend"])
def test_a_custom_autograd_function_keeps_its_own_backward(bf16, front_end):
    torch.manual_seed(0)
    model, x = QuantizedMLP(), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    if front_end.startswith("rewrite"):
        compiled = graphamp.rewrite(model, (x,), amp_lists=bf16, compile=front_end.endswith("inductor"))
    else:
        compiled = torch.compile(model, backend=graphamp.backend(bf16, inductor=False))
    compiled(x).square().mean().backward()
    with torch.autocast("cpu", torch.bfloat16):
        expected = reference(x).square().mean()
    expected.backward()
    assert model.up.weight.grad is not None and model.up.weight.grad.abs().sum() > 0  # through the straight-through
    for parameter, want in zip(model.parameters(), reference.parameters()):
        assert (parameter.grad - want.grad).norm() / want.grad.norm() < 0.05


def test_a_custom_autograd_function_is_one_node_with_its_bodies_cast_by_the_lists(bf16):
    model = graphamp.rewrite(QuantizedMLP(), (torch.randn(8, 16),), amp_lists=bf16)
    (graph,) = graphamp.rewritten_graphs(model)
    applies = [n for n in graph.graph_module.graph.nodes if "autograd_function_apply" in str(n.target)]
    assert len(applies) == 1
    linears = [n for n in graph.graph_module.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert [n.meta["val"].dtype for n in linears] == [torch.bfloat16, torch.bfloat16]


class TanhGelu(torch.autograd.Function):
    """BLOOM's GELU: gray ops only, and a backward of its own that reads the saved input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class GeluMLP(QuantizedMLP):
    def forward(self, x):
        return self.down(TanhGelu.apply(self.up(x)))


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_a_custom_autograd_functions_body_runs_in_the_dtype_of_the_operands_it_gets_as_under_autocast(bf16, inductor):
    """Its low operand goes in low, as eager code under autocast passes it: the gray ops of the forward and of its
    own backward run low (FP32 there would be silent FP32 work and FP32 saved activations)."""
    torch.manual_seed(0)
    model, x = GeluMLP(), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16, compile=inductor)
    (graph,) = graphamp.rewritten_graphs(model)
    (apply,) = [n for n in graph.graph_module.graph.nodes if "autograd_function_apply" in str(n.target)]
    for body in (getattr(graph.graph_module, body.target) for body in apply.args[:2]):  # forward, backward
        tanh = body.graph.find_nodes(op="call_function", target=torch.ops.aten.tanh.default)
        assert [n.meta["val"].dtype for n in tanh] == [torch.bfloat16]
    with CompiledCodeRecorder() as ours:
        model(x).square().mean().backward()
    with CompiledCodeRecorder() as autocasts:
        with torch.autocast("cpu", torch.bfloat16):
            expected = reference(x).square().mean()
        expected.backward()
    if not inductor:  # inductor fuses the body's ops into kernels of its own
        assert [c.in_dtypes for c in ours.calls_of("tanh")] == [c.in_dtypes for c in autocasts.calls_of("tanh")]
        assert len(ours.calls_of("tanh")) == 2
    for parameter, want in zip(model.parameters(), reference.parameters()):
        assert (parameter.grad - want.grad).norm() / want.grad.norm() < 0.02


# -- RNNs are captured, their matmuls low ------------------------------------------------------------------------

@pytest.mark.parametrize("kind, op", [(nn.LSTM, torch.ops.aten.lstm.input), (nn.GRU, torch.ops.aten.gru.input)])
def test_lstm_and_gru_run_their_matmuls_low(bf16, kind, op):
    ids = token_batch()
    model = graphamp.rewrite(Recurrent(kind), (), {"input_ids": ids, "labels": ids}, amp_lists=bf16)
    (graph,) = graphamp.rewritten_graphs(model)
    (rnn,) = graph.graph_module.graph.find_nodes(op="call_function", target=op)
    assert mark_of(rnn).decision == "white"
    assert rnn.args[0].meta["val"].dtype == torch.bfloat16
    head = graph.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
    assert [n.meta["val"].dtype for n in head] == [torch.bfloat16]


# -- what dynamo runs itself is reported -------------------------------------------------------------------------

def graphamp_warnings(run) -> list[str]:
    """The messages of graphamp's own warnings while `run()` runs, each occurrence kept."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "graphamp:" in str(w.message)]


class TwoPaths(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 2)

    @torch.compiler.disable
    def outside(self, h):
        return self.out(h)

    def forward(self, x):
        return self.outside(torch.relu(self.inp(x)))


def test_a_model_whose_white_ops_all_run_in_graphs_gets_no_report(bf16):
    model = graphamp.rewrite(QuantizedMLP(), amp_lists=bf16)
    assert not graphamp_warnings(lambda: [model(torch.randn(4, 16)) for _ in range(3)])


def test_more_models_of_a_class_with_a_graph_break_than_the_recompile_limit_all_run_low(bf16):
    models = [graphamp.rewrite(Broken(), amp_lists=bf16) for _ in range(torch._dynamo.config.recompile_limit + 2)]
    for model in models:
        with CompiledCodeRecorder() as recorder:
            model(torch.randn(4, 8))
        # in graphs (each model its own cache, torch >= 2.13) or past the shared limit under the eager policy
        assert [c.in_dtypes[0] for c in recorder.calls_of("addmm")] == [torch.bfloat16] * 2
    if TORCH_ISOLATES_RECOMPILES:  # each model its own cache: every one runs both layers in its graphs
        assert all(len(linear_dtypes(graphamp.rewritten_graphs(m))) == 2 for m in models)


# -- an outer torch.autocast is refused ----------------------------------------------------------------------------

def test_an_outer_autocast_around_a_rewritten_model_is_a_double_amp_error(bf16):
    model = graphamp.rewrite(QuantizedMLP(), (torch.randn(4, 16),), amp_lists=bf16)
    with pytest.raises(graphamp.DoubleAmpError, match="Accelerator\\(mixed_precision='no'\\)"):
        with torch.autocast("cpu", torch.bfloat16):
            model(torch.randn(4, 16))


def test_an_outer_autocast_around_a_compiled_model_is_refused_at_compile(bf16):
    compiled = torch.compile(QuantizedMLP(), backend=graphamp.backend(bf16, inductor=False))
    with pytest.raises(Exception, match="two AMP systems are on") as caught:
        with torch.autocast("cpu", torch.bfloat16):
            compiled(torch.randn(4, 16))
    chain = [caught.value, caught.value.__cause__, getattr(caught.value, "inner_exception", None)]
    assert any(isinstance(error, graphamp.DoubleAmpError) for error in chain)


# -- module patterns mean the model's own paths ----------------------------------------------------------------------

def linear_dtypes(graphs) -> dict[str, torch.dtype]:
    return {
        mark_of(node).module: node.meta["val"].dtype
        for graph in graphs for node in graph.graph_module.graph.nodes
        if node.target in (torch.ops.aten.linear.default, torch.ops.aten.addmm.default)
    }


class Wrapper(nn.Module):
    """A framework's wrapper (DDP's shape): the user's model is its `module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_black_module_patterns_match_through_a_framework_wrapper(bf16):
    amp_backend = graphamp.backend(bf16.with_changes(black_modules=["down"]), inductor=False)
    torch.compile(Wrapper(QuantizedMLP()), backend=amp_backend)(torch.randn(4, 16))
    assert linear_dtypes(amp_backend.graphs) == {"up": torch.bfloat16, "down": torch.float32}


def test_black_module_patterns_match_on_a_compiled_hf_model(bf16):
    amp_backend = graphamp.backend(bf16.with_changes(black_modules=["lm_head"]), inductor=False)
    torch.compile(gpt2(), backend=amp_backend)(input_ids=token_batch())
    dtypes = linear_dtypes(amp_backend.graphs)
    assert dtypes["lm_head"] == torch.float32
    assert {d for path, d in dtypes.items() if path != "lm_head"} == {torch.bfloat16}


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(QuantizedMLP() for _ in range(2))

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


def test_black_module_patterns_match_model_paths_when_blocks_compile_one_at_a_time(bf16):
    model = Blocks()
    amp_backend = graphamp.backend(bf16.with_changes(black_modules=["layers.*.up"]), inductor=False, model=model)
    for layer in model.layers:
        layer.compile(backend=amp_backend)
    model(torch.randn(4, 16))
    assert linear_dtypes(amp_backend.graphs) == {"layers.0.up": torch.float32, "layers.0.down": torch.bfloat16}


def test_twin_blocks_sharing_a_graph_but_decided_apart_are_an_error_not_the_wrong_dtypes(bf16):
    model = Blocks()
    amp_backend = graphamp.backend(bf16.with_changes(black_modules=["layers.1.up"]), inductor=False, model=model)
    for layer in model.layers:
        layer.compile(backend=amp_backend)
    with pytest.raises(Exception, match="reuses the graph it compiled for 'layers.0.up' for 'layers.1.up'"):
        model(torch.randn(4, 16))


def test_a_pattern_that_matches_no_module_warns_under_the_backend(bf16):
    amp_backend = graphamp.backend(bf16.with_changes(black_modules=["dwon"]), inductor=False)
    compiled = torch.compile(QuantizedMLP(), backend=amp_backend)
    with pytest.warns(UserWarning, match="'dwon' matches no module.*closest module paths: down"):
        for _ in range(2):
            compiled(torch.randn(4, 16))


def test_a_pattern_that_matches_no_module_warns_at_rewrite(bf16):
    with pytest.warns(UserWarning, match="'dwon' matches no module of QuantizedMLP"):
        graphamp.rewrite(QuantizedMLP(), amp_lists=bf16.with_changes(black_modules=["dwon"]))


class SharedUnderTwoNames(nn.Module):
    """`shared` registered as `a` and as `b` (named_modules() lists it once, as `a`); forward calls it as `b`."""

    def __init__(self, shared: nn.Module, head: nn.Module):
        super().__init__()
        self.a = shared
        self.b = self.a
        self.head = head

    def forward(self, x):
        return self.head(self.b(x))


class TiedEmbedding(nn.Module):
    """Weight tying shares a Parameter, not a module: the head is a module of its own."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids):
        return self.head(self.embed(input_ids).relu())


def matmul_dtypes(front_end: str, model: nn.Module, x: torch.Tensor, lists) -> list[set]:
    """The floating input dtypes of each matmul kernel the model's forward ran under `front_end`, in order."""
    recorder = CompiledCodeRecorder() if front_end == "rewrite" else DtypeRecorder()
    if front_end == "rewrite":
        graphamp.rewrite(model, amp_lists=lists)
        with recorder:
            model(x)
    elif front_end == "export":
        program = graphamp.export_program(model, (x,), amp_lists=lists)
        with recorder:
            program.module()(x)
    elif front_end == "backend":  # a plain recorder around the call would make dynamo run it eagerly
        amp_backend = graphamp.backend(lists, inductor=False, model=model)
        torch.compile(model, backend=recording_inside(amp_backend, recorder))(x)
    else:
        with recorder, graphamp.auto_cast(lists, model=model):
            model(x)
    return [floating(call.in_dtypes) for call in recorder.calls_of("addmm", "mm")]


ALIAS_FRONT_ENDS = ["rewrite", "export", "backend", "auto_cast"]


@pytest.mark.parametrize("front_end", ALIAS_FRONT_ENDS)
@pytest.mark.parametrize("pattern", ["a", "b"])
def test_a_module_shared_under_two_names_is_kept_fp32_by_either_name(bf16, front_end, pattern):
    model, lists = SharedUnderTwoNames(nn.Linear(16, 8), nn.Linear(8, 4)), bf16.with_changes(black_modules=[pattern])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*matches no module")  # the pattern names a module of the model
        dtypes = matmul_dtypes(front_end, model, torch.randn(2, 16), lists)
    assert dtypes == [{torch.float32}, {torch.bfloat16}]  # the shared Linear, then the head


@pytest.mark.parametrize("front_end", ALIAS_FRONT_ENDS)
def test_a_pattern_under_one_name_of_a_shared_block_keeps_its_submodules_fp32(bf16, front_end):
    block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    lists = bf16.with_changes(black_modules=["a.*"])
    dtypes = matmul_dtypes(front_end, SharedUnderTwoNames(block, nn.Linear(16, 4)), torch.randn(2, 16), lists)
    assert dtypes == [{torch.float32}, {torch.float32}, {torch.bfloat16}]  # b.0 and b.2, then the head


@pytest.mark.parametrize("front_end", ALIAS_FRONT_ENDS)
def test_a_black_embedding_leaves_the_head_tied_to_its_weight_low(bf16, front_end):
    lists = bf16.with_changes(black_modules=["embed"])
    assert matmul_dtypes(front_end, TiedEmbedding(), token_batch(), lists) == [{torch.bfloat16}]


# -- torch.compile's own arguments arrive --------------------------------------------------------------------------

@pytest.fixture
def inductor_configs(monkeypatch):
    """The config patches each graph reaches inductor with (inductor itself is not run)."""
    import torch._inductor.compile_fx as inductor

    seen = []

    def compile_fx(graph_module, example_inputs, config_patches=None, **kwargs):
        seen.append(config_patches)
        return graph_module

    monkeypatch.setattr(inductor, "compile_fx", compile_fx)
    return seen


@pytest.mark.parametrize("how, expected", [
    ({"mode": "max-autotune-no-cudagraphs"}, {"max_autotune": True, "coordinate_descent_tuning": True}),
    ({"options": {"epilogue_fusion": False}}, {"epilogue_fusion": False}),
])
def test_torch_compiles_mode_and_options_reach_inductor(bf16, inductor_configs, how, expected):
    torch.compile(QuantizedMLP(), backend=graphamp.backend(bf16), **how)(torch.randn(4, 16))
    assert inductor_configs == [expected]


def test_rewrites_mode_and_options_reach_inductor(bf16, inductor_configs):
    graphamp.rewrite(QuantizedMLP(), (torch.randn(4, 16),), amp_lists=bf16, compile=True, mode="max-autotune")
    assert inductor_configs[0]["max_autotune"] is True


def compile_error(compiled) -> Exception:
    """The error inside dynamo's BackendCompilerFailed at the first call of `compiled`."""
    with pytest.raises(Exception) as caught:
        compiled(torch.randn(4, 16))
    return getattr(caught.value, "inner_exception", caught.value)


@pytest.mark.parametrize("by_name", [True, False], ids=["by-name", "graphamp.backend"])
def test_an_unknown_inductor_option_is_refused_before_the_graph_is_lowered(bf16, by_name):
    amp_backend = graphamp.backend(bf16)
    compiled = torch.compile(QuantizedMLP(), backend="graphamp" if by_name else amp_backend, options={"nonsense_opt": 1})

    error = compile_error(compiled)

    assert isinstance(error, graphamp.ArgumentError)
    assert ("torch.compile(options=...) got 'nonsense_opt', which is not one of inductor's options "
            "(torch._inductor.list_options()); drop it.") in str(error)
    assert amp_backend.graphs == []


def test_backend_by_name_refuses_amp_lists_with_a_dtype_it_would_ignore(bf16):
    error = compile_error(torch.compile(QuantizedMLP(), backend="graphamp", options={"amp_lists": bf16,
                                                                                    "dtype": "float16"}))

    assert isinstance(error, graphamp.ArgumentError)
    assert ("got amp_lists and dtype, which amp_lists already holds: dtype would be ignored. Pass one: "
            "amp_lists=graphamp.AutoMixedPrecisionLists(..., dtype=...), or the keys without amp_lists") in str(error)


def test_backend_by_name_runs_mixed_precision_in_a_process_that_never_imports_graphamp():
    code = (
        "import sys, torch\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))\n"
        "x = torch.randn(16, 64)\n"
        "out = torch.compile(model, backend='graphamp', options={'dtype': 'bfloat16'})(x)\n"
        "with torch.autocast('cpu', torch.bfloat16):\n"
        "    autocast = model(x).float()\n"
        "fp32 = model(x)\n"
        "print(out.dtype, float((out - autocast).abs().max()), float((out - fp32).abs().max()))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    dtype, from_autocast, from_fp32 = result.stdout.split()[-3:]
    assert dtype == "torch.float32"
    assert float(from_fp32) > 1e-4  # bfloat16 rounding shows: it did not run float32 ...
    assert float(from_autocast) < float(from_fp32)  # ... and it ran as close to autocast's bfloat16 as to anything


# -- the optimizer link: messages that name the fix, copies that save ---------------------------------------------

def test_a_model_compiled_with_a_backend_but_never_linked_names_link_optimizer(fp16):
    model = QuantizedMLP()
    compiled = torch.compile(model, backend=graphamp.backend(fp16, inductor=False))
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16)
    compiled(torch.randn(4, 16)).square().mean().backward()
    with pytest.raises(graphamp.LossScalingError, match="link_optimizer\\(optimizer\\).*one optimizer per backend"):
        optimizer.step()


def test_a_linked_compiled_model_pickles_and_saves(fp16):
    model = QuantizedMLP()
    amp_backend = graphamp.backend(fp16, inductor=False)
    compiled = torch.compile(model, backend=amp_backend)
    amp_backend.link_optimizer(graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), fp16))
    x = torch.randn(4, 16)
    expected = compiled(x)
    buffer = io.BytesIO()
    torch.save(compiled, buffer)
    buffer.seek(0)
    for copied in (pickle.loads(pickle.dumps(compiled)), torch.load(buffer, weights_only=False)):
        assert torch.equal(copied(x), expected)


def test_a_global_module_hook_registered_after_the_first_call_runs(bf16):
    """Dynamo guards no global hook its graphs did not see: the model compiles anew when one comes."""
    model = graphamp.rewrite(QuantizedMLP(), (torch.randn(4, 16),), amp_lists=bf16)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: seen.append(module))
    try:
        model(torch.randn(4, 16))
    finally:
        handle.remove()
    assert model in seen and model.up in seen
    seen.clear()
    model(torch.randn(4, 16))
    assert seen == []


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = QuantizedMLP()
        self.tail = nn.Linear(4, 4)

    def forward(self, x):
        return self.tail(self.child(x))


def outer_backend(compiled_graphs: list):
    def compile_graph(graph_module, example_inputs):
        compiled_graphs.append(graph_module)
        return graph_module
    return compile_graph


def test_another_torch_compile_around_a_rewritten_model_leaves_its_graphs_to_graphamp(bf16):
    """A Trainer's or Lightning's torch.compile over the rewritten model must not recompile it without the casts."""
    model = graphamp.rewrite(QuantizedMLP(), amp_lists=bf16)
    others = []
    compiled = torch.compile(model, backend=outer_backend(others))
    for _ in range(2):
        compiled(torch.randn(4, 16))
    (graph,) = graphamp.rewritten_graphs(model)
    assert graph.runs == 2 and others == []


def test_a_rewritten_submodule_of_a_model_compiled_otherwise_keeps_its_mixed_precision(bf16):
    model = Parent()
    graphamp.rewrite(model.child, amp_lists=bf16)
    others = []
    torch.compile(model, backend=outer_backend(others))(torch.randn(4, 16))
    (graph,) = graphamp.rewritten_graphs(model.child)
    assert graph.runs == 1
    assert linear_dtypes([graph]) == {"up": torch.bfloat16, "down": torch.bfloat16}
    outer_ops = {str(node.target) for gm in others for node in gm.graph.nodes if node.op == "call_function"}
    assert "<built-in function linear>" in outer_ops and len(others) == 1  # only the parent's tail


class Refine(nn.Module):
    """A torch while_loop: dynamo keeps it a higher-order op with a condition and a body sub-graph."""

    def __init__(self):
        super().__init__()
        self.inp, self.step, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        def body(i, h):
            return i + 1, torch.tanh(self.step(h))

        _, h = while_loop(lambda i, h: i < 3, body, (torch.zeros((), dtype=torch.int64), self.inp(x)))
        return self.out(h)


def test_a_while_loops_body_runs_its_matmuls_low_and_gives_autocasts_output(bf16):
    torch.manual_seed(0)
    model, x = Refine(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    graphamp.rewrite(model, (x,), amp_lists=bf16)
    with torch.no_grad():
        out = model(x)
        with torch.autocast("cpu", torch.bfloat16):
            expected = reference(x).float()
    graph = graphamp.rewritten_graphs(model)[-1]  # the call under no_grad's
    bodies = [m for name, m in graph.graph_module.named_children() if "body" in name]
    assert [n.meta["val"].dtype for body in bodies for n in body.graph.nodes
            if n.target == torch.ops.aten.linear.default] == [torch.bfloat16]
    assert out.dtype == torch.float32 and (out - expected).abs().max() < 2e-2
