"""The package's shape: public names, the layout that shows the pipeline, imports that run one way, its size."""

import ast
import importlib
import importlib.metadata
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphamp

PACKAGE = Path(graphamp.__file__).resolve().parent
TOOLS = ("graphamp.inspection", "graphamp.diagnosis")
# The pipeline, in order: each step imports only from the steps before it (or itself).
STEPS = ("graphamp.policy", "graphamp.passes", "graphamp.frontends", "graphamp.training", *TOOLS)
# Private torch names that may stay outside torch_private.py, by prefix, each with why: torch documents them as the way.
PRIVATE_TORCH_NAMES_ALLOWED = {
    "torch._foreach_": "the foreach kernels (one launch for a list of tensors), as torch.optim calls them",
    "torch._amp_foreach_non_finite_check_and_unscale_": "GradScaler's unscale-and-check kernel, on the device",
    "torch._amp_update_scale_": "GradScaler's loss-scale update kernel, on the device",
    "torch.ops.aten.": "ATen's op names, underscore ones included (aten._to_copy is the cast): ops, not Python APIs",
}


def graphamp_modules():
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="graphamp."):
        yield info.name


@pytest.mark.parametrize("name", [
    "OptimizerWithMixedPrecision", "LossScaler", "RewriteReport", "DoctorReport", "AutoListsResult",
    "AutoMixedPrecisionLists", "Decision", "rewrite", "rewritten_graphs", "is_rewritten", "export_program", "backend", "decorate",
    "export", "doctor", "auto_mixed_precision",
])
def test_the_types_and_functions_users_hold_are_public(name):
    assert name in graphamp.__all__
    assert getattr(graphamp, name).__module__.startswith("graphamp.")


def test_the_rewrite_only_runtime_is_gone():
    assert not (PACKAGE / "runtime").exists()
    assert "AmpModule" not in graphamp.__all__ and not hasattr(graphamp, "AmpModule")


def test_the_folders_are_the_pipeline():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == ["diagnosis", "frontends", "inspection", "passes", "policy", "training"]
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "cli.py", "errors.py", "torch_private.py"]


def test_the_private_torch_apis_module_imports_nothing_of_graphamps():
    assert imports_of(PACKAGE / "torch_private.py") == set()


# A ratchet with room, not a target: lower it when the package shrinks, raise it only with a reason in the commit.
PACKAGE_LINES_AT_MOST = 9815


def test_the_package_stays_under_its_line_ratchet():
    lines = sum(len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py"))
    assert lines <= PACKAGE_LINES_AT_MOST, f"graphamp/ has {lines} lines"


def test_version_is_the_installed_distributions():
    assert graphamp.__version__ == importlib.metadata.version("graphamp")


def test_no_public_function_shares_its_name_with_a_submodule():
    modules = set(graphamp_modules())
    clashes = [name for name in graphamp.__all__ if f"graphamp.{name}" in modules]
    assert clashes == []


def test_every_public_module_declares_all():
    modules = [importlib.import_module(name) for name in graphamp_modules() if not name.rpartition(".")[2].startswith("_")]
    # Subpackages are folders with a docstring; their modules declare __all__.
    missing = [m.__name__ for m in modules if not hasattr(m, "__all__") and not hasattr(m, "__path__")]
    assert missing == []


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
    """policy (and errors) → passes → front ends → training → tools (inspection, diagnosis) → the top."""
    if module in ("graphamp", "graphamp.cli"):
        return len(STEPS)
    return next((i for i, step in enumerate(STEPS) if module == step or module.startswith(step + ".")), 0)


def test_imports_run_one_way_along_the_pipeline():
    backwards = [
        f"{module_name(path)} imports {imported}"
        for path in PACKAGE.rglob("*.py")
        for imported in imports_of(path)
        if pipeline_step(imported) > pipeline_step(module_name(path))
    ]
    assert backwards == []


def test_the_functions_keep_their_names_after_importing_the_tools():
    import graphamp.diagnosis.diagnose
    import graphamp.inspection.export_files  # noqa: F401

    assert callable(graphamp.export) and callable(graphamp.doctor)
    assert graphamp.diagnosis.diagnose.DoctorReport is graphamp.DoctorReport


def test_rewriting_a_plain_module_loads_none_of_transformers_modeling_stack():
    """A model that is not transformers' must not import its modeling code (accelerate, scipy, boto3: ~80 MiB
    resident for the rest of the process)."""
    check = (
        "import sys, torch, transformers, graphamp\n"
        "net = graphamp.rewrite(torch.nn.Sequential(torch.nn.Linear(4, 4)), example_args=(torch.randn(2, 4),),"
        " amp_lists=graphamp.AutoMixedPrecisionLists(dtype='bfloat16'))\n"
        "net(torch.randn(2, 4))\n"
        "print(sorted(m for m in ('transformers.modeling_utils', 'accelerate', 'scipy') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_torch_names(path: Path) -> set[str]:
    """The private torch names a file uses, each up to its first private part: `import torch._x`,
    `from torch._x import y`, `from torch.x import _y`, and attribute chains from torch (`torch.x._y.z`)."""
    tree = ast.parse(path.read_text())
    torch_names, found = {}, set()  # a local name -> the torch path it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                torch_names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                found.add(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in torch_names:
                found.add(".".join([torch_names[value.id], *reversed(parts)]))
    private = set()
    for name in found:
        parts = name.split(".")
        first = next((i for i, part in enumerate(parts) if is_private(part)), None)
        if first is not None:
            private.add(".".join(parts[:first + 1]))
    return private


def test_private_torch_names_are_used_only_in_torch_private():
    """A private torch API changes without notice: torch_private.py holds each, with the torches it was checked on
    and the test that pins it, so that a new torch breaks one file."""
    used = [
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py")) if path.name != "torch_private.py"
        for name in sorted(private_torch_names(path))
        if not name.startswith(tuple(PRIVATE_TORCH_NAMES_ALLOWED))
    ]
    assert used == [], "move each behind a function or constant in graphamp/torch_private.py"


def private_attributes_of_torch_objects() -> set[str]:
    """The private attribute names of the torch objects graphamp handles: tensors, modules, ops, optimizers, fx."""
    graph_module = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    objects = [torch.zeros(1), graph_module, graph_module.graph, next(iter(graph_module.graph.nodes)),
               torch.ops.aten.add.Tensor, torch.ops.aten.add, torch.optim.SGD(graph_module.parameters())]
    return {name for value in objects for name in dir(value) if is_private(name)}


def test_private_attributes_of_torch_objects_are_read_only_in_torch_private():
    """The same rule for `module._buffers`, `op._schema`, `tensor._version`, read on anything but `self` (a class's
    own attributes are its own business)."""
    private = private_attributes_of_torch_objects()
    read = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{node.attr}"
        for path in sorted(PACKAGE.rglob("*.py")) if path.name != "torch_private.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in private
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]
    assert read == [], "move each behind a function in graphamp/torch_private.py"


def private_names(path: Path) -> tuple[set[str], set[str]]:
    """(the private names a file defines, those it reads off other objects): `_x` in defs, classes and assignments
    (`__dict__["_x"] = ...` and setattr included); in attribute reads and in getattr/hasattr."""
    defined, read = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute):
            (defined if isinstance(node.ctx, ast.Store) else read).add(node.attr)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            defined.add(getattr(node.slice, "value", None))  # `__dict__["_x"] = ...`
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1
              and node.func.id in ("setattr", "getattr", "hasattr") and isinstance(node.args[1], ast.Constant)):
            (defined if node.func.id == "setattr" else read).add(node.args[1].value)
    private = {name for name in defined | read if isinstance(name, str) and name[:1] == "_" and name[:2] != "__"}
    return defined & private, read & private


def test_the_front_ends_and_training_reach_each_other_by_public_names_only():
    """The optimizer link is a function training hands the backend (AmpBackend.link_loss_scaling), not a private
    method the backend looks up on the optimizer, nor a private field training reads off the model."""
    layers = {step: [p for p in PACKAGE.rglob("*.py") if module_name(p).startswith(step)]
              for step in ("graphamp.frontends", "graphamp.training")}
    names = {step: [private_names(p) for p in paths] for step, paths in layers.items()}
    defined = {step: set().union(*(d for d, _ in found)) for step, found in names.items()}
    crossing = [
        f"{module_name(path)} reads {name}, defined in {other}"
        for step, other in (("graphamp.frontends", "graphamp.training"), ("graphamp.training", "graphamp.frontends"))
        for path, (_, read) in zip(layers[step], names[step])
        for name in sorted(read & defined[other] - defined[step])
    ]
    assert crossing == []
