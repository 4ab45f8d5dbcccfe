"""Running a test module's scenarios on gloo ranks in child processes, with a deadline that a hung rank cannot pass."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp


def results_of_ranks(worker, out: Path, world_size: int, timeout_s: float) -> list[dict]:
    """Spawn `worker(rank, store, out)` on each rank, wait at most `timeout_s`, and load each rank's `rank{N}.pt`."""
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
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
