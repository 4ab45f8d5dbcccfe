"""The module users train: the original's FP32 master weights, driving rewritten graphs.

`rewrite(model, ...)` captures the model, runs the cast pass and returns an `AmpModule`. Each train/eval
mode and input signature (shapes, dtypes, devices, keyword names, non-tensor values) gets its own capture,
kept in a small cache: torch.export's `ep.module()` cannot switch modes, so graphamp captures per mode.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Hashable

import torch
import torch.utils._pytree as pytree
from torch import nn

from graphamp.capture import Captured, capture
from graphamp.cast_pass import RewriteReport, check_level, insert_casts
from graphamp.compiled import CompiledGraph
from graphamp.dtypes import HALF_DTYPES, check_dtype_runs_on, dtype_name
from graphamp.lists import AutoMixedPrecisionLists
from graphamp.progress import Progress

__all__ = ["AmpModule", "rewrite"]

DEFAULT_MAX_CAPTURES = 8
CAPTURE_PHASE = "capturing the model with torch.export"
CAST_PASS_PHASE = "inserting casts"


class AmpModule(nn.Module):
    """Runs `model` through graphs rewritten for mixed precision; its parameters are the model's own.

    The parameter, buffer and child tables are the original model's (shared, not copied), so the
    parameters are the same objects, `state_dict()` has the original keys and loads into the original,
    and `.to()`/`.train()`/`.eval()` act on both.
    """

    def __init__(
        self, model, amp_lists, level="O1", compile=False, fp32_outputs=True, max_captures=DEFAULT_MAX_CAPTURES,
        progress=None,
    ):
        super().__init__()
        self.__dict__["_original"] = model  # not registered: its tables are ours already
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
        self.__dict__["_modules"] = model._modules
        self.amp_lists = amp_lists
        self.level = level
        self.compile = compile
        self.fp32_outputs = fp32_outputs
        self.max_captures = max_captures
        self.progress = Progress(progress)
        self._captures: OrderedDict[Hashable, Captured] = OrderedDict()
        self._last: Captured | None = None

    @property
    def original_module(self) -> nn.Module:
        return self._original

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The rewritten graph used by the latest call (or built by `rewrite`)."""
        return self._last.graph_module

    @property
    def report(self) -> RewriteReport:
        """What the cast pass decided for `graph_module`."""
        return self._last.report

    @property
    def timings(self) -> dict:
        """Seconds per phase of the latest call's capture: capture, cast pass, and inductor's compiles."""
        return self._last.timings

    @property
    def captures(self) -> list[Captured]:
        """Every cached capture, oldest first (one per mode and input signature)."""
        return list(self._captures.values())

    @property
    def training(self) -> bool:
        """The original's mode: `model.eval()` and `amp_model.eval()` are the same switch."""
        original = self.__dict__.get("_original")
        return original.training if original is not None else True

    @training.setter
    def training(self, mode: bool) -> None:
        original = self.__dict__.get("_original")
        if original is not None:  # nn.Module.__init__ sets it before the original is attached
            original.training = mode

    def train(self, mode: bool = True):
        self._original.train(mode)
        return self

    def forward(self, *args, **kwargs):
        captured, flat_inputs = self._captured_for(args, kwargs)
        lifted = [source.get() for source in captured.lifted]
        outputs = captured.run(*lifted, *flat_inputs)
        return pytree.tree_unflatten([outputs[i] for i in captured.user_outputs], captured.out_spec)

    def _captured_for(self, args: tuple, kwargs: dict) -> tuple[Captured, list]:
        kwargs = dict(sorted(kwargs.items()))  # one capture whatever order keywords are passed in
        flat_inputs, spec = pytree.tree_flatten((args, kwargs))
        key = (self.training, spec, tuple(_leaf_signature(x) for x in flat_inputs), device_of(self._original))
        captured = self._captures.get(key)
        if captured is None:
            captured = self._capture(args, kwargs)
            for older in self._captures.values():
                older.example_inputs = None  # only the newest capture keeps its batch, for export's reruns
            self._captures[key] = captured
            if len(self._captures) > self.max_captures:
                self._captures.popitem(last=False)
                warnings.warn(
                    f"graphamp has seen more than max_captures={self.max_captures} input signatures (shapes, "
                    f"dtypes, keyword names) and dropped the oldest capture; each new one costs a capture. "
                    f"Pad inputs to a few fixed shapes, or pass a larger max_captures to rewrite().",
                    stacklevel=3,
                )
        else:
            self._captures.move_to_end(key)
        self._last = captured
        return captured, flat_inputs

    def _capture(self, args: tuple, kwargs: dict) -> Captured:
        timings = {}
        with self.progress.phase(CAPTURE_PHASE, timings):
            captured = capture(self._original, args, kwargs, self.amp_lists.promote_ops)
        with self.progress.phase(CAST_PASS_PHASE, timings):
            captured.report = insert_casts(
                captured.graph_module, self.amp_lists, self.level, self.fp32_outputs,
                fp32_placeholders(self._original, captured, self.level),
            )
        captured.timings = timings
        captured.run = (
            CompiledGraph(captured.graph_module, self.progress, timings) if self.compile else captured.graph_module
        )
        return captured

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is None:
                raise
            return getattr(original, name)  # model.config and friends, as on the original

    def extra_repr(self) -> str:
        return f"dtype={self.amp_lists.dtype_name}, level={self.level}, compile={self.compile}"


def rewrite(
    model: nn.Module,
    example_args=(),
    example_kwargs=None,
    amp_lists: AutoMixedPrecisionLists | None = None,
    level: str = "O1",
    compile: bool = False,
    fp32_outputs: bool = True,
    max_captures: int = DEFAULT_MAX_CAPTURES,
    progress: bool | None = None,
) -> AmpModule:
    """Capture `model` with torch.export and return an AmpModule that runs it in mixed precision.

    example_args/example_kwargs: a call of the model, used for the first capture (in the model's current
    train/eval mode); other modes and input shapes are captured on first use.
    amp_lists: the white/black/gray lists and dtype (default: the shipped lists, float16).
    level: "O1" — lists decide; "O2" — everything but black ops and normalization parameters runs low.
    compile: hand each rewritten graph to torch.compile (inductor).
    fp32_outputs: cast floating outputs back to float32 (the loss comes back FP32).
    progress: a line on stderr per phase (capture, cast pass, inductor compiles) — None: phases still running
    after 2 s; True: every phase; False: none. Each capture's `timings` has the seconds either way.
    """
    example_args, example_kwargs, amp_lists = check_entry_arguments(
        "rewrite", model, example_args, example_kwargs, amp_lists, level, compile
    )
    amp_model = AmpModule(model, amp_lists, level, compile, fp32_outputs, max_captures, progress)
    amp_model._captured_for(example_args, example_kwargs)
    return amp_model


def check_entry_arguments(
    entry_point: str, model, example_args, example_kwargs, amp_lists, level: str, compile: bool = False
) -> tuple[tuple, dict, AutoMixedPrecisionLists]:
    """What every entry point (rewrite, doctor, auto_mixed_precision, the CLI) checks before any work starts.

    Returns the example call as (args tuple, kwargs dict) and the lists (the shipped ones when None).
    """
    if isinstance(model, AmpModule):
        raise ValueError("this model was already rewritten by graphamp; pass the original nn.Module.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{entry_point}() takes an nn.Module, got {type(model).__name__}.")
    check_level(level)
    amp_lists = amp_lists if amp_lists is not None else AutoMixedPrecisionLists()
    check_master_weights(model)
    check_dtype_runs_on(device_of(model), amp_lists.dtype, compile)
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    return example_args, dict(example_kwargs or {}), amp_lists


def _leaf_signature(value) -> Hashable:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    return (type(value), value) if isinstance(value, Hashable) else (type(value), id(value))


def device_of(model: nn.Module):
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else None


def fp32_placeholders(model: nn.Module, captured: Captured, level: str) -> frozenset[str]:
    """The parameter placeholders the cast pass never casts down: normalization parameters under O2."""
    if level != "O2":
        return frozenset()
    return frozenset(
        name for name, fqn in captured.parameter_placeholders.items() if _is_norm_parameter(model, fqn)
    )


def _is_norm_parameter(model: nn.Module, fqn: str) -> bool:
    """Normalization-layer parameters stay FP32 under O2 (BatchNorm, LayerNorm, GroupNorm, RMSNorm, ...)."""
    owner = model.get_submodule(fqn.rpartition(".")[0])
    norm_types = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", nn.LayerNorm))
    return isinstance(owner, norm_types) or "Norm" in type(owner).__name__


def check_master_weights(model: nn.Module) -> None:
    for name, parameter in model.named_parameters():
        if parameter.dtype in HALF_DTYPES:
            raise ValueError(
                f"parameter '{name}' is {dtype_name(parameter.dtype)}: graphamp keeps FP32 master "
                f"weights and casts inside the graph. Keep the model in float32 (drop .half()/.to(dtype)) and rewrite it."
            )
