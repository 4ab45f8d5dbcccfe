"""What many test files share: the lists in each dtype, a seed, a lists folder writer, the loss of an output.

Models live in models.py, the training loop and relative error in training.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import graphamp


@pytest.fixture(scope="session")
def bf16() -> graphamp.AutoMixedPrecisionLists:
    """The shipped lists for bfloat16 (what the CPU tests run in: float16 matmuls are ~100x slower on CPU)."""
    return graphamp.AutoMixedPrecisionLists(dtype="bfloat16")


@pytest.fixture(scope="session")
def fp16() -> graphamp.AutoMixedPrecisionLists:
    return graphamp.AutoMixedPrecisionLists(dtype="float16")


@pytest.fixture
def seeded():
    """The same weights, inputs and dropout masks on every run."""
    torch.manual_seed(0)


def write_list_folder(folder: Path, **files: str) -> Path:
    """A lists folder: write_list_folder(path, white="mm\\n") writes white.txt; the other list files are empty."""
    folder.mkdir(parents=True, exist_ok=True)
    for color in ("white", "black", "gray"):
        (folder / f"{color}.txt").write_text(files.pop(color, ""))
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def write_lists():
    """The function write_list_folder, for tests that take it as a fixture."""
    return write_list_folder


def loss_of(out) -> torch.Tensor:
    """The HF loss when the model computes one, else a scalar of the output."""
    return out.loss if hasattr(out, "loss") else out.float().pow(2).mean()


@pytest.fixture
def hf_loss():
    return loss_of
