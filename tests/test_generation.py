"""`model.generate()` on a rewritten HF decoder is HF's own generate(), each forward (the prompt, then each new
token) running graphamp's graphs: autocast's greedy tokens, the matmuls low, a bounded number of graphs for any
prompt length, and a DynamicCache passed in updated in place as by the eager model."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch.fx import GraphModule

import graphamp
from models import VOCAB, gpt2, token_batch

MATMULS = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul"}
# graphamp's warnings that code ran eagerly, in float32, outside its graphs: none may pass unless a test expects it.
pytestmark = pytest.mark.filterwarnings("error:graphamp. :UserWarning")


def llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        use_cache=False,  # generate() turns the cache on
    )
    return LlamaForCausalLM(config)


def greedy(model, ids, new_tokens=6, **kwargs):
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0, **kwargs)


def autocast_greedy(model, ids, new_tokens=6, **kwargs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return greedy(model, ids, new_tokens, **kwargs)


def graph_runs(model) -> list[int]:
    return [graph.runs for graph in graphamp.rewritten_graphs(model)]


def matmul_dtypes_of(graphs) -> list[torch.dtype]:
    return [
        node.meta["val"].dtype
        for graph in graphs
        for module in graph.graph_module.modules() if isinstance(module, GraphModule)
        for node in module.graph.nodes if getattr(node.target, "_opname", None) in MATMULS
    ]


def rewritten_decoder(model):
    """(`model` rewritten in eval mode, its FP32 twin copied before rewrite), after one generation. A test that
    edits the model makes the same edit to the twin, so that the pair stays comparable for the next test.

    Each fixture's tests stay under dynamo's recompile limit (8 graphs per model): past it, a call would run eagerly
    in float32 (graphamp warns). The prefill and two decode graphs (one static, then one dynamic) count three."""
    twin = copy.deepcopy(model.eval())
    graphamp.rewrite(model, amp_lists=graphamp.AutoMixedPrecisionLists(dtype="bfloat16"))
    greedy(model, token_batch(1, 8, seed=3))  # compiles the prefill and the decode steps
    return model, twin


@pytest.fixture(scope="module")
def llama_decoder():
    torch.manual_seed(0)
    return rewritten_decoder(llama(layers=1))


@pytest.fixture(scope="module")
def gpt2_decoder():
    torch.manual_seed(0)
    return rewritten_decoder(gpt2(n_layer=1))


# The GPT-2 tests come first: compiling another HF class (Llama's) fails a guard of the graphs compiled before it
# (dynamo guards on the length of transformers' output-capturing registry), and each model has 8 graphs at most.


def test_batched_generation_with_padding_matches_autocast(gpt2_decoder):
    model, twin = gpt2_decoder
    ids = token_batch(2, 8, seed=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of the first prompt
    tokens = greedy(model, ids, new_tokens=4, attention_mask=mask)
    assert torch.equal(tokens, autocast_greedy(twin, ids, new_tokens=4, attention_mask=mask))


def _decode_with_one_cache_object(model, steps=4):
    """HF's documented manual loop: one DynamicCache passed to every call, updated in place by the model."""
    from transformers import DynamicCache

    cache, tokens = DynamicCache(), []
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.x renamed it
    with torch.no_grad():
        out = model(input_ids=token_batch(1, 8, seed=3), use_cache=True, **{keyword: cache})
        for _ in range(steps):
            tokens.append(out.logits[:, -1:].argmax(-1))
            out = model(input_ids=tokens[-1], use_cache=True, **{keyword: cache})
    returned = [value for value in out.values() if isinstance(value, DynamicCache)]
    return torch.cat(tokens, 1), cache, returned


def test_a_cache_passed_to_every_call_is_updated_in_place_as_by_the_eager_model(gpt2_decoder):
    model, twin = gpt2_decoder
    tokens, cache, out = _decode_with_one_cache_object(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_cache, _ = _decode_with_one_cache_object(twin)
    assert len(out) == 1 and out[0] is cache  # the object passed in, as eager returns it
    assert cache.get_seq_length() == expected_cache.get_seq_length() == 8 + 4
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_tokens_equal_autocast_on_the_original(request, name):
    model, twin = request.getfixturevalue(f"{name}_decoder")
    ids = token_batch(1, 8, seed=3)
    assert torch.equal(greedy(model, ids), autocast_greedy(twin, ids))


def test_every_step_of_a_generation_runs_graphs_whose_matmuls_are_low(llama_decoder):
    model, twin = llama_decoder
    before = graph_runs(model)
    greedy(model, token_batch(1, 8, seed=4))
    graphs = graphamp.rewritten_graphs(model)
    ran = [graph for graph, runs_before in zip(graphs, before) if graph.runs > runs_before]
    assert sum(graph.runs - runs_before for graph, runs_before in zip(graphs, before)) == 6  # each forward
    matmuls = matmul_dtypes_of(ran)
    assert len(matmuls) >= twin.config.num_hidden_layers * 4  # q, k, v, o and the MLP's at the least
    assert set(matmuls) == {torch.bfloat16}


def test_generations_of_other_prompt_lengths_cost_no_new_graph(llama_decoder):
    """A second prompt length makes dynamo's prefill graph dynamic; every length after it is served."""
    model, _ = llama_decoder
    greedy(model, token_batch(1, 5, seed=5), new_tokens=4)
    compiled = len(graphamp.rewritten_graphs(model))
    for length in (11, 14):
        greedy(model, token_batch(1, length, seed=length), new_tokens=4)
    assert len(graphamp.rewritten_graphs(model)) == compiled


def test_decode_steps_group_key_value_heads_as_eager_hf_does(llama_decoder):
    """Llama's graphs hand SDPA the unrepeated key/value heads (enable_gqa=True), as eager HF does on a CPU."""
    model, _ = llama_decoder
    attention = [
        node
        for graph in graphamp.rewritten_graphs(model)
        for node in graph.graph_module.graph.find_nodes(
            op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default
        )
    ]
    assert attention and all(node.kwargs.get("enable_gqa") for node in attention)


def test_a_weight_written_between_generate_calls_is_read_by_the_next(llama_decoder):
    model, twin = llama_decoder
    ids = token_batch(1, 8, seed=3)
    first = greedy(model, ids)
    head = torch.randn_like(model.lm_head.weight)  # another model's head
    for net in (model, twin):
        with torch.no_grad():
            net.lm_head.weight.copy_(head)
    tokens = greedy(model, ids)
    assert torch.equal(tokens, autocast_greedy(twin, ids))
    assert not torch.equal(tokens, first)


def test_a_module_swapped_between_generate_calls_is_seen_by_the_next(llama_decoder):
    model, twin = llama_decoder
    ids = token_batch(1, 8, seed=3)
    head = torch.nn.Linear(twin.config.hidden_size, VOCAB, bias=True)
    model.lm_head, twin.lm_head = head, copy.deepcopy(head)
    assert torch.equal(greedy(model, ids), autocast_greedy(twin, ids))


def llama_branching_on_a_token_in_eval():
    """A Llama whose forward, in eval mode only, branches on a token's value: dynamo splits the graph there."""
    model = llama(layers=1)
    plain_forward = type(model).forward

    def forward(self, input_ids=None, **kwargs):
        if not self.training and input_ids.max() > VOCAB:
            input_ids = input_ids % VOCAB
        return plain_forward(self, input_ids=input_ids, **kwargs)

    model.forward = forward.__get__(model)
    return model


def test_a_forward_branching_on_a_tokens_value_generates_autocasts_tokens_with_low_matmuls(bf16, seeded):
    model = llama_branching_on_a_token_in_eval()
    twin = copy.deepcopy(model)  # its forward bound to the twin
    graphamp.rewrite(model.eval(), amp_lists=bf16)
    ids = token_batch(1, 8, seed=3)
    assert torch.equal(greedy(model, ids), autocast_greedy(twin.eval(), ids))
    matmuls = matmul_dtypes_of(graphamp.rewritten_graphs(model))
    assert len(matmuls) >= 4 and set(matmuls) == {torch.bfloat16}


def test_an_encoder_decoders_generation_runs_its_encoder_low_as_autocast_does(bf16, seeded):
    """HF generate() runs an encoder-decoder's encoder by itself (`model.get_encoder()(...)`), outside the model's
    call: it ran eagerly in FP32 under rewrite(); it runs under the model's eager policy, as autocast runs it low."""
    from transformers import BartConfig, BartForConditionalGeneration

    from conftest import CompiledCodeRecorder

    config = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
    )
    model = BartForConditionalGeneration(config).eval()
    twin = copy.deepcopy(model)
    graphamp.rewrite(model, amp_lists=bf16)
    ids = token_batch(2, 8)

    def generation(run):
        with CompiledCodeRecorder() as recorder:
            tokens = run()
        return tokens, [c.in_dtypes[:2] for c in recorder.calls_of("mm", "addmm", "bmm")]

    tokens, gemms = generation(lambda: greedy(model, ids, new_tokens=4))
    expected, autocast_gemms = generation(lambda: autocast_greedy(twin, ids, new_tokens=4))
    encoder_alone = generation(lambda: model.get_encoder()(input_ids=ids))[1]
    assert torch.float32 not in {dtype for dtypes in autocast_gemms for dtype in dtypes}
    assert torch.float32 not in {dtype for dtypes in gemms + encoder_alone for dtype in dtypes}
    assert len(gemms) == len(autocast_gemms) and encoder_alone
    assert torch.equal(tokens, expected)
