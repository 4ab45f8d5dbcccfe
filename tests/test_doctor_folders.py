"""`graphamp doctor` checks that it can write its --out and --apply folders before it runs the diagnosis.

Tests run as root, where a folder's mode does not stop writes: a path under a regular file is the unwritable target.
"""

from __future__ import annotations

import sys

import pytest

from graphamp.cli import main

# Records that the factory ran: the diagnosis starts with it.
FACTORY = """
from pathlib import Path
import torch

def make():
    Path("factory_ran").write_text("yes")
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4), torch.randn(2, 4)
"""


@pytest.fixture
def factory(tmp_path, monkeypatch):
    """`linear_factory:make` importable from the current folder (tmp_path), which also holds a regular file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "linear_factory.py").write_text(FACTORY)
    monkeypatch.delitem(sys.modules, "linear_factory", raising=False)
    (tmp_path / "a_file").write_text("not a folder")
    return "linear_factory:make"


@pytest.mark.parametrize("option", ["--out", "--apply"])
def test_an_unwritable_folder_fails_before_the_diagnosis_with_one_error_line(factory, tmp_path, capsys, option):
    assert main(["doctor", factory, "--dtype", "bfloat16", option, "a_file/reports"]) == 1

    err = capsys.readouterr().err
    assert err.startswith("error: a_file/reports: cannot write there (")
    assert f"pass {option} a folder you can write." in err
    assert "Traceback" not in err
    assert not (tmp_path / "factory_ran").exists()


def test_missing_out_and_apply_folders_are_created_and_written(factory, tmp_path, capsys):
    assert main(["doctor", factory, "--dtype", "bfloat16", "--out", "new/reports", "--apply", "new/lists"]) == 0

    assert (tmp_path / "new" / "reports" / "report.json").is_file()
    assert (tmp_path / "new" / "lists" / "white.txt").is_file()
    assert sorted(p.name for p in (tmp_path / "new" / "reports").iterdir()) == ["report.html", "report.json"]
