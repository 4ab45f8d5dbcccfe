"""The policy a front end applies, defined once: the lists, the level, what counts as a normalization, and the
checks every entry point makes before any work starts. `AmpConfig` is the frozen value the passes, both front ends
and the doctor's probe read and never change (torch.ao's QConfigMapping is the model).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from graphamp.errors import ArgumentError
from graphamp.policy.dtypes import HALF_DTYPES, check_dtype_runs_on, dtype_name
from graphamp.policy.lists import AutoMixedPrecisionLists, ListEntry
from graphamp.torch_private import NormBase

__all__ = [
    "CAST_AFTER", "LEVELS", "AmpConfig", "check_entry_arguments", "check_level", "check_master_weights",
    "is_normalization_module", "refuse_half_parameters", "warn_of_custom_fwd_casts",
]

# O1: the lists decide each op. O2: every op but the black ones runs low, normalization parameters stay FP32.
LEVELS = ("O1", "O2")
_NORM_MODULE_TYPES = (NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


@dataclass(frozen=True)
class AmpConfig:
    """What decides each op's dtype: the lists (with their dtype), the level and, where the model is known
    (for_model), the black-module patterns' decision on each of its module paths."""

    lists: AutoMixedPrecisionLists
    level: str = "O1"
    # Not compared or hashed: the eager rules (rules_for) are cached by config and do not depend on it.
    black_module_paths: Mapping[str, ListEntry] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lists, AutoMixedPrecisionLists):
            raise _not_lists(self.lists, "amp_lists")
        check_level(self.level)

    @property
    def dtype(self) -> torch.dtype:
        return self.lists.dtype

    def for_model(self, model: nn.Module) -> AmpConfig:
        """This config with `model`'s module paths decided (lists.black_modules_in), for a graph of it."""
        return replace(self, black_module_paths=self.lists.black_modules_in(model))

    def black_module_for(self, module_path: str) -> ListEntry | None:
        """The pattern that keeps the module at `module_path` FP32 by any of its names in the model, if any."""
        return self.black_module_paths.get(module_path) or self.lists.black_module_for(module_path)


def _not_lists(amp_lists, argument: str) -> ArgumentError:
    """amp_lists given as something else (a dtype or its name, most often): the error that says what to pass."""
    dtype = f"dtype={amp_lists!r}" if isinstance(amp_lists, (str, torch.dtype)) else "..."
    return ArgumentError(
        f"{argument} got a {type(amp_lists).__name__}; pass graphamp.AutoMixedPrecisionLists({dtype})."
    )


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise ArgumentError(f"level={level!r}: use 'O1' (lists decide) or 'O2' (all but black ops run low).")


def is_normalization_module(kind) -> bool:
    """BatchNorm, LayerNorm, GroupNorm, RMSNorm, or a class named *Norm (LlamaRMSNorm, T5LayerNorm): under O2 the
    parameters its ops read stay FP32. `kind` is the class, or its name as a serialized graph keeps it."""
    if isinstance(kind, type):
        return issubclass(kind, _NORM_MODULE_TYPES) or "Norm" in kind.__name__
    return isinstance(kind, str) and "Norm" in kind.rpartition(".")[2]


def check_module(model, argument: str) -> None:
    """A model argument that is no nn.Module: a typed error here, not an AttributeError from deep inside."""
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"{argument} takes an nn.Module, got {type(model).__name__}.")


def check_entry_arguments(
    entry_point: str, model, example_args, example_kwargs, amp_lists, level: str, compile: bool = False
) -> tuple[tuple, dict, AmpConfig]:
    """What every entry point (rewrite, export_program, doctor, auto_mixed_precision, the CLI) checks first.

    Returns the example call as (args tuple, kwargs dict) and the config (the shipped lists when None).
    """
    check_module(model, f"{entry_point}()")
    # peft's PeftModel, by duck type (peft is not imported): the model it wraps gets peft_config, not get_base_model
    if entry_point == "rewrite" and callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config"):
        raise ArgumentError(
            f"rewrite() got a peft {type(model).__name__}: its generate() and merge_and_unload() reach the model "
            f"inside, which would stay unconverted and run in float32. Rewrite the base model first, then add the "
            f"adapters: graphamp.rewrite(base_model, ...), then peft.get_peft_model(base_model, config)."
        )
    if isinstance(example_args, list):
        raise ArgumentError(
            f"{entry_point}() got example_args as a list; the positional arguments are a tuple: (x,) or (x, y). "
            f"For a model whose one argument is a list, pass ([x, y],)."
        )
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise ArgumentError(
            f"{entry_point}() got example_kwargs as a {type(example_kwargs).__name__}; pass a dict of keyword "
            f"arguments, e.g. {{'attention_mask': mask}}."
        )
    if amp_lists is not None and not isinstance(amp_lists, AutoMixedPrecisionLists):
        raise _not_lists(amp_lists, f"{entry_point}(amp_lists=...)")
    config = AmpConfig(amp_lists if amp_lists is not None else AutoMixedPrecisionLists(), level)
    check_master_weights(model)
    check_dtype_runs_on(next((p.device for p in model.parameters()), None), config.dtype, compile)
    config.lists.warn_unmatched_black_modules(model)
    warn_of_custom_fwd_casts(entry_point)
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    return example_args, dict(example_kwargs or {}), config


# The wrapper torch.amp.custom_fwd puts around a Function's forward, told by its code object.
_CUSTOM_FWD_CODE = torch.amp.custom_fwd(lambda ctx: None, device_type="cpu").__code__


def warn_of_custom_fwd_casts(entry_point: str) -> None:
    """Say which loaded autograd.Functions declare `torch.amp.custom_fwd(cast_inputs=...)`: the decorator casts only
    while torch.autocast is on, which graphamp never turns on, and their calls cannot be told apart in a graph or by
    a function mode (Function.apply reaches neither). Their bodies follow the lists instead."""
    found, classes = [], list(torch.autograd.Function.__subclasses__())
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        forward = inspect.getattr_static(cls, "forward", None)
        forward = getattr(forward, "__func__", forward)
        if getattr(forward, "__code__", None) is _CUSTOM_FWD_CODE:
            cast_inputs = inspect.getclosurevars(forward).nonlocals.get("cast_inputs")
            if cast_inputs is not None:
                found.append(f"{cls.__module__}.{cls.__qualname__} (cast_inputs={cast_inputs})")
    if found:
        warnings.warn(
            f"{entry_point}(): {', '.join(sorted(found))} declare torch.amp.custom_fwd(cast_inputs=...), which casts "
            f"only under torch.autocast; under graphamp the ops inside follow the lists. To keep one FP32, put the "
            f"module that calls it on custom_black_modules, or its ops on custom_black_list.",
            stacklevel=3,
        )


# The fix for a model cast before graphamp converts it, and for one cast after (rewriting it again is refused).
CAST_BEFORE = "Keep the model in float32 (drop .half()/.to(dtype)) and rewrite it."
CAST_AFTER = "It was cast after graphamp converted it: model.float() casts it back (the next call compiles anew)."


def check_master_weights(model: nn.Module, fix: str = CAST_BEFORE) -> None:
    """FP32 parameters are the master weights: a model already cast to half precision has none."""
    refuse_half_parameters(model.named_parameters(), fix)


def refuse_half_parameters(named_parameters, fix: str = CAST_BEFORE) -> None:
    """ArgumentError naming the first of these (name, parameter) pairs that is float16 or bfloat16, and `fix`."""
    for name, parameter in named_parameters:
        if parameter.dtype in HALF_DTYPES:
            raise ArgumentError(
                f"parameter '{name}' is {dtype_name(parameter.dtype)}: graphamp keeps FP32 master weights and casts "
                f"inside the graph. {fix}"
            )
