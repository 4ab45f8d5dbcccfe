"""graphamp under torch.distributed: DDP around a rewritten model, decorated optimizers, 2 gloo processes on CPU.

The 2-process job runs once per test run (each start costs seconds of imports and a compile per rank); every
scenario is a function run on both ranks, and each test reads the results of one. The example runs under torchrun
on CPU. A hung rank cannot hang CI: jobs are killed after JOB_TIMEOUT_S, collectives time out after
COLLECTIVE_TIMEOUT_S.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import graphamp
from graphamp.passes.marks import mark_of
from ranks import results_of, results_of_ranks, run_scenarios
from models import digits

WORLD_SIZE = 2
JOB_TIMEOUT_S = 90
COLLECTIVE_TIMEOUT_S = 30
STEPS = 4
BATCH = 16
INF = float("inf")
REPOSITORY = Path(__file__).resolve().parent.parent


class DigitsMLP(nn.Module):
    """A digits classifier with BatchNorm (buffers DDP broadcasts) and a head forward() never uses."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
        self.unused_head = nn.Linear(32, 10)  # DDP must be told (find_unused_parameters) or it waits for its grads

    def forward(self, images, labels):
        return F.cross_entropy(self.body(images), labels)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def rank_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the digits, as DistributedSampler deals it out: different batches on each rank."""
    sampler = DistributedSampler(TensorDataset(*digits(256)), WORLD_SIZE, rank, shuffle=True, seed=0)
    return list(DataLoader(TensorDataset(*digits(256)), batch_size=BATCH, sampler=sampler))


def digits_lists(dtype: str) -> graphamp.AutoMixedPrecisionLists:
    """The shipped lists with the classifier's last layer in FP32, named by the model's own path (DDP's `module.` is
    not part of it). Built by each scenario, on its rank."""
    return graphamp.AutoMixedPrecisionLists(dtype=dtype, custom_black_modules=["body.4"])


def rewritten(seed: int, lists: graphamp.AutoMixedPrecisionLists) -> DigitsMLP:
    torch.manual_seed(seed)
    return graphamp.rewrite(DigitsMLP(), digits(BATCH), amp_lists=lists, compile=False)


def ddp(amp_model, comm_hook=None) -> DistributedDataParallel:
    model = DistributedDataParallel(amp_model, find_unused_parameters=True, gradient_as_bucket_view=True)
    if comm_hook is not None:
        model.register_comm_hook(None, comm_hook)
    return model


def full(parameters) -> torch.Tensor:
    """The parameters as one flat tensor; FSDP2's shards are gathered first."""
    return flat(p.full_tensor() if isinstance(p, DTensor) else p for p in parameters)


def train(model, optimizer, batches) -> list[float]:
    losses = []
    for images, labels in batches:
        loss = model(images, labels)
        optimizer.zero_grad()
        optimizer.minimize(loss)
        losses.append(loss.item())
    return losses


def train_on_digits(rank, model, lists):
    """fp16 with dynamic loss scaling; the last batch has another size, so dynamo compiles inside the wrapper."""
    optimizer = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-2), lists, incr_every_n_steps=2)
    start = full(model.parameters())
    buffers_seen_by_forward = []
    amp_model = model.module if isinstance(model, DistributedDataParallel) else model

    @torch.compiler.disable  # run eagerly: traced, its growing list would make dynamo recompile at every step
    def record_buffers(module, args):
        buffers_seen_by_forward.append(flat(module.buffers()))

    amp_model.register_forward_pre_hook(record_buffers)
    batches = rank_batches(rank)[:STEPS]
    images, labels = batches[-1]
    batches[-1] = (images[: BATCH // 2], labels[: BATCH // 2])
    losses = train(model, optimizer, batches[:-1])
    runs_before_the_new_size = sum(graph.runs for graph in graphamp.rewritten_graphs(amp_model))
    losses += train(model, optimizer, batches[-1:])
    return {
        "start": start,
        "parameters": full(model.parameters()),
        "buffers_seen_by_forward": torch.stack(buffers_seen_by_forward),
        "losses": losses,
        "loss_scaling": optimizer.get_loss_scaling(),
        "graph_runs_for_the_new_size": sum(graph.runs for graph in graphamp.rewritten_graphs(amp_model))
        - runs_before_the_new_size,
        "linear_dtypes": {
            mark_of(node).module: node.meta["val"].dtype
            for graph in graphamp.rewritten_graphs(amp_model) for node in graph.graph_module.graph.nodes
            if getattr(node.target, "_opname", None) == "linear"
        },
    }


# -- scenarios: run on every rank, return what the tests compare ------------------------------------------------------


def scenario_ddp_training(rank):
    lists = digits_lists("float16")
    return train_on_digits(rank, ddp(rewritten(seed=rank, lists=lists)), lists)  # DDP broadcasts rank 0's weights


def scenario_fsdp2_training(rank):
    """FSDP2 sharding the rewritten model at the root (one group; per-block sharding: test_fsdp.py)."""
    lists = digits_lists("float16")
    return train_on_digits(rank, fully_shard(rewritten(seed=0, lists=lists)), lists)  # FSDP2 broadcasts nothing


def step_with_inf_on_rank_1(rank, optimizer, loss, parameter):
    """Backward ``loss``, put an inf into ``parameter``'s gradient on rank 1 only, then step."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    before = flat(parameters)
    optimizer.backward(loss)
    if rank == 1:
        parameter.grad.view(-1)[0] = INF
    optimizer.step()
    return {
        "moved": not torch.equal(before, flat(parameters)),
        "skipped_steps": optimizer.skipped_steps,
        "loss_scaling": optimizer.get_loss_scaling(),
    }


def inf_outside_ddp(rank, process_group=None):
    """A rank-local parameter next to the DDP model: DDP never all-reduces its gradient."""
    lists = digits_lists("float16")
    model = ddp(rewritten(seed=rank, lists=lists))
    temperature = nn.Parameter(torch.ones(()))
    optimizer = graphamp.decorate(
        torch.optim.SGD([*model.parameters(), temperature], lr=0.1), lists, init_loss_scaling=1024.0,
        process_group=process_group,
    )
    images, labels = rank_batches(rank)[0]
    return step_with_inf_on_rank_1(rank, optimizer, model(images, labels) * temperature, temperature)


def scenario_inf_outside_ddp(rank):
    return inf_outside_ddp(rank)


def scenario_inf_outside_ddp_with_one_rank_groups(rank):
    """Each rank alone in its group: the documented way to let ranks decide independently."""
    own_group, _ = dist.new_subgroups(group_size=1)
    return inf_outside_ddp(rank, process_group=own_group)


def scenario_inf_under_no_sync(rank):
    """A step taken inside no_sync() (local SGD's habit): the gradients were never all-reduced."""
    lists = digits_lists("float16")
    model = ddp(rewritten(seed=rank, lists=lists))
    optimizer = graphamp.decorate(torch.optim.SGD(model.parameters(), lr=0.1), lists, init_loss_scaling=1024.0)
    images, labels = rank_batches(rank)[0]
    with model.no_sync():
        return step_with_inf_on_rank_1(rank, optimizer, model(images, labels), model.module.body[1].weight)


def scenario_fp16_compress_hook(rank):
    """bfloat16 compute, float16 on the wire."""
    lists = digits_lists("bfloat16")
    model = ddp(rewritten(seed=rank, lists=lists), comm_hook=default_hooks.fp16_compress_hook)
    optimizer = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=1e-2), lists)
    losses = train(model, optimizer, rank_batches(rank)[:STEPS])
    return {"parameters": flat(model.parameters()), "losses": losses}


def scenario_inf_in_an_optimizer_only_rank_0_fed(rank):
    """decorate([a, b]), b holding a parameter outside DDP that only rank 0 uses, whose gradient is inf there: rank
    1's b.step() has no gradient, and must still join rank 0's found_inf all-reduce (else the collectives pair
    wrongly and hang)."""
    lists = digits_lists("float16")
    model = ddp(rewritten(seed=rank, lists=lists))
    temperature = nn.Parameter(torch.ones(()))
    a, b = graphamp.decorate(
        [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD([temperature], lr=0.1)], lists,
        init_loss_scaling=1024.0, model=model,
    )
    images, labels = rank_batches(rank)[0]
    loss = model(images, labels)
    (loss * temperature if rank == 0 else loss).backward()
    if rank == 0:
        temperature.grad.fill_(INF)
    a.step()
    b.step()
    return {"skipped_steps": (a.skipped_steps, b.skipped_steps), "loss_scaling": a.get_loss_scaling()}


SCENARIOS = [
    scenario_ddp_training,
    scenario_fsdp2_training,
    scenario_inf_outside_ddp,
    scenario_inf_outside_ddp_with_one_rank_groups,
    scenario_inf_under_no_sync,
    scenario_fp16_compress_hook,
    scenario_inf_in_an_optimizer_only_rank_0_fed,  # last: without its fix, a collective timeout would follow it
]


def _run_scenarios(rank: int, store: str, out: str) -> None:
    run_scenarios(rank, store, out, WORLD_SIZE, COLLECTIVE_TIMEOUT_S, SCENARIOS)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's results, by scenario name."""
    return results_of_ranks(_run_scenarios, tmp_path_factory, "ddp_ranks", WORLD_SIZE, JOB_TIMEOUT_S)




# -- the specification ----------------------------------------------------------------------------------------------


def test_ranks_start_from_rank_0_weights_and_end_with_identical_parameters(ranks):
    rank_0, rank_1 = results_of(ranks, scenario_ddp_training)
    assert torch.equal(rank_0["start"], rank_1["start"])  # each rank initialised its own; DDP broadcast rank 0's
    assert not torch.equal(rank_0["start"], rank_0["parameters"])
    assert torch.equal(rank_0["parameters"], rank_1["parameters"])


def test_ranks_train_on_different_batches(ranks):
    rank_0, rank_1 = results_of(ranks, scenario_ddp_training)
    assert rank_0["losses"] != rank_1["losses"]


def test_every_forward_sees_rank_0s_batch_norm_statistics(ranks):
    rank_0, rank_1 = results_of(ranks, scenario_ddp_training)
    first, last = rank_0["buffers_seen_by_forward"][[0, -1]]
    assert not torch.equal(first, last)  # the statistics did change between steps
    assert torch.equal(rank_0["buffers_seen_by_forward"], rank_1["buffers_seen_by_forward"])


def test_ranks_hold_the_same_grown_loss_scaling(ranks):
    rank_0, rank_1 = results_of(ranks, scenario_ddp_training)
    assert rank_0["loss_scaling"] == rank_1["loss_scaling"] > 2.0**16  # incr_every_n_steps=2 over 4 steps


def test_a_new_batch_size_runs_in_graphamps_graphs_inside_ddp_forward(ranks):
    """Compiled inside DDP's forward (or served by a dynamic graph): not run eagerly, in float32."""
    assert [result["graph_runs_for_the_new_size"] for result in results_of(ranks, scenario_ddp_training)] == [1, 1]


@pytest.mark.parametrize("scenario", [scenario_ddp_training, scenario_fsdp2_training], ids=["ddp", "fsdp2"])
def test_the_black_module_named_by_the_models_path_runs_in_float32(ranks, scenario):
    for result in results_of(ranks, scenario):
        assert result["linear_dtypes"] == {"body.1": torch.float16, "body.4": torch.float32}


@pytest.mark.parametrize(
    "scenario", [scenario_inf_outside_ddp, scenario_inf_under_no_sync], ids=["outside_ddp", "under_no_sync"]
)
def test_inf_on_one_rank_makes_every_rank_skip_and_back_off(ranks, scenario):
    for result in results_of(ranks, scenario):
        assert result == {"moved": False, "skipped_steps": 1, "loss_scaling": 512.0}


def test_a_process_group_of_one_rank_lets_each_rank_decide_alone(ranks):
    rank_0, rank_1 = results_of(ranks, scenario_inf_outside_ddp_with_one_rank_groups)
    assert rank_0 == {"moved": True, "skipped_steps": 0, "loss_scaling": 1024.0}
    assert rank_1 == {"moved": False, "skipped_steps": 1, "loss_scaling": 512.0}


def test_a_rank_without_gradients_for_an_optimizer_skips_and_backs_off_with_the_rank_that_had_an_inf(ranks):
    for result in results_of(ranks, scenario_inf_in_an_optimizer_only_rank_0_fed):
        assert result == {"skipped_steps": (0, 1), "loss_scaling": 512.0}


def test_fp16_compress_hook_keeps_ranks_identical(ranks):
    rank_0, rank_1 = results_of(ranks, scenario_fp16_compress_hook)
    assert rank_0["losses"] != rank_1["losses"]
    assert torch.equal(rank_0["parameters"], rank_1["parameters"])


def test_fsdp2_around_the_rewritten_model_trains_as_ddp_does(ranks):
    ddp_ranks, fsdp_ranks = results_of(ranks, scenario_ddp_training), results_of(ranks, scenario_fsdp2_training)
    for ddp_result, fsdp_result in zip(ddp_ranks, fsdp_ranks):
        assert fsdp_result["losses"] == pytest.approx(ddp_result["losses"], rel=1e-6)
        torch.testing.assert_close(fsdp_result["parameters"], ddp_result["parameters"])
        assert fsdp_result["loss_scaling"] == ddp_result["loss_scaling"]
        assert fsdp_result["graph_runs_for_the_new_size"] == 1


class TorchrunExample:
    """examples/ddp_train.py on 2 CPU processes under torchrun, started now; `steps()` waits for it and gives rank 0's
    step lines. The launcher and its workers die JOB_TIMEOUT_S after the start."""

    def __init__(self, *args: str):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD_SIZE}",
            str(REPOSITORY / "examples" / "ddp_train.py"), *args,
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])}
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU, also on a GPU machine
        # Output goes to a file, not a pipe: a worker torchrun leaves behind (its own session) keeps a pipe open
        # and would block reading it; the launcher's exit is what the test waits for, bounded.
        # Appending: the workers' writes go to the end though output() reads from the start while they run.
        self.log = tempfile.TemporaryFile("a+")
        self.deadline = time.monotonic() + JOB_TIMEOUT_S
        self.launcher = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_for_line(self, line: str) -> None:
        """Until rank 0 has printed `line` (or the launcher is gone, which steps() then reports)."""
        while line not in self.output().splitlines() and self.launcher.poll() is None:
            if time.monotonic() > self.deadline:
                break
            time.sleep(0.05)

    def kill(self) -> None:
        if self.launcher.poll() is None:
            os.killpg(self.launcher.pid, signal.SIGKILL)
            self.launcher.wait()

    def steps(self) -> list[str]:
        try:
            self.launcher.wait(timeout=max(self.deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            os.killpg(self.launcher.pid, signal.SIGKILL)
            self.launcher.wait()
        output = self.output()
        self.log.close()
        if self.launcher.returncode == -signal.SIGKILL:
            pytest.fail(f"torchrun did not finish within {JOB_TIMEOUT_S} s:\n{output}")
        assert self.launcher.returncode == 0, output
        return [line for line in output.splitlines() if line.startswith("step ")]


def test_a_run_resumed_from_a_checkpoint_continues_the_same_trajectory(tmp_path):
    # float16 with a loss scale that grows every 2 steps, so the scaling state matters across the checkpoint.
    run = ["--dtype", "float16", "--width", "8", "--steps", "8", "--log-every", "1", "--incr-every-n-steps", "2"]
    straight_run = TorchrunExample(*run, "--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "4")
    # The resumed run starts once step 4's checkpoint is written (rank 0 prints the line after torch.save returns):
    # its start-up overlaps the straight run's last steps.
    straight_run.wait_for_line(f"saved {tmp_path / 'a' / 'step-4.pt'}")
    resumed_run = TorchrunExample(
        *run, "--checkpoint-dir", str(tmp_path / "b"), "--resume", str(tmp_path / "a/step-4.pt")
    )
    try:
        straight, resumed = straight_run.steps(), resumed_run.steps()
    finally:
        resumed_run.kill()  # when the straight run failed

    assert len(straight) == 8
    assert resumed == straight[4:]  # loss (6 decimals), loss scale and skips, step by step
    assert len({line.split("loss scale")[1] for line in resumed}) > 1
    # Bitwise: same kernels on one thread per rank, and gloo's sum of two gradients does not depend on the order.
    a, b = (torch.load(tmp_path / run_dir / "step-8.pt", weights_only=False) for run_dir in ("a", "b"))
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][key], b["model"][key]) for key in a["model"])
    assert a["optimizer"]["loss_scaler"] == b["optimizer"]["loss_scaler"]
    for state_a, state_b in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(state_a[key], state_b[key]) for key in state_a)
