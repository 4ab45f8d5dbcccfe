"""Running a test module's scenarios on gloo ranks in child processes, with a deadline that a hung rank cannot pass."""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from filelock import FileLock


def run_scenarios(rank, store, out, world_size, collective_timeout_s, scenarios, arguments_of=lambda scenario: ()):
    """On one rank: join the gloo group, run each scenario (its traceback is its result if it raises, for the test
    that reads it to report), and save the results by scenario name to `out/rank{N}.pt`."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=collective_timeout_s),
    )
    results = {}
    for scenario in scenarios:
        try:
            results[scenario.__name__] = scenario(rank, *arguments_of(scenario))
        except Exception:
            results[scenario.__name__] = traceback.format_exc()
        dist.barrier()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def results_of(ranks: list[dict], scenario, may_fail: bool = False) -> list:
    """Each rank's result of `scenario`; a rank's traceback fails the test unless the scenario `may_fail`."""
    found = [results[scenario.__name__] for results in ranks]
    for rank, result in enumerate(found):
        if isinstance(result, str) and not may_fail:
            pytest.fail(f"{scenario.__name__} failed on rank {rank}:\n{result}")
    return found


def results_of_ranks(worker, tmp_path_factory, name: str, world_size: int, timeout_s: float) -> list[dict]:
    """Each rank's results of `worker(rank, store, out)` spawned on `world_size` ranks, once per test run: xdist can
    split a module's tests over both workers, each setting up the module's fixture, and a job costs seconds of
    imports and compiles per rank. The first worker runs it; the other waits on the lock and reads its files."""
    under_xdist = "PYTEST_XDIST_WORKER" in os.environ
    shared = tmp_path_factory.getbasetemp().parent if under_xdist else tmp_path_factory.getbasetemp()
    out = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        if not (out / "finished").exists():
            out.mkdir(exist_ok=True)
            _run_job(worker, out, world_size, timeout_s)
            (out / "finished").touch()
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _run_job(worker, out: Path, world_size: int, timeout_s: float) -> None:
    """Spawn `worker(rank, store, out)` on each rank and wait at most `timeout_s`."""
    job = mp.spawn(worker, args=(str(out / "store"), str(out)), nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not job.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world_size}-process job did not finish within {timeout_s} s")
    finally:
        for process in job.processes:
            if process.is_alive():
                process.kill()
