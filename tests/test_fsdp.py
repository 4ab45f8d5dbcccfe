"""FSDP2 per-block sharding with regional rewrite, DCP checkpoints and DDP + compile: 2 gloo processes on CPU.

As in test_distributed.py, one 2-process job runs every scenario on both ranks and each test reads the results of
one. Order of FSDP2's docs: fully_shard(block) for each block, fully_shard(model), then graphamp.rewrite(model, ...) with
no extra argument (the sharded blocks become regions on their own) and decorate(AdamW(model.parameters())).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import graphamp
from ranks import results_of, results_of_ranks, run_scenarios
from models import VOCAB, BlockStack

WORLD_SIZE = 2
JOB_TIMEOUT_S = 300  # two inductor compiles per rank on shared CPU cores
COLLECTIVE_TIMEOUT_S = 120
STEPS = 5
INF = float("inf")
FP16 = graphamp.AutoMixedPrecisionLists(dtype="float16")
BF16 = graphamp.AutoMixedPrecisionLists(dtype="bfloat16")


def rank_batches(rank: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different token batches on each rank, the same on every run."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [(t, t.roll(-1, 1)) for t in torch.randint(0, VOCAB, (steps, 4, 16), generator=generator)]


def flat(tensors) -> torch.Tensor:
    return torch.cat([(t.full_tensor() if isinstance(t, DTensor) else t).detach().reshape(-1).float() for t in tensors])


def sharded_model(seed: int = 0, lists=FP16, **rewrite_options):
    torch.manual_seed(seed)  # FSDP2 broadcasts nothing: every rank builds the same weights
    model = BlockStack(n_blocks=2)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    tokens, labels = rank_batches(0)[0]
    return model, graphamp.rewrite(model, (tokens, labels), amp_lists=lists, **rewrite_options)


def ddp_model(lists=FP16, compile=False):
    torch.manual_seed(0)
    tokens, labels = rank_batches(0)[0]
    return DistributedDataParallel(graphamp.rewrite(BlockStack(n_blocks=2), (tokens, labels), amp_lists=lists, compile=compile))


def train(model, optimizer, batches) -> list[float]:
    losses = []
    for tokens, labels in batches:
        loss = model(tokens, labels)
        optimizer.zero_grad()
        optimizer.minimize(loss)
        losses.append(loss.item())
    return losses


def decorated(parameters, lists=FP16):
    return graphamp.decorate(torch.optim.AdamW(parameters, lr=1e-2), lists, incr_every_n_steps=2)


# -- scenarios --------------------------------------------------------------------------------------------------------


def scenario_fsdp_training(rank):
    model, amp_model = sharded_model()
    optimizer = decorated(amp_model.parameters())
    losses = train(amp_model, optimizer, rank_batches(rank))
    parameters = list(model.parameters())
    return {
        "losses": losses,
        "parameters": flat(parameters),
        "all_sharded": all(isinstance(p, DTensor) for p in parameters),
        "local_fraction": sum(p.to_local().numel() for p in parameters) / sum(p.numel() for p in parameters),
        "loss_scaling": optimizer.get_loss_scaling(),
    }


def scenario_ddp_training(rank):
    model = ddp_model()
    optimizer = decorated(model.parameters())
    losses = train(model, optimizer, rank_batches(rank))
    return {"losses": losses, "parameters": flat(model.parameters()), "loss_scaling": optimizer.get_loss_scaling()}


def scenario_fsdp_inf_on_rank_1(rank):
    model, amp_model = sharded_model()
    optimizer = graphamp.decorate(torch.optim.SGD(amp_model.parameters(), lr=0.1), FP16, init_loss_scaling=1024.0)
    tokens, labels = rank_batches(rank)[0]
    before = flat(model.parameters())
    optimizer.backward(amp_model(tokens, labels))
    if rank == 1:
        model.blocks[1].up.weight.grad.to_local().view(-1)[0] = INF  # this rank's shard only
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
    model, amp_model = sharded_model()
    optimizer = decorated(amp_model.parameters())
    train(amp_model, optimizer, batches[:3])
    dcp.save(checkpoint_state(model, optimizer), checkpoint_id=directory)
    straight = train(amp_model, optimizer, batches[3:])

    resumed_model, resumed_amp_model = sharded_model(seed=1)  # other weights: the checkpoint must replace them
    resumed_optimizer = decorated(resumed_amp_model.parameters())
    state = checkpoint_state(resumed_model, resumed_optimizer)
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(
        resumed_model, resumed_optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    resumed_optimizer.loss_scaler.load_state_dict(state["loss_scaler"])
    resumed = train(resumed_amp_model, resumed_optimizer, batches[3:])
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


def scenario_ddp_compile(rank):
    results = {}
    for compile in (False, True):
        model = ddp_model(lists=BF16, compile=compile)
        optimizer = decorated(model.parameters(), BF16)
        results[compile] = {"losses": train(model, optimizer, rank_batches(rank)), "parameters": flat(model.parameters())}
    return results


def scenario_fsdp_with_named_regions(rank):
    model, amp_model = sharded_model(regions="blocks.*")
    return {"losses": train(amp_model, decorated(amp_model.parameters()), rank_batches(rank))}


SCENARIOS = [
    scenario_fsdp_training,
    scenario_ddp_training,
    scenario_fsdp_inf_on_rank_1,
    scenario_dcp_resume,
    scenario_ddp_compile,
    scenario_fsdp_with_named_regions,
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
    out = tmp_path_factory.mktemp("fsdp_ranks")
    return results_of_ranks(_run_scenarios, out, WORLD_SIZE, JOB_TIMEOUT_S)




# -- the specification ------------------------------------------------------------------------------------------------


def test_per_block_fsdp2_trains_as_ddp_does(ranks):
    for fsdp, ddp in zip(results_of(ranks, scenario_fsdp_training), results_of(ranks, scenario_ddp_training)):
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
        error = ((fsdp["parameters"] - ddp["parameters"]).norm() / ddp["parameters"].norm()).item()
        assert error <= 1e-5
        assert fsdp["loss_scaling"] == ddp["loss_scaling"]


def test_per_block_fsdp2_parameters_stay_sharded_between_steps(ranks):
    for result in results_of(ranks, scenario_fsdp_training):
        assert result["all_sharded"]
        assert result["local_fraction"] <= 0.6


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
        error = ((compiled["parameters"] - eager["parameters"]).norm() / eager["parameters"].norm()).item()
        assert error <= 1e-3


def test_naming_the_sharded_blocks_as_regions_trains_the_same(ranks):
    for named, automatic in zip(results_of(ranks, scenario_fsdp_with_named_regions), results_of(ranks, scenario_fsdp_training)):
        assert named["losses"] == automatic["losses"]
