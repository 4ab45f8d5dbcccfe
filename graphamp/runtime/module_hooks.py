"""Which module hooks a rewritten graph can honour, and a clear error for those it cannot.

Non-strict torch.export calls every module through `nn.Module.__call__`, so forward pre-hooks and forward
hooks (with or without kwargs) run while graphamp captures: what they do to values (a returned replacement,
an in-place edit, a tensor they hand to forward's outputs) is in the graph and runs on every call, and adding
or removing one makes the next call recapture (graphamp.runtime.fingerprint). Backward hooks on submodules cannot be
honoured: the graph's backward is autograd's over the aten ops, with no module boundary left to call them at.
"""

from __future__ import annotations

import sysconfig
from contextlib import contextmanager
from pathlib import Path

from torch import nn
from torch.nn.modules import module as _module_globals

from graphamp.errors import HookError

__all__ = ["BACKWARD_HOOK_FIX", "check_backward_hooks", "noting_side_effect_hooks"]

BACKWARD_HOOK_FIX = (
    "make that module a region, rewrite(..., regions='<its path>'), so it is called through its own __call__ "
    "and its hooks run as in eager; or register the hook on the AmpModule itself, or use a tensor hook "
    "(output.register_hook) on a value forward returns"
)


def check_backward_hooks(model: nn.Module, region_paths=()) -> None:
    """Raise HookError naming the first backward hook on `model` or its submodules, or a global one.

    Args:
        model: the module about to be captured (the original, not the AmpModule).
        region_paths: the submodules `rewrite(..., regions=...)` calls through nn.Module.__call__: their own
            hooks run as in eager, so they may have backward hooks.
    """
    for path, module in model.named_modules():
        if path in region_paths:
            continue
        where = f"submodule '{path}'" if path else "the model"
        backward_hooks = (("backward pre-hook", module._backward_pre_hooks), ("backward hook", module._backward_hooks))
        for kind, hooks in backward_hooks:
            for hook in hooks.values():
                raise HookError(
                    f"{_name(hook)} is a {kind} on {where} ({type(module).__name__}); a rewritten graph runs no "
                    f"module hooks in backward, so it would never fire. Fix: {BACKWARD_HOOK_FIX}."
                )
    for kind, hooks in (
        ("global backward pre-hook", _module_globals._global_backward_pre_hooks),
        ("global backward hook", _module_globals._global_backward_hooks),
    ):
        for hook in hooks.values():
            raise HookError(
                f"{_name(hook)} is a {kind} (torch.nn.modules.module.register_module_full_backward_hook); a "
                f"rewritten graph runs no module hooks in backward. Fix: remove it while the AmpModule runs, or "
                f"{BACKWARD_HOOK_FIX}."
            )


@contextmanager
def noting_side_effect_hooks(model: nn.Module):
    """While capturing: yields a list that gets a description of each forward (pre-)hook that returned None.

    Such a hook works by side effect; in the graph only the part that reaches forward's values repeats, the
    rest (a list it appends to, a print) ran once, at capture. Hooks of installed libraries are left out:
    transformers' output capturing, for one, feeds forward's outputs and is honoured.

    Args:
        model: the module being captured.
    """
    noted: list[str] = []
    wrapped = []
    for path, module in model.named_modules():
        for kind, hooks in (("forward pre-hook", module._forward_pre_hooks), ("forward hook", module._forward_hooks)):
            for key, hook in list(hooks.items()):
                if not _from_installed_library(hook):
                    where = f"submodule '{path}'" if path else "the model"
                    hooks[key] = _noting_none(hook, noted, f"{kind} {_name(hook)} on {where}")
                    wrapped.append((hooks, key, hook))
    try:
        yield noted
    finally:
        for hooks, key, hook in wrapped:
            if key in hooks:
                hooks[key] = hook


def _noting_none(hook, noted: list[str], description: str):
    def noting(*args, **kwargs):
        result = hook(*args, **kwargs)
        if result is None and description not in noted:
            noted.append(description)
        return result
    return noting


_LIBRARY_DIRS = tuple({str(Path(sysconfig.get_paths()[key]).resolve()) for key in ("purelib", "platlib")})


def _from_installed_library(hook) -> bool:
    code = getattr(hook, "__code__", None)
    return code is not None and str(Path(code.co_filename).resolve()).startswith(_LIBRARY_DIRS)


def _name(hook) -> str:
    name = getattr(hook, "__qualname__", None) or type(hook).__name__
    code = getattr(hook, "__code__", None)
    return f"'{name}' ({code.co_filename}:{code.co_firstlineno})" if code is not None else f"'{name}'"
