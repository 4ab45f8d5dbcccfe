"""Which modules carry hooks of the user's, so that they run on every call with the real values.

A forward (pre-)hook the user registered may work by side effect (a list it appends to, a counter, a value it
reads with `.item()`) and a backward hook fires at a module boundary, neither of which a captured graph can
repeat. So every such module becomes a region (graphamp.runtime.regions): it is called through its own
`nn.Module.__call__` on every call, its hooks running as in eager around its piece of the rewritten graph.
Hooks of installed libraries stay in the graph: they compute values forward returns (transformers' output
capturing, torch's weight_norm) and repeat with the graph. Global module hooks fire at every module call,
which no graph can honour: they are refused by name.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules import module as _module_globals

from graphamp.errors import HookError

__all__ = ["check_global_hooks", "runs_hooks_a_graph_cannot", "hooked_module_paths"]

_FORWARD_TABLES = ("_forward_pre_hooks", "_forward_hooks")
_BACKWARD_TABLES = ("_backward_pre_hooks", "_backward_hooks")


def hooked_module_paths(model: nn.Module) -> list[str]:
    """The paths of the submodules (not the root) with a forward hook of the user's or any backward hook."""
    return [path for path, module in model.named_modules() if path and runs_hooks_a_graph_cannot(module)]


def runs_hooks_a_graph_cannot(module: nn.Module) -> bool:
    """Whether eager PyTorch would run a hook on this module's call that a graph cannot repeat: any backward
    hook, a forward hook of the user's, or one of torch.distributed's composable APIs (checkpoint, fully_shard)."""
    if any(getattr(module, table) for table in _BACKWARD_TABLES):
        return True
    return any(
        not _from_installed_library(hook) or _from_torch_distributed(hook)
        for table in _FORWARD_TABLES for hook in getattr(module, table).values()
    )


def check_global_hooks() -> None:
    """Raise HookError naming a global module hook of the user's: it fires at every module call, even inside
    a graph's ops' modules, which no rewritten graph can honour."""
    tables = (
        ("global forward pre-hook", _module_globals._global_forward_pre_hooks, True),
        ("global forward hook", _module_globals._global_forward_hooks, True),
        ("global backward pre-hook", _module_globals._global_backward_pre_hooks, False),
        ("global backward hook", _module_globals._global_backward_hooks, False),
    )
    for kind, hooks, libraries_allowed in tables:
        for hook in hooks.values():
            if libraries_allowed and _from_installed_library(hook):
                continue
            raise HookError(
                f"{_name(hook)} is a {kind} (torch.nn.modules.module.register_module_*_hook): it fires at every "
                f"module call, and a rewritten graph calls only the model and the modules with hooks of their own. "
                f"Fix: remove it while the AmpModule runs, or register it on the modules it is for."
            )


_LIBRARY_DIRS = tuple({str(Path(sysconfig.get_paths()[key]).resolve()) for key in ("purelib", "platlib")})


_TORCH_DISTRIBUTED_DIR = str(Path(torch.distributed.__file__).resolve().parent)


def _from_installed_library(hook) -> bool:
    code = _code_of(hook)
    return code is not None and str(Path(code.co_filename).resolve()).startswith(_LIBRARY_DIRS)


def _code_of(hook):
    code = getattr(hook, "__code__", None) or getattr(getattr(hook, "__func__", None), "__code__", None)
    if code is None:  # a callable object (torch's WeightNorm) or a partial (torch.distributed's hooks)
        inner = getattr(hook, "func", None)
        code = _code_of(inner) if inner is not None else getattr(getattr(type(hook), "__call__", None), "__code__", None)
    return code


def _from_torch_distributed(hook) -> bool:
    code = _code_of(hook)
    return code is not None and str(Path(code.co_filename).resolve()).startswith(_TORCH_DISTRIBUTED_DIR)


def _name(hook) -> str:
    name = getattr(hook, "__qualname__", None) or type(hook).__name__
    code = getattr(hook, "__code__", None)
    return f"'{name}' ({code.co_filename}:{code.co_firstlineno})" if code is not None else f"'{name}'"
