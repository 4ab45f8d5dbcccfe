"""What many test files share: the lists in each dtype, a seed, a lists folder writer, the loss of an output.

Models live in models.py, the training loop and relative error in training.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import graphamp
from training import loss_of


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
    """A lists folder: write_list_folder(path, white="mm\\n", black_modules="lm_head\\n") writes white.txt and
    black_modules.txt; white/black/gray not given are written empty. A name with a dot is a file name as it is."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for color in ("white", "black", "gray"):
        files.setdefault(color, "")
    for name, text in files.items():
        (folder / (name if "." in name else f"{name}.txt")).write_text(text)
    return folder


@pytest.fixture
def write_lists():
    """write_list_folder, as a fixture."""
    return write_list_folder


@pytest.fixture
def hf_loss():
    """training.loss_of: the HF loss when the model computes one, else a scalar of the output."""
    return loss_of
