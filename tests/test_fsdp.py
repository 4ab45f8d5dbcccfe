"""FSDP2 (per block and at the root) and DDP (eager and compile=True) around a rewritten model train like one
process on both ranks' batches, with black-module patterns written against the model's own paths running in
FP32; DCP checkpoints resume bit-exact. 2 gloo processes on CPU.

Under a whole-model compile FSDP2's hooks are graph breaks: torch wraps them in torch._dynamo.disable (torch 2.13
has no `skip_fsdp_hooks` switch left). Dynamo resumes after a break in an ordinary frame, but skips a frame whose
loop breaks: the frame looping over the sharded blocks runs eagerly, each block's forward is compiled on its own
(twins share one graph), and the frame around it resumes compiled. So the model here has HF's shape: the blocks'
loop in an inner module (`body`), the head and the loss in the outer one. One 2-process job runs every scenario
on both ranks and each test reads the results of one, as in test_distributed.py.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import graphamp
from graphamp.passes.marks import mark_of
from models import VOCAB, ResidualBlock
from ranks import results_of, results_of_ranks, run_scenarios

WORLD_SIZE = 2
JOB_TIMEOUT_S = 300  # two inductor compiles per rank (DDP with compile=True) on shared CPU cores
COLLECTIVE_TIMEOUT_S = 120
STEPS = 4
INF = float("inf")
BLACK_MODULES = ["head", "body.blocks.*.down"]  # the model's own paths; one pattern for every twin block


class Body(nn.Module):
    def __init__(self, n_blocks=2, width=64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(n_blocks))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x


class LanguageModel(nn.Module):
    """HF's shape: the loop over the blocks in `body`, the head and the loss in the model's own forward."""

    def __init__(self, n_blocks=2, width=64):
        super().__init__()
        self.body = Body(n_blocks, width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens, labels):
        return F.cross_entropy(self.head(self.body(tokens)).flatten(0, 1), labels.flatten())


class FinalNormModel(LanguageModel):
    """GPT-2's ending: a final LayerNorm before the head. With the embedding and the head it is FSDP2's root group."""

    def __init__(self, n_blocks=2, width=64):
        super().__init__(n_blocks, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens, labels):
        hidden = self.body(tokens)
        return F.cross_entropy(self.head(self.norm(hidden)).flatten(0, 1), labels.flatten())


def rank_batches(rank: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different token batches on each rank, the same on every run."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [(t, t.roll(-1, 1)) for t in torch.randint(0, VOCAB, (steps, 4, 16), generator=generator)]


def flat(tensors) -> torch.Tensor:
    return torch.cat([(t.full_tensor() if isinstance(t, DTensor) else t).detach().reshape(-1).float() for t in tensors])


def model_of(seed: int = 0, n_blocks: int = 2) -> LanguageModel:
    torch.manual_seed(seed)  # FSDP2 broadcasts nothing: every rank builds the same weights
    return LanguageModel(n_blocks)


def model_lists(dtype: str = "float16") -> graphamp.AutoMixedPrecisionLists:
    """The shipped lists with BLACK_MODULES in FP32; built on each rank by the scenario that uses them."""
    return graphamp.AutoMixedPrecisionLists(dtype=dtype, custom_black_modules=BLACK_MODULES)


def sharded(per_block: bool, seed: int = 0, lists=None) -> LanguageModel:
    """FSDP2's documented order: fully_shard each block, then the root; then rewrite the model as it is (with
    model_lists() unless `lists` are given)."""
    model = model_of(seed)
    if per_block:
        for block in model.body.blocks:
            fully_shard(block)
    fully_shard(model)
    return graphamp.rewrite(model, amp_lists=model_lists() if lists is None else lists)


def decorated(parameters, lists=None):
    lists = model_lists() if lists is None else lists
    return graphamp.decorate(torch.optim.AdamW(parameters, lr=1e-2), lists, incr_every_n_steps=2)


def train(model, optimizer, batches) -> list[float]:
    losses = []
    for tokens, labels in batches:
        loss = model(tokens, labels)
        optimizer.zero_grad()
        optimizer.minimize(loss)
        losses.append(loss.item())
    return losses


def linears_by_graph(model) -> list[tuple[int, list[tuple[str, torch.dtype]]]]:
    """For each graph graphamp rewrote: how often it ran, and each linear's module path and dtype."""
    return [
        (graph.runs, [
            (mark_of(node).module, node.meta["val"].dtype)
            for node in graph.graph_module.graph.nodes if getattr(node.target, "_opname", None) == "linear"
        ])
        for graph in graphamp.rewritten_graphs(model)
    ]


def training_result(model, optimizer, batches) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(model, optimizer, batches)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {
        "losses": losses,
        "parameters": flat(model.parameters()),
        "loss_scaling": optimizer.get_loss_scaling(),
        "graphs": linears_by_graph(inner),
        "eager_warnings": [str(w.message) for w in caught if str(w.message).startswith("graphamp:")],
    }


# -- scenarios --------------------------------------------------------------------------------------------------------


def scenario_single_process(rank):
    """What the ranks together should compute: one process, both ranks' batches in one."""
    model = graphamp.rewrite(model_of(), amp_lists=model_lists())
    batches = [
        (torch.cat([t0, t1]), torch.cat([l0, l1])) for (t0, l0), (t1, l1) in zip(rank_batches(0), rank_batches(1))
    ]
    return training_result(model, decorated(model.parameters()), batches)


def scenario_fsdp_per_block(rank):
    model = sharded(per_block=True)
    result = training_result(model, decorated(model.parameters()), rank_batches(rank))
    parameters = list(model.parameters())
    result["all_sharded"] = all(isinstance(p, DTensor) for p in parameters)
    result["local_fraction"] = sum(p.to_local().numel() for p in parameters) / sum(p.numel() for p in parameters)
    return result


def scenario_fsdp_at_the_root(rank):
    model = sharded(per_block=False)
    return training_result(model, decorated(model.parameters()), rank_batches(rank))


def scenario_ddp(rank):
    model = DistributedDataParallel(graphamp.rewrite(model_of(seed=rank), amp_lists=model_lists()))  # rank 0's
    return training_result(model, decorated(model.parameters()), rank_batches(rank))


def scenario_ddp_compile(rank):
    """One block: inductor's C++ kernels are most of this job's time (2 blocks: 13 kernels, 1: 10), and the casts'
    decisions are the same in every block."""
    results, lists = {}, model_lists("bfloat16")
    if rank == 0:  # inductor compiles the kernels once; rank 1 loads them from its cache instead of compiling them too
        warm = graphamp.rewrite(model_of(n_blocks=1), amp_lists=lists, compile=True)
        warm(*rank_batches(rank)[0]).backward()  # no optimizer: its inf/NaN check would wait for rank 1
    dist.barrier()
    for compile in (False, True):
        model = DistributedDataParallel(graphamp.rewrite(model_of(n_blocks=1), amp_lists=lists, compile=compile))
        optimizer = decorated(model.parameters(), lists)
        results[compile] = {
            "losses": train(model, optimizer, rank_batches(rank)),
            "parameters": flat(model.parameters()),
            "graphs": linears_by_graph(model.module),
        }
    return results


def scenario_fsdp_documented_order_against_ddp(rank):
    """docs/distributed.md's FSDP2 order, rewrite() given example inputs (a forward that no backward follows), against
    DDP of the same model on the same batches; every matmul in bfloat16."""
    lists = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")
    batches = rank_batches(rank, steps=5)
    torch.manual_seed(0)
    model = FinalNormModel()
    for block in model.body.blocks:
        fully_shard(block)
    fully_shard(model)
    graphamp.rewrite(model, batches[0], amp_lists=lists)
    fsdp_losses = train(model, decorated(model.parameters(), lists), batches)

    torch.manual_seed(0)
    reference = graphamp.rewrite(FinalNormModel(), batches[0], amp_lists=lists)
    ddp = DistributedDataParallel(reference)
    ddp_losses = train(ddp, decorated(ddp.parameters(), lists), batches)
    sharded_parameters = dict(model.named_parameters())
    return {
        "losses": (fsdp_losses, ddp_losses),
        "max_difference": {
            name: (sharded_parameters[name].full_tensor() - p).abs().max().item()
            for name, p in reference.named_parameters()
        },
        "graphs": linears_by_graph(model),
    }


def scenario_fsdp_pattern_naming_one_of_twin_blocks(rank):
    """Twin blocks compiled one at a time share a graph: a pattern that tells them apart cannot be honoured."""
    lists = graphamp.AutoMixedPrecisionLists(dtype="float16", custom_black_modules=["body.blocks.1.down"])
    model = sharded(per_block=True, lists=lists)
    tokens, labels = rank_batches(rank)[0]
    try:
        model(tokens, labels)
    except graphamp.CaptureError as error:
        return {"error": str(error)}
    return {"error": None}


def scenario_fsdp_inf_on_rank_1(rank):
    model = sharded(per_block=True)
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), model_lists(), init_loss_scaling=1024.0)
    tokens, labels = rank_batches(rank)[0]
    before = flat(model.parameters())
    optimizer.backward(model(tokens, labels))
    if rank == 1:
        model.body.blocks[1].up.weight.grad.to_local().view(-1)[0] = INF  # this rank's shard only
    optimizer.step()
    return {
        "moved": not torch.equal(before, flat(model.parameters())),
        "skipped_steps": optimizer.skipped_steps,
        "loss_scaling": optimizer.get_loss_scaling(),
    }


def checkpoint_state(model, optimizer) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer.optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "loss_scaler": optimizer.loss_scaler.state_dict()}


def scenario_dcp_resume(rank, directory):
    batches = rank_batches(rank, steps=6)
    model = sharded(per_block=True)
    optimizer = decorated(model.parameters())
    train(model, optimizer, batches[:3])
    dcp.save(checkpoint_state(model, optimizer), checkpoint_id=directory)
    straight = train(model, optimizer, batches[3:])

    resumed_model = sharded(per_block=True, seed=1)  # other weights: the checkpoint must replace them
    resumed_optimizer = decorated(resumed_model.parameters())
    state = checkpoint_state(resumed_model, resumed_optimizer)
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(
        resumed_model, resumed_optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    resumed_optimizer.loss_scaler.load_state_dict(state["loss_scaler"])
    resumed = train(resumed_model, resumed_optimizer, batches[3:])
    return {
        "straight": straight,
        "resumed": resumed,
        "parameters_equal": torch.equal(flat(model.parameters()), flat(resumed_model.parameters())),
        "optimizer_states_equal": all(
            torch.equal(flat([a[k]]), flat([b[k]]))
            for a, b in zip(optimizer.state.values(), resumed_optimizer.state.values()) for k in a
        ),
        "loss_scaling": (optimizer.get_loss_scaling(), resumed_optimizer.get_loss_scaling()),
    }


def scenario_fsdp2_casting_the_parameters(rank):
    """MixedPrecisionPolicy(param_dtype=...) hands the graphs bfloat16 parameters: fully_shard before rewrite() (the
    documented order) and after it."""
    policy, lists, errors = MixedPrecisionPolicy(param_dtype=torch.bfloat16), model_lists("bfloat16"), {}
    model = model_of()
    for block in model.body.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    try:
        graphamp.rewrite(model, amp_lists=lists)
    except graphamp.ArgumentError as error:
        errors["rewrite"] = (str(error), graphamp.is_rewritten(model))
    model = fully_shard(graphamp.rewrite(model_of(), amp_lists=lists), mp_policy=policy)
    try:
        model(*rank_batches(rank)[0])
    except graphamp.ArgumentError as error:
        errors["call"] = (str(error), graphamp.is_rewritten(model))
    return errors


SCENARIOS = [
    scenario_single_process,
    scenario_fsdp_per_block,
    scenario_fsdp_at_the_root,
    scenario_ddp,
    scenario_ddp_compile,
    scenario_fsdp_documented_order_against_ddp,
    scenario_fsdp_pattern_naming_one_of_twin_blocks,
    scenario_fsdp_inf_on_rank_1,
    scenario_dcp_resume,
    scenario_fsdp2_casting_the_parameters,
]


def _run_scenarios(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    checkpoint = os.path.join(out, "checkpoint")
    run_scenarios(
        rank, store, out, WORLD_SIZE, COLLECTIVE_TIMEOUT_S, SCENARIOS,
        lambda scenario: (checkpoint,) if scenario is scenario_dcp_resume else (),
    )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return results_of_ranks(_run_scenarios, tmp_path_factory, "fsdp_ranks", WORLD_SIZE, JOB_TIMEOUT_S)


# -- the specification ------------------------------------------------------------------------------------------------


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("scenario", [scenario_fsdp_per_block, scenario_fsdp_at_the_root, scenario_ddp],
                         ids=["fsdp_per_block", "fsdp_at_the_root", "ddp"])
def test_the_ranks_train_like_one_process_on_both_ranks_batches(ranks, scenario):
    single, _ = results_of(ranks, scenario_single_process)
    rank_0, rank_1 = results_of(ranks, scenario)
    mean_losses = torch.tensor([(a + b) / 2 for a, b in zip(rank_0["losses"], rank_1["losses"])])
    assert relative(mean_losses, torch.tensor(single["losses"])) < 1e-3
    assert torch.equal(rank_0["parameters"], rank_1["parameters"])
    assert relative(rank_0["parameters"], single["parameters"]) < 1e-3
    assert rank_0["loss_scaling"] == rank_1["loss_scaling"] == single["loss_scaling"] > 2.0**16  # grew twice


@pytest.mark.parametrize("scenario", [scenario_fsdp_per_block, scenario_fsdp_at_the_root, scenario_ddp],
                         ids=["fsdp_per_block", "fsdp_at_the_root", "ddp"])
def test_black_modules_named_by_the_models_paths_run_in_float32_and_the_rest_low(ranks, scenario):
    for result in results_of(ranks, scenario):
        linears = {path: dtype for runs, graph in result["graphs"] if runs for path, dtype in graph}
        assert linears["head"] == torch.float32
        assert {dtype for path, dtype in linears.items() if path.endswith(".down")} == {torch.float32}
        assert {dtype for path, dtype in linears.items() if path.endswith(".up")} == {torch.float16}
        assert result["eager_warnings"] == []  # no white-list op ran outside graphamp's graphs


def test_per_block_sharding_runs_each_block_in_one_shared_graph_and_the_head_in_another(ranks):
    for result in results_of(ranks, scenario_fsdp_per_block):
        runs = {tuple(path for path, _ in graph): runs for runs, graph in result["graphs"]}
        assert runs == {("body.blocks.0.up", "body.blocks.0.down"): 2 * STEPS, ("head",): STEPS}


def test_sharding_at_the_root_runs_the_whole_model_in_one_graph(ranks):
    for result in results_of(ranks, scenario_fsdp_at_the_root):
        assert [runs for runs, _ in result["graphs"]] == [STEPS]


def test_fsdp2_in_the_documented_order_trains_every_parameter_as_ddp(ranks):
    """The root group (embedding, final norm, head) included: rewrite()'s call on the examples ends FSDP2's
    iteration, so the optimizer is built from the sharded parameters."""
    for result in results_of(ranks, scenario_fsdp_documented_order_against_ddp):
        fsdp_losses, ddp_losses = result["losses"]
        assert fsdp_losses == pytest.approx(ddp_losses, abs=1e-5)
        assert {name: d for name, d in result["max_difference"].items() if d > 1e-5} == {}
        linears = {path: dtype for runs, graph in result["graphs"] if runs for path, dtype in graph}
        assert {linears["body.blocks.0.up"], linears["body.blocks.0.down"], linears["head"]} == {torch.bfloat16}


def test_per_block_fsdp2_parameters_stay_sharded_between_steps(ranks):
    for result in results_of(ranks, scenario_fsdp_per_block):
        assert result["all_sharded"]
        assert result["local_fraction"] <= 0.6


def test_a_pattern_naming_one_of_twin_sharded_blocks_raises_capture_error_with_the_fix(ranks):
    for result in results_of(ranks, scenario_fsdp_pattern_naming_one_of_twin_blocks):
        assert "'body.blocks.1.down'" in result["error"] and "every twin alike" in result["error"]


def test_inf_in_one_ranks_shard_makes_both_ranks_skip(ranks):
    for result in results_of(ranks, scenario_fsdp_inf_on_rank_1):
        assert result == {"moved": False, "skipped_steps": 1, "loss_scaling": 512.0}


def test_a_dcp_checkpoint_resumes_bit_exact(ranks):
    for result in results_of(ranks, scenario_dcp_resume):
        assert result["resumed"] == result["straight"]
        assert result["parameters_equal"] and result["optimizer_states_equal"]
        assert result["loss_scaling"][0] == result["loss_scaling"][1]


def test_ddp_with_compile_trains_as_ddp_eager(ranks):
    for result in results_of(ranks, scenario_ddp_compile):
        eager, compiled = result[False], result[True]
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-2)
        # inductor's fused bfloat16 kernels round otherwise than the fx code's ATen ops: 1.1e-3 measured (one block)
        assert relative(compiled["parameters"], eager["parameters"]) <= 5e-3
        (runs, linears), = compiled["graphs"]  # what inductor compiled: the casts' decisions
        linears = dict(linears)
        assert runs == STEPS and linears["head"] == torch.float32 and linears["body.blocks.0.up"] == torch.bfloat16


def test_fsdp2_casting_the_parameters_is_refused_with_the_fix(ranks):
    """Not 'model.float() casts it back': the model was never cast, and FSDP2 would cast it again."""
    for result in results_of(ranks, scenario_fsdp2_casting_the_parameters):
        assert result.keys() == {"rewrite", "call"}
        assert result["rewrite"][1] is False  # refused before the conversion
        for error, _ in result.values():
            assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in error
            assert "Fix: fully_shard without param_dtype" in error and "model.float()" not in error
