"""The package's shape: public names, imports that run one way, old module paths, what captures keep."""

import ast
import importlib
import importlib.metadata
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import graphamp

PACKAGE = Path(graphamp.__file__).resolve().parent
TOOLS = ("graphamp.inspection", "graphamp.diagnosis")


def graphamp_modules():
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="graphamp."):
        yield info.name


@pytest.mark.parametrize("name", [
    "AmpModule", "OptimizerWithMixedPrecision", "LossScaler", "RewriteReport", "DoctorReport", "AutoListsResult",
    "AutoMixedPrecisionLists", "Decision", "rewrite", "decorate", "export", "doctor", "auto_mixed_precision",
])
def test_the_types_and_functions_users_hold_are_public(name):
    assert name in graphamp.__all__
    assert getattr(graphamp, name).__module__.startswith("graphamp.")


def test_version_is_the_installed_distributions():
    assert graphamp.__version__ == importlib.metadata.version("graphamp")


def test_no_public_function_shares_its_name_with_a_submodule():
    modules = set(graphamp_modules())
    clashes = [name for name in graphamp.__all__ if f"graphamp.{name}" in modules]
    assert clashes == []


def test_every_public_module_declares_all():
    modules = [importlib.import_module(name) for name in graphamp_modules() if not name.rpartition(".")[2].startswith("_")]
    # Subpackages (inspection, diagnosis, runtime) are folders with a docstring; their modules declare __all__.
    missing = [m.__name__ for m in modules if not hasattr(m, "__all__") and not hasattr(m, "__path__")]
    assert missing == []


def test_the_core_imports_nothing_from_the_tools():
    offenders = []
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            imported = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{path.name}: {name}" for name in imported if name.startswith(TOOLS)]
    allowed = {"__init__.py", "cli.py"}  # the public surface and the command sit on top of everything
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []


def imports_of(path: Path) -> set[str]:
    """The graphamp modules a file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphamp"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("graphamp")}
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def pipeline_step(module: str) -> int:
    """lists, capture, cast pass (and their helpers) → runtime → amp_module → optimizer → tools → the top.
    The torch.compile backend, the second front end, sits beside the optimizer it links to for loss scaling."""
    if module in ("graphamp", "graphamp.cli", "graphamp._renamed"):
        return 5
    if module.startswith(TOOLS):
        return 4
    steps = {"graphamp.optimizer": 3, "graphamp.compile_backend": 3, "graphamp.amp_module": 2}
    return steps.get(module, 1 if module.startswith("graphamp.runtime") else 0)


def test_imports_run_one_way_along_the_pipeline():
    # capture.py once imported graphamp.runtime, whose regions.py imports capture: a cycle between the steps.
    backwards = [
        f"{module_name(path)} imports {imported}"
        for path in PACKAGE.rglob("*.py")
        for imported in imports_of(path)
        if pipeline_step(imported) > pipeline_step(module_name(path))
    ]
    assert backwards == []


@pytest.mark.parametrize("old, new", [
    ("graphamp.module", "graphamp.amp_module"), ("graphamp.scaling", "graphamp.loss_scaler"),
    ("graphamp.export", "graphamp.inspection.export_files"), ("graphamp.doctor", "graphamp.diagnosis.diagnose"),
    ("graphamp.recording", "graphamp.inspection.recording"),
])
def test_an_old_module_path_says_where_it_moved(old, new):
    with pytest.raises(ModuleNotFoundError, match=f"import {new}"):
        importlib.import_module(old)


def test_the_functions_keep_their_names_after_importing_the_tools():
    import graphamp.diagnosis.diagnose
    import graphamp.inspection.export_files  # noqa: F401

    assert callable(graphamp.export) and callable(graphamp.doctor)
    assert graphamp.diagnosis.diagnose.DoctorReport is graphamp.DoctorReport


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


def test_only_the_newest_capture_keeps_its_example_batch(bf16):
    amp_model = graphamp.rewrite(TwoLayers(), (torch.randn(4, 8),), amp_lists=bf16, dynamic=False)
    for batch in (3, 5, 6):
        amp_model(torch.randn(batch, 8))
    kept = [c for c in amp_model.captures if c.example_inputs is not None]
    assert len(amp_model.captures) == 4 and kept == [amp_model.captures[-1]]


def test_export_of_an_older_capture_asks_for_inputs_and_takes_them(bf16, tmp_path):
    amp_model = graphamp.rewrite(TwoLayers(), (torch.randn(4, 8),), amp_lists=bf16, dynamic=False)
    amp_model(torch.randn(3, 8))
    amp_model(torch.randn(4, 8))  # the first capture again: it no longer holds its batch
    with pytest.raises(ValueError, match="pass example_args"):
        graphamp.export(amp_model, tmp_path / "a")
    out = graphamp.export(amp_model, tmp_path / "b", example_args=(torch.randn(4, 8),))
    page = (out / "report.html").read_text()
    assert "torch.autocast on the original model</td><td class=n>" in page and "not measured" not in page


def test_capturing_a_plain_module_loads_none_of_transformers_modeling_stack():
    """A model that is not transformers' must not import its modeling code (accelerate, scipy, boto3: ~80 MiB
    resident for the rest of the process) just to be asked whether it is a PreTrainedModel."""
    check = (
        "import sys, torch, transformers, graphamp\n"
        "net = graphamp.rewrite(torch.nn.Sequential(torch.nn.Linear(4, 4)), example_args=(torch.randn(2, 4),),"
        " amp_lists=graphamp.AutoMixedPrecisionLists(dtype='bfloat16'))\n"
        "net(torch.randn(2, 4))\n"
        "print(sorted(m for m in ('transformers.modeling_utils', 'accelerate', 'scipy') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
