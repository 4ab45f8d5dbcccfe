"""A lists folder with no white entry loads, but runs every op in float32: AutoMixedPrecisionLists warns and
`graphamp check-lists` fails, instead of both passing it in silence."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import graphamp
from graphamp import AutoMixedPrecisionLists
from graphamp.cli import main
from graphamp.inspection.recording import floating
from conftest import CompiledCodeRecorder


def test_a_folder_of_empty_list_files_warns_that_nothing_runs_in_low_precision(tmp_path, write_lists):
    folder = write_lists(tmp_path / "mine")  # white.txt, black.txt and gray.txt, all empty

    with pytest.warns(UserWarning, match=r"white\.txt: holds no entries, so with the lists of .*mine no op runs in "
                                          r"low precision"):
        AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=folder)


def test_a_folder_without_white_txt_warns_that_nothing_runs_in_low_precision(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "black.txt").write_text("softmax\n")

    with pytest.warns(UserWarning, match=r"white\.txt: is missing, so .* no op runs in low precision"):
        AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=folder)


def test_a_white_txt_of_comments_and_section_headers_only_warns(tmp_path, write_lists):
    folder = write_lists(tmp_path / "mine", white="# matmuls\n[all]\n\n[float16]\n# none yet\n")

    with pytest.warns(UserWarning, match=r"holds no entries"):
        AutoMixedPrecisionLists(dtype="float16", lists_dir=folder)


def test_the_warning_points_at_the_line_that_built_the_lists(tmp_path, write_lists):
    folder = write_lists(tmp_path / "mine")

    with pytest.warns(UserWarning, match="holds no entries") as caught:
        AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=folder)

    assert caught[0].filename == __file__


def test_a_folder_with_one_white_entry_loads_without_a_warning(tmp_path, write_lists):
    folder = write_lists(tmp_path / "mine", white="mm\n")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=folder).white_list == {"mm"}


def test_the_warned_about_lists_indeed_run_a_linear_in_float32(tmp_path, write_lists):
    """What the warning says, checked: the rewritten model's matmul runs in float32."""
    with pytest.warns(UserWarning, match="holds no entries"):
        lists = AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=write_lists(tmp_path / "mine"))
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = graphamp.rewrite(nn.Linear(8, 8), (x,), amp_lists=lists)

    with CompiledCodeRecorder() as recorder:
        model(x)

    gemms = recorder.calls_of("addmm", "mm")
    assert gemms and all(floating(call.in_dtypes) == {torch.float32} for call in gemms)


def test_check_lists_fails_on_a_folder_of_empty_list_files(tmp_path, capsys, write_lists):
    folder = write_lists(tmp_path / "mine")

    assert main(["check-lists", str(folder)]) == 1

    captured = capsys.readouterr()
    assert "OK" not in captured.out
    assert captured.err.startswith(f"error: {folder / 'white.txt'}: holds no entries")
    assert captured.err.count("holds no entries") == 1  # the error, not the warning too


def test_check_lists_warns_of_a_dtype_whose_white_entries_are_all_in_the_other_dtypes_section(
    tmp_path, capsys, write_lists
):
    folder = write_lists(tmp_path / "mine", white="[bfloat16]\nmm\n")

    assert main(["check-lists", str(folder)]) == 0

    captured = capsys.readouterr()
    assert "OK (float16: 0 white" in captured.out
    assert f"warning: {folder / 'white.txt'}: no entries for float16" in captured.err
    assert "bfloat16 (its section" not in captured.err
