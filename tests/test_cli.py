"""The `graphamp` command: lists, check-lists and export, their exit status and their messages."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from graphamp import AutoMixedPrecisionLists
from graphamp.cli import main
from graphamp.policy.lists import default_lists_dir

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    """Write `name.py` holding `source` into the current folder (tmp_path); returns name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(TESTS))  # the factories import the test models

    def write(name, source):
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return write


# -- graphamp lists --------------------------------------------------------------------------------------------

def test_lists_prints_every_entry_with_its_source(capsys):
    assert main(["lists", "--dtype", "bfloat16"]) == 0

    out = capsys.readouterr().out
    assert "AutoMixedPrecisionLists(dtype=bfloat16" in out
    assert any(line.split()[:1] == ["addmm"] and "lists/white.txt:" in line for line in out.splitlines())



def test_lists_prints_the_promote_entries_with_their_source(tmp_path, capsys, write_lists):
    folder = write_lists(tmp_path / "mine", white="mm\n", promote="# mixed inputs meet at the widest\natan2\n")

    assert main(["lists", "--lists", str(folder)]) == 0

    out = capsys.readouterr().out.splitlines()
    assert out[out.index("promote (1):") + 1].split() == ["atan2", f"{folder / 'promote.txt'}:2"]

def test_lists_reads_the_folder_given(tmp_path, capsys, write_lists):
    folder = write_lists(tmp_path / "mine", white="# mine\nmm\n")

    assert main(["lists", "--lists", str(folder)]) == 0

    assert f"{folder / 'white.txt'}:2" in capsys.readouterr().out


def test_lists_rejects_an_unknown_dtype(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["lists", "--dtype", "int8"])

    assert exit_.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


# -- graphamp check-lists --------------------------------------------------------------------------------------

def test_check_lists_accepts_the_shipped_lists(capsys):
    white = len(AutoMixedPrecisionLists(dtype="float16").white_list)

    assert main(["check-lists", str(REPO / "lists")]) == 0

    assert f"OK (float16: {white} white" in capsys.readouterr().out


def test_check_lists_names_file_line_and_the_closest_op(tmp_path, capsys, write_lists):
    folder = write_lists(tmp_path / "mine", black="softmax\nlayer_nrom\n")

    assert main(["check-lists", str(folder)]) == 1

    err = capsys.readouterr().err
    assert err.startswith(f"error: {folder / 'black.txt'}:2: unknown op 'layer_nrom'")
    assert "Did you mean 'layer_norm'" in err


def test_check_lists_rejects_an_op_on_two_lists(tmp_path, capsys, write_lists):
    folder = write_lists(tmp_path / "mine", white="mm\n", gray="mm\n")

    assert main(["check-lists", str(folder)]) == 1

    assert f"{folder / 'white.txt'}:1" in capsys.readouterr().err


def test_check_lists_rejects_a_bad_section_header(tmp_path, capsys, write_lists):
    folder = write_lists(tmp_path / "mine", gray="add\n[fp16]\nexp\n")

    assert main(["check-lists", str(folder)]) == 1

    assert f"{folder / 'gray.txt'}:2: unknown section '[fp16]'" in capsys.readouterr().err


def test_check_lists_names_a_misnamed_list_file(tmp_path, capsys, write_lists):
    folder = write_lists(tmp_path / "mine", **{"whitelist.txt": "mm\n"})

    assert main(["check-lists", str(folder)]) == 1

    assert "whitelist.txt: graphamp does not read this file; did you mean white.txt?" in capsys.readouterr().err


def test_check_lists_warns_about_a_custom_op_not_registered_yet(tmp_path, capsys, write_lists):
    folder = write_lists(tmp_path / "mine", white="mylib::fused_gelu\n")

    assert main(["check-lists", str(folder)]) == 0

    captured = capsys.readouterr()
    assert "OK" in captured.out
    assert f"warning: {folder / 'white.txt'}:1: custom op 'mylib::fused_gelu' is not registered (yet)" in captured.err


def test_check_lists_prints_a_warning_once_not_once_per_dtype(tmp_path, capsys, write_lists):
    folder = write_lists(tmp_path / "mine", white="mm\nmylib::fused_gelu\n")

    assert main(["check-lists", str(folder)]) == 0

    assert capsys.readouterr().err.count("is not registered (yet)") == 1


def test_check_lists_rejects_a_folder_without_list_files(tmp_path, capsys):
    (tmp_path / "empty").mkdir()

    assert main(["check-lists", str(tmp_path / "empty")]) == 1

    assert "holds none of white.txt" in capsys.readouterr().err


def test_check_lists_rejects_a_missing_folder(tmp_path, capsys):
    assert main(["check-lists", str(tmp_path / "nowhere")]) == 1

    assert "is not a folder" in capsys.readouterr().err


# -- graphamp export -------------------------------------------------------------------------------------------

GPT2_FACTORY = """
from models import gpt2, token_batch

def tiny_gpt2():
    ids = token_batch()
    return gpt2(), (), {"input_ids": ids, "labels": ids}
"""


def test_export_writes_the_files_for_gpt2(factory_module, tmp_path, capsys):
    module = factory_module("gpt2_factory", GPT2_FACTORY)

    assert main(["export", f"{module}:tiny_gpt2", "--out", "out", "--dtype", "bfloat16"]) == 0

    summary = json.loads((tmp_path / "out" / "graph.json").read_text())
    assert (summary["model"], summary["dtype"], summary["level"]) == ("GPT2LMHeadModel", "bfloat16", "O1")
    assert {"graph.py", "graph.svg", "report.html", "diff.txt"} <= {p.name for p in (tmp_path / "out").iterdir()}
    assert "casts inserted" in capsys.readouterr().out


def test_export_report_counts_torch_autocasts_casts_on_the_fp32_model(factory_module, tmp_path):
    module = factory_module("mlp_loss_factory", (
        "import torch\nfrom torch import nn\n\n"
        "class Loss(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n        return self.fc(x).square().mean()\n\n"
        "def make():\n    return Loss(), torch.randn(2, 4)\n"
    ))

    assert main(["export", f"{module}:make", "--out", "out", "--dtype", "bfloat16"]) == 0

    page = (tmp_path / "out" / "report.html").read_text()
    assert re.search(r"torch\.autocast on the original model</td><td class=n>[1-9]\d*<", page)
    assert "Counted: forward and backward" in page


def test_export_takes_lists_and_level(factory_module, tmp_path, write_lists):
    module = factory_module("mlp_factory", (
        "import torch\nfrom torch import nn\n\n"
        "def mlp():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)\n"
    ))
    folder = write_lists(tmp_path / "mine", black="linear\n")

    assert main(["export", f"{module}:mlp", "--out", "out", "--lists", str(folder), "--level", "O2",
                 "--dtype", "bfloat16"]) == 0

    summary = json.loads((tmp_path / "out" / "graph.json").read_text())
    (linear,) = [n for n in summary["nodes"] if n["op"] == "linear.default"]
    assert summary["level"] == "O2"
    assert (linear["decision"], linear["source"]) == ("black", f"{folder / 'black.txt'}:1")


@pytest.mark.parametrize("spec", ["no_colon", ":factory", "module:", "module:not-a-name"])
def test_export_rejects_a_malformed_factory_as_a_usage_error(spec, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", spec, "--out", "out"])

    assert exit_.value.code == 2
    assert f"MODULE:FACTORY expected, got '{spec}'" in capsys.readouterr().err


def test_export_names_a_module_it_cannot_import(factory_module, capsys):
    assert main(["export", "no_such_module:make", "--out", "out"]) == 1

    assert capsys.readouterr().err.startswith("error: no_such_module:make: cannot import 'no_such_module'")


def test_export_names_a_factory_that_is_missing_or_not_a_function(factory_module, capsys):
    module = factory_module("not_callable", "make = 3\n\ndef make_model():\n    pass\n")

    assert main(["export", f"{module}:make", "--out", "out"]) == 1
    assert main(["export", f"{module}:make_modle", "--out", "out"]) == 1

    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: not_callable:make: not_callable.make is of type int; FACTORY must be a function."
    assert err[1] == "error: not_callable:make_modle: not_callable has no 'make_modle'; did you mean 'make_model'?"


def test_export_names_a_factory_that_returns_the_wrong_shape(factory_module, capsys):
    module = factory_module("swapped", "import torch\n\ndef make():\n    return torch.ones(2), torch.nn.Linear(2, 2)\n")

    assert main(["export", "models:gpt2", "--out", "out"]) == 1
    assert main(["export", f"{module}:make", "--out", "out"]) == 1

    assert capsys.readouterr().err.splitlines() == [
        "error: models:gpt2 returned a GPT2LMHeadModel; it must return (model, example_args) or "
        "(model, example_args, example_kwargs).",
        "error: swapped:make returned (Tensor, Linear); it must return (model, example_args) or "
        "(model, example_args, example_kwargs).",
    ]


def test_export_passes_on_what_export_program_rejects(factory_module, capsys):
    module = factory_module("half", (
        "import torch\n\ndef make():\n    return torch.nn.Linear(2, 2).half(), torch.ones(2)\n"
    ))

    assert main(["export", f"{module}:make", "--out", "out"]) == 1

    assert capsys.readouterr().err.startswith("error: half:make: parameter 'weight' is float16: graphamp keeps FP32")


# -- graphamp doctor -------------------------------------------------------------------------------------------

POOLED_SUM_FACTORY = """
from models import PooledSum, large_inputs
import torch

def pooled_sum():
    torch.manual_seed(0)
    return PooledSum(), large_inputs(8, 256, 16)
"""


def no_constants(name):
    raise AssertionError(f"report.json holds {name}, which strict JSON parsers reject")


def test_doctor_prints_the_culprit_and_writes_the_report_and_the_fixed_lists(factory_module, tmp_path, capsys):
    module = factory_module("pooled_factory", POOLED_SUM_FACTORY)

    assert main(["doctor", f"{module}:pooled_sum", "--out", "out", "--apply", "fixed", "--top", "3"]) == 0

    out = capsys.readouterr().out
    assert "first inf/NaN (forward): linear_1 = linear.default in pool" in out
    assert "top 3 offenders:" in out
    assert "module `pool` → custom_black_modules" in out
    report = json.loads((tmp_path / "out" / "report.json").read_text(), parse_constant=no_constants)
    assert report["first_nonfinite"]["module"] == "pool" and report["loss"]["amp"] == "nan"
    assert "<svg" in (tmp_path / "out" / "report.html").read_text()
    fixed = AutoMixedPrecisionLists(dtype="float16", lists_dir=tmp_path / "fixed")
    assert [p.name for p in fixed.black_modules] == ["pool"]


def test_doctor_auto_writes_the_lists_it_found(factory_module, tmp_path, capsys):
    module = factory_module("gpt2_factory", GPT2_FACTORY)

    assert main(["doctor", f"{module}:tiny_gpt2", "--dtype", "bfloat16", "--out", "out", "--auto", "1e-3"]) == 0

    out = capsys.readouterr().out
    assert "graphamp auto lists (bfloat16, tolerance 0.001" in out
    found = AutoMixedPrecisionLists(dtype="bfloat16", lists_dir=tmp_path / "out" / "auto_lists")
    assert found.entries()


def test_doctor_passes_on_what_it_rejects(factory_module, capsys):
    module = factory_module("half", (
        "import torch\n\ndef make():\n    return torch.nn.Linear(2, 2).half(), torch.ones(2)\n"
    ))

    assert main(["doctor", f"{module}:make"]) == 1

    assert capsys.readouterr().err.startswith("error: half:make: parameter 'weight' is float16: graphamp keeps FP32")


def test_doctor_will_not_write_over_the_shipped_lists(factory_module, capsys):
    module = factory_module("pooled_factory", POOLED_SUM_FACTORY)

    assert main(["doctor", f"{module}:pooled_sum", "--apply", str(default_lists_dir())]) == 1

    assert str(default_lists_dir()) in capsys.readouterr().err


# -- help and installation -------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["lists", "check-lists", "export", "doctor"])
def test_help_of_each_command_says_what_it_does_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])

    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert f"example:\n  graphamp {command} " in out


def test_graphamp_is_a_console_script_whose_exit_status_is_mains(tmp_path, write_lists):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    folder = write_lists(tmp_path / "mine", white="mmm\n")

    result = subprocess.run(
        [sys.executable, "-m", "graphamp.cli", "check-lists", str(folder)], cwd=REPO, capture_output=True, text=True
    )

    assert scripts == {"graphamp": "graphamp.cli:main"}
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: {folder / 'white.txt'}:1: unknown op 'mmm'")
