"""rewrite(): the user's model converted in place to train in mixed precision under torch.compile.

As `nn.Module.compile` does, the model's call goes through torch.compile, here with graphamp's backend; the model
stays the user's object (docs/module_contract.md). What graphamp keeps on it is `model._graphamp`. Every call runs
under graphamp's eager policy (eager_policy.py): docs/backend.md, "Outside the graphs", lists each case.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
import inspect
import itertools
import signal
import sys
import threading
import types
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from graphamp.errors import ArgumentError, CaptureError, GraphampError
from graphamp.frontends.compile_backend import (
    GRAPHAMP_OPTIONS, AmpBackend, BackendGraph, refuse_fsdp2_param_dtype, refuse_outer_autocast,
    refuse_unknown_inductor_options,
)
from graphamp.frontends.eager_policy import EagerPolicy, ModelFacts, rules_for
from graphamp.frontends.export_program import (
    explain_capture_failure, op_without_fake_impl, refuse_examples_that_do_not_fit,
)
from graphamp.policy.config import CAST_AFTER, AmpConfig, check_entry_arguments, check_master_weights
from graphamp.torch_private import (
    BackendCompilerFailed, call_module_with_hooks, composable_apis_on, dispatch_mode_makes_dynamo_run_eagerly,
    dynamo_stance, dynamo_traces_hook_table_subclasses, exporting_elsewhere_for_graphamp, global_module_hooks,
    inductor_modes, module_buffers, pytree, recompile_limit, tensor_version, this_thread_traces,
)

__all__ = [
    "AmpState", "amp_states", "is_rewritten", "link_copied_optimizer", "rewrite", "rewritten_graphs", "rewritten_models",
]

_models_compiled = itertools.count()

# The models rewrite() converted and that are alive, found by their parameters: by decorate() without model=
# (deprecated), and by an unpickled optimizer, to link the copy of its model taken with it.
_REWRITTEN: weakref.WeakSet = weakref.WeakSet()

# Decorated optimizers unpickled (or deep-copied) with their models: a checkpoint of (optimizer, model) unpickles the
# optimizer before the model holds its parameters, so the model's copy links them at its first call.
_COPIED_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()

# Dynamo keeps its graphs, and counts its recompile limit, per code object: shared by every rewritten model, past 8
# models a new one would run eagerly. Each model compiles a code object of its own (_fresh_call_module),
# and where torch has it (>= 2.13) its own cache for the frames after a graph break (its class's forward code).
TORCH_ISOLATES_RECOMPILES = "isolate_recompiles" in inspect.signature(torch.compile).parameters
_ISOLATED_RECOMPILES = {"isolate_recompiles": True} if TORCH_ISOLATES_RECOMPILES else {}

_DEPRECATED = {
    "fp32_outputs": "the values a graph returns keep the dtypes the model's own code gives them (float32 where the "
                    "FP32 model computes float32), which the code after it expects",
    "max_captures": "dynamo keeps the graphs: torch._dynamo.config.recompile_limit bounds them per model",
    "progress": "TORCH_LOGS='recompiles,graph_breaks' shows dynamo's progress, and each of "
                "graphamp.rewritten_graphs(model) has graphamp's `timings`",
    "regions": "torch.compile runs hooks, FSDP2's sharding and activation checkpointing within the whole model's "
               "capture (checkpoint= still names blocks to checkpoint)",
    "weight_cache": "inductor casts each weight inside its kernels; docs/performance.md has the measured trade",
}


@dataclass(frozen=True)
class CompileSettings:
    """torch.compile's own arguments, as rewrite() got them."""

    inductor: bool = False
    mode: str | None = None
    options: dict = field(default_factory=dict)
    dynamic: bool | None = None
    fullgraph: bool = False


def rewrite(
    model: nn.Module,
    example_args=(),
    example_kwargs=None,
    amp_lists=None,
    level: str = "O1",
    compile: bool = False,
    *,
    mode: str | None = None,
    options: dict | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    checkpoint: str | None = None,
    **deprecated,
) -> nn.Module:
    """Convert `model` in place to run mixed precision under torch.compile; returns the same object.

    Args:
        model: the FP32 nn.Module to train; its parameters stay the master weights.
        example_args: positional inputs of one call. When given (or example_kwargs), the model is compiled ahead
            on them, so that a construct dynamo or graphamp cannot capture is an error now, not at the first step;
            the model's buffers and random state are restored after. A single tensor may be passed bare.
        example_kwargs: keyword inputs of that call.
        amp_lists: the white/black/gray lists and dtype (default: the shipped lists, float16).
        level: "O1" — the lists decide; "O2" — everything but black ops and normalization parameters runs low.
        compile: compile each rewritten graph with inductor; False runs it as fx code (no compile step).
        mode: torch.compile's mode, e.g. "max-autotune" or "reduce-overhead" (CUDA graphs); needs compile=True.
        options: torch.compile's options: inductor's config (e.g. {"max_autotune": True}).
        dynamic: torch.compile's dynamic: None marks a size dynamic once it varies, True from the first call,
            False compiles a graph per shape (up to dynamo's recompile limit; past it graphamp warns).
        fullgraph: torch.compile's fullgraph: a graph break is an error instead of a split.
        checkpoint: activation checkpointing (torch.utils.checkpoint) of every submodule whose path matches this
            fnmatch pattern ("transformer.h.*"); checkpointing the model does itself is kept without it.

    Returns:
        `model` itself, converted: keep using it (and its optimizer) as before.
    """
    mode = _accept_deprecated(deprecated, mode)
    if is_rewritten(model):
        raise ArgumentError(
            f"this {type(model).__name__} was already rewritten by graphamp.rewrite(): it runs mixed precision as it "
            f"is; rewrite a fresh FP32 model to change its lists."
        )
    for name, value, allowed in (("compile", compile, "True or False"), ("fullgraph", fullgraph, "True or False"),
                                 ("dynamic", dynamic, "None, True or False")):
        if not (isinstance(value, bool) or (value is None and name == "dynamic")):
            raise ArgumentError(f"rewrite() got {name}={value!r}: pass {allowed}.")
    if mode is not None and not compile:
        raise ArgumentError(f"mode={mode!r} is inductor's: pass compile=True with it.")
    if options and not compile:
        raise ArgumentError(f"options={options!r} are inductor's: pass compile=True with them.")
    refuse_unknown_inductor_options(options, "rewrite(options=...)")
    if mode is not None and mode not in inductor_modes():
        modes = ", ".join(inductor_modes())
        raise ArgumentError(f"mode={mode!r} is not one of torch.compile's modes: use one of {modes}.")
    if mode is not None and options:
        raise ArgumentError(
            f"mode={mode!r} and options= both set inductor's settings, which torch.compile refuses: pass one (a mode's "
            f"settings are listed by torch._inductor.list_mode_options({mode!r}))."
        )
    example_args, example_kwargs, config = check_entry_arguments(
        "rewrite", model, example_args, example_kwargs, amp_lists, level, compile
    )
    _refuse_composable_checkpoint(model)
    refuse_fsdp2_param_dtype(model)
    settings = CompileSettings(compile, mode, dict(options or {}), dynamic, fullgraph)
    converted_before = dict(model.__dict__)
    checkpointed = _checkpoint_modules(model, checkpoint) if checkpoint is not None else []
    try:
        AmpState(model, config, settings).install()
        _lock_hook_tables(model, model._graphamp.lock)  # before any compile: dynamo guards on a table's type
        if example_args or example_kwargs:
            _compile_ahead(model, example_args, example_kwargs)
    except BaseException:  # Ctrl-C included: a rewrite that did not finish leaves the model as it was
        _undo_conversion(model, converted_before, checkpointed)
        raise
    return model


def rewritten_graphs(model: nn.Module) -> list[BackendGraph]:
    """The graphs graphamp rewrote for `model` so far, in the order dynamo compiled them: each with its
    `graph_module` (ATen, casts inserted), `report` (RewriteReport), `original_code` and `timings`.

    Args:
        model: a model graphamp.rewrite() converted, or the graphamp.backend(...) a model was compiled with.
    """
    if isinstance(model, AmpBackend):
        return list(model.graphs)
    if not is_rewritten(model):
        raise ArgumentError(
            f"rewritten_graphs() takes a model graphamp.rewrite() converted (or a graphamp.backend), got a "
            f"{type(model).__name__} that was not rewritten."
        )
    return list(model._graphamp.backend.graphs)


def rewritten_models(parameters) -> list[nn.Module]:
    """The live rewritten models that hold any of `parameters`."""
    wanted = {id(p) for p in parameters}
    return [m for m in list(_REWRITTEN) if any(id(p) in wanted for p in m.parameters())]


def link_copied_optimizer(optimizer) -> None:
    """Link a decorated optimizer copied with its model (pickle, deepcopy, torch.save of both) to the model's copy, as
    the original was linked: pickle tells no other way that the two were copied together than the parameters they
    share. A copy unpickled before the optimizer is linked now, one unpickled after it at its first call."""
    _COPIED_OPTIMIZERS.add(optimizer)
    for rewritten in rewritten_models(p for group in optimizer.param_groups for p in group["params"]):
        for state in amp_states(rewritten):
            if state.backend.linked_loss_scaling is None:
                state.backend.link_optimizer(optimizer)


def is_rewritten(model) -> bool:
    """Whether graphamp.rewrite() converted `model` (itself, not a module inside it)."""
    return isinstance(getattr(model, "_graphamp", None), AmpState)


def amp_states(module: nn.Module) -> list[AmpState]:
    """What rewrite() keeps on `module` and on each module inside it that it converted (none: an empty list)."""
    return [m._graphamp for m in module.modules() if is_rewritten(m)]


class AmpState:
    """What rewrite() keeps on the model as `model._graphamp`: the config, the torch.compile settings, the backend
    that holds the rewritten graphs and the optimizer link, and the eager policy's view of the model. Copies of the
    model carry it and install a fresh compile of their own."""

    def __init__(self, model: nn.Module, config: AmpConfig, settings: CompileSettings):
        self.model = model
        self.config = config
        self.settings = settings
        self.backend: AmpBackend | None = None
        self.rules = rules_for(config)
        self.model_facts = ModelFacts(model, config)
        self.warned_eager_call = False
        self.copied = False  # a copy links the optimizers copied with it at its first call
        # Dynamo keeps the torch-function mode stack of the thread it compiles in a process-wide slot: a call that
        # another thread makes meanwhile loses its modes, the eager policy with them, and runs float32. Calls of one
        # model from several threads run one at a time, and its modules' hook tables change between calls.
        self.lock = threading.RLock()

    def install(self) -> None:
        """Route the model's calls through torch.compile with a backend of its own (as nn.Module.compile)."""
        model = self.model
        linked = self.backend.linked_loss_scaling if self.backend is not None else None
        self.backend = AmpBackend(self.config, self.settings.inductor, model=model)
        self.backend.link_loss_scaling(linked)  # model.compile() makes a new backend: the link stays
        # First in the model's __dict__: unpickling rebuilds it in order and restores each bound method below as
        # getattr(new model, name), which finds the installed one only after _graphamp's __setstate__ installed it.
        model.__dict__["_graphamp"] = self
        model.__dict__["_compiled_call_impl"] = _AmpCall(self)
        # Dynamo, tracing a module call, inlines torch's own `_call_impl` and would skip `_compiled_call_impl`: with
        # a `_call_impl` of its own the model is called through `__call__`, which reaches _AmpCall.
        model.__dict__["_call_impl"] = types.MethodType(_call_impl, model)
        model.__dict__["compile"] = types.MethodType(compile, model)
        model.__dict__["__reduce_ex__"] = types.MethodType(__reduce_ex__, model)
        if callable(getattr(type(model), "get_encoder", None)):  # after _graphamp: unpickling finds this one
            model.__dict__["get_encoder"] = types.MethodType(get_encoder, model)
        _REWRITTEN.add(model)

    def compiled_call(self):
        """A torch.compile of the model's call with this model's backend, on a code object of its own."""
        return torch.compile(
            _fresh_call_module(), backend=self.backend, mode=self.settings.mode, options=self.settings.options or None,
            dynamic=self.settings.dynamic, fullgraph=self.settings.fullgraph, **_ISOLATED_RECOMPILES,
        )

    def eager_policy(self) -> EagerPolicy:
        """The lists as a runtime policy for this call (graphamp.auto_cast on this model); with float16 loss scaling
        linked by decorate(model=...), its casts across float16's edge scale the gradients as the graphs' edges do
        (training/eager_scaling.py)."""
        optimizer = self.backend.linked_optimizer if self.backend is not None else None
        scaled_casts = getattr(optimizer, "scaled_casts", None)
        scaling = scaled_casts(self.config.lists.dtype) if scaled_casts is not None else None
        return EagerPolicy(self.rules, self.model_facts, scaling=scaling)

    @staticmethod
    def returned(policy: EagerPolicy, result):
        """The call's result: float16 values of its eager code presented as float32 with the scale applied to their
        gradients, where the policy's casts scaled (as a graph's low outputs are)."""
        return result if policy.scaling is None or not policy.cast_low else policy.scaling.returned(result)

    def after_call(self, graph_runs_before: int, compiled_before: int, policy: EagerPolicy | None = None) -> None:
        backend = self.backend
        if policy is not None and policy.cast_low and policy.scaling is None and backend.graph_runs != graph_runs_before:
            self._warn_of_unscaled_eager_casts()
        if backend.graph_runs == graph_runs_before and not self.warned_eager_call:
            self.warned_eager_call = True
            ran = (f"graphamp: this call of {type(self.model).__name__} ran none of graphamp's graphs: dynamo ran its "
                   f"code eagerly, which graphamp's eager policy ran in mixed precision by the lists, at eager speed.")
            if dynamo_stance() != "default":
                why = (f"torch.compiler.set_stance({dynamo_stance()!r}) is in force, and dynamo runs the calls it "
                       f"does not compile eagerly; set_stance('default') compiles them again.")
            elif not backend.graphs:  # nothing compiled yet: no recompile limit to reach
                why = ("Dynamo has compiled no graph of it yet: a graph break it cannot resume from (`.item()` or "
                       "`float(tensor)` inside a module that nn.Sequential or a loop calls, as BatchNorm with "
                       "momentum=None does) runs the whole call eagerly; another thread compiling the model at the "
                       "same time is the other cause. TORCH_LOGS=graph_breaks names the break: code dynamo can trace "
                       "there lets the model compile; until then each call runs eagerly, mixed precision all the same.")
            else:
                why = (f"The usual cause is dynamo's recompile limit (torch._dynamo.config.recompile_limit="
                       f"{recompile_limit()}), reached by as many input signatures: new shapes with dynamic=False, "
                       f"or a Python argument taking many values; another thread compiling the model at the same "
                       f"time is the other. Fix: rewrite(..., dynamic=True) (one graph for every size), keep Python "
                       f"arguments fixed, or raise the limit; TORCH_LOGS=recompiles shows why it recompiled.")
            warnings.warn(f"{ran} {why}", stacklevel=4)
        if len(backend.graphs) != compiled_before:
            self.model_facts = ModelFacts(self.model, self.config)  # a module swap recompiles: see the new modules

    def _warn_of_unscaled_eager_casts(self) -> None:
        """Float16 ops the eager policy ran beside the graphs, where the loss scaling was linked by a function of the
        user's own (link_loss_scaling), not a decorated optimizer: it scales the gradients inside the graphs only,
        so theirs go unscaled (docs/backend.md)."""
        if self.backend.linked_loss_scaling is None or not torch.is_grad_enabled() or \
                self.config.lists.dtype != torch.float16:
            return  # every such call warns (Python's filters show it once per place unless told "always")
        warnings.warn(
            f"graphamp: this call of {type(self.model).__name__} ran float16 ops outside graphamp's graphs, where dynamo "
            f"ran its code eagerly (a frame it skips: a loop over blocks that break the graph), under graphamp's eager "
            f"policy. The loss scaling linked by link_loss_scaling() scales gradients inside the graphs only: theirs "
            f"are unscaled float16, and small ones underflow to 0. Fix: link a decorated optimizer "
            f"(graphamp.decorate(optimizer, lists, model=model)), whose scaling covers those ops too, or use bfloat16 "
            f"lists.", stacklevel=5,
        )

    def __getstate__(self) -> dict:
        # The graphs, the compiled code and the optimizer link belong to this model; a copy compiles its own.
        return {"model": self.model, "config": self.config, "settings": self.settings}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model"], state["config"], state["settings"])
        self.install()  # Module.__setstate__ runs after and keeps the compiled call (its state has none)
        self.copied = True


class _AmpCall:
    """The model's `_compiled_call_impl`: refuses an outer autocast, runs the compiled call under the eager policy."""

    def __init__(self, state: AmpState):
        self.state = state
        self.compiled = state.compiled_call()
        self.global_hooks = global_module_hooks()

    # A torch.compile around the model (Trainer(torch_compile=True), Lightning's) would trace into this call and have
    # its own backend compile the model without graphamp's casts: it breaks its graph here, and this call runs.
    @torch.compiler.disable
    def __call__(self, *args, **kwargs):
        state = self.state
        exporting = torch.compiler.is_exporting() and not exporting_elsewhere_for_graphamp()
        if exporting and this_thread_traces():
            # torch.export (export_program) traces the model's own FP32 code
            return call_module_with_hooks(state.model, *args, **kwargs)
        refuse_outer_autocast(
            itertools.chain(args, kwargs.values()), f"{type(state.model).__name__}, rewritten by graphamp, was called"
        )
        if exporting or dispatch_mode_makes_dynamo_run_eagerly():
            # Another thread exports (torch's flag is the process's; its tracer's modes too, which a compile here
            # would disturb), or dynamo would run this call eagerly and then mark the compiled code skipped for every
            # later call: the model's own code runs here, under the policy, and dynamo never sees the mode.
            with state.eager_policy() as policy:
                return state.returned(policy, call_module_with_hooks(state.model, *args, **kwargs))
        if state.copied:  # a copy's parameters are set by its first call: link the optimizers copied with it
            state.copied = False
            for optimizer in list(_COPIED_OPTIMIZERS):
                link_copied_optimizer(optimizer)
        hooks = global_module_hooks()
        if hooks != self.global_hooks:  # dynamo guards no global module hook its graphs did not see: compile anew
            self.global_hooks, self.compiled = hooks, state.compiled_call()
        try:
            with _interrupts_kept(), state.lock, state.eager_policy() as policy:
                runs, compiled = state.backend.graph_runs, len(state.backend.graphs)
                result = state.returned(policy, self.compiled(state.model, *args, **kwargs))
                state.after_call(runs, compiled, policy)
        except BackendCompilerFailed as error:
            inner = getattr(error, "inner_exception", None)
            if isinstance(inner, GraphampError):  # graphamp's own error, typed, not dynamo's wrapper of it
                inner.__suppress_context__ = True
                raise inner
            raise
        except RuntimeError as error:  # torch 2.11 guards no parameter dtype on some modules: a kernel met a `.half()` weight
            check_master_weights(state.model, CAST_AFTER)
            if op_without_fake_impl(error):  # dynamo's raw error: say which op and the fix, as export_program does
                raise CaptureError(explain_capture_failure(state.model, error)) from error
            raise
        return result


def get_encoder(module: nn.Module, *args, **kwargs) -> nn.Module:
    """HF's `model.get_encoder()` on a rewritten model: generate() calls an encoder-decoder's encoder by itself,
    outside the model's call, which would run it in FP32; a call of it by itself runs under the model's eager policy.
    Named as the attribute it is bound to (pickle saves a bound method by its name)."""
    encoder = type(module).get_encoder(module, *args, **kwargs)
    if isinstance(encoder, nn.Module) and encoder is not module:
        encoder.__dict__["_compiled_call_impl"] = _EncoderCall(module._graphamp, encoder)
    return encoder


class _EncoderCall:
    """The `_compiled_call_impl` get_encoder() gives the encoder. Dynamo, tracing the model, inlines the encoder's
    `_call_impl` and never calls it; in a model call run eagerly the policy nests, deciding each op alike."""

    def __init__(self, state: AmpState, encoder: nn.Module):
        self.state, self.encoder = state, encoder

    def __call__(self, *args, **kwargs):
        with self.state.lock, self.state.eager_policy() as policy:  # the policy refuses an outer autocast itself
            return self.state.returned(policy, call_module_with_hooks(self.encoder, *args, **kwargs))


def __reduce_ex__(module: nn.Module, protocol: int):
    """copy.copy(model) of a rewritten model: a converted model of its own that shares the parameters, buffers and
    submodules, as a shallow copy does (nn.Module's default would keep the original's call, bound to the original).
    deepcopy, pickle and torch.save take the usual path (AmpState installs itself on the copy). Named as the
    attribute it is bound to; copy.copy looks it up on the instance."""
    if sys._getframe(1).f_code is copy.copy.__code__:
        state = module._graphamp
        shared = {k: v for k, v in module.__dict__.items() if k not in _INSTALLED}
        return _shallow_copy, (type(module), shared, state.config, state.settings)
    return object.__reduce_ex__(module, protocol)


def _shallow_copy(cls: type, shared: dict, config: AmpConfig, settings: CompileSettings) -> nn.Module:
    model = cls.__new__(cls)
    model.__setstate__(dict(shared))
    AmpState(model, config, settings).install()
    return model


def compile(module: nn.Module, *args, backend="inductor", mode=None, options=None, dynamic=None, fullgraph=False,
            **kwargs) -> None:
    """`model.compile(...)` on a rewritten model: graphamp stays, and its graphs are compiled by inductor with
    torch.compile's mode, options, dynamic and fullgraph (rewrite(..., compile=True) on the same lists). Named as the
    attribute it is bound to (pickle saves a bound method by its name)."""
    state = module._graphamp
    if args or kwargs or backend not in ("inductor", "graphamp"):
        raise ArgumentError(
            f"{type(module).__name__} was rewritten by graphamp: its calls already run through torch.compile with "
            f"graphamp's backend, and model.compile(backend={backend!r}) would replace it with a compile that knows "
            f"nothing of graphamp's lists. Fix: model.compile() or model.compile(mode=..., options=...) compiles "
            f"graphamp's graphs with inductor; for another backend, compile a model that was not rewritten."
        )
    options = dict(options or {})
    if any(key in options for key in GRAPHAMP_OPTIONS):
        raise ArgumentError(
            f"model.compile(options=...) got graphamp's list options ({', '.join(k for k in options if k in GRAPHAMP_OPTIONS)}) "
            f"on a model rewritten with its own lists: rewrite a fresh FP32 model to change its lists."
        )
    refuse_unknown_inductor_options(options, "model.compile(options=...)")
    state.settings = CompileSettings(True, mode, options, dynamic, fullgraph)
    state.install()


# What AmpState.install() sets on the model.
_INSTALLED = ("_compiled_call_impl", "_call_impl", "compile", "__reduce_ex__", "get_encoder", "_graphamp")


@contextlib.contextmanager
def _interrupts_kept():
    """A Ctrl-C that lands where Python ignores exceptions (a weakref callback or a __del__, of which a first call's
    compile runs many) still reaches the caller, after the call. Main thread, default SIGINT handler only."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pressed = []

    def interrupt(signum, frame):
        pressed.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


def _call_impl(module: nn.Module, *args, **kwargs):
    """nn.Module's own `_call_impl`, as another function object (see AmpState.install). Named as the attribute it
    is bound to, and kept apart from `_call_module`: pickle saves a bound method as getattr(model, its name)."""
    return call_module_with_hooks(module, *args, **kwargs)


def _call_module(module: nn.Module, *args, **kwargs):
    """The frame dynamo compiles: a module's own call, hooks included. Not `module._call_impl` itself, which
    torch's own modules (nn.Sequential, nn.Linear) would leave uncompiled: dynamo skips frames in torch.nn."""
    return call_module_with_hooks(module, *args, **kwargs)


class _HookTable(OrderedDict):
    """A module's hook table that changes under its model's call lock. Dynamo reads the tables of the modules a call
    runs when it traces the call and again, by position, when it builds that call's guards: a hook registered or
    removed by another thread in between failed the call (an IndexError in dynamo's guard code). Copies are plain."""

    lock = contextlib.nullcontext()  # a table made by copy() or `|`, not by _lock_hook_tables

    def __reduce__(self):
        return OrderedDict, (), None, None, iter(self.items())


def _under_lock(change):
    @functools.wraps(change)
    def locked(table, *args, **kwargs):
        with table.lock:
            return change(table, *args, **kwargs)
    return locked


for _change in ("__setitem__", "__delitem__", "__ior__", "move_to_end", "pop", "popitem", "clear", "update",
                "setdefault"):
    setattr(_HookTable, _change, _under_lock(getattr(OrderedDict, _change)))

_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def _lock_hook_tables(model: nn.Module, lock) -> None:
    """Every empty hook table that dynamo reads (and guards on) in the model's modules becomes a _HookTable changed
    under `lock`. A table that already holds hooks stays the dict it is: their handles remove them from that dict.
    Where dynamo cannot trace such a table (torch 2.11), the tables stay plain: hooks that another thread registers
    while a call compiles can then fail that call, as they would under torch.compile alone."""
    if not dynamo_traces_hook_table_subclasses():
        return
    for module in model.modules():
        for name in _HOOK_TABLES:
            table = module.__dict__.get(name)
            if type(table) is OrderedDict and not table:
                table = module.__dict__[name] = _HookTable()
                table.lock = lock


def _fresh_call_module():
    """`_call_module` with a code object of its own, named apart: dynamo keeps its cache and recompile limit per code
    object, and its automatic-dynamic record of input sizes per (file, line, name)."""
    name = f"_call_module_{next(_models_compiled)}"
    code = _call_module.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):  # Python 3.11+
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, _call_module.__globals__, name)


def _compile_ahead(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """One call on the examples, so that dynamo and graphamp capture now; buffers (written in place or reassigned),
    the examples (a forward's `x.sub_(mean)` writes the caller's tensor) and random state restored. An example the
    model's own FP32 code cannot run is an ArgumentError."""
    buffers = [(module, name, buffer, buffer.detach().clone())
               for module in model.modules() for name, buffer in module_buffers(module).items() if buffer is not None]
    examples = [(tensor, tensor_version(tensor), tensor.detach().clone()) for tensor in pytree.tree_leaves((args, kwargs))
                if isinstance(tensor, torch.Tensor) and not tensor.is_inference()]
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        with torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    except Exception:
        refuse_examples_that_do_not_fit("rewrite()'s", model, args, kwargs)
        raise
    finally:
        _end_fsdp2_iteration(model)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        with torch.no_grad():
            for module, name, buffer, saved in buffers:
                module_buffers(module)[name] = buffer  # a forward that reassigns a buffer (self.steps = self.steps + 1)
                buffer.copy_(saved)
            for tensor, version, saved in examples:
                if tensor_version(tensor) != version:
                    tensor.copy_(saved)


def _end_fsdp2_iteration(model: nn.Module) -> None:
    """The examples' call is a forward no backward follows, and FSDP2 reshards its root group after backward only:
    the optimizer built next would hold the root's unsharded parameters, which it then neither steps nor zeroes
    (docs/distributed.md). FSDP2's own reset puts the sharded ones back: `reset_iter_state()` on each root (torch
    2.13 has it; not checked on 2.11), else each module's `reshard()`."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    def roots(module: nn.Module):
        if isinstance(module, FSDPModule):
            yield module
        else:
            for child in module.children():
                yield from roots(child)

    for root in roots(model):
        if hasattr(root, "reset_iter_state"):
            root.reset_iter_state()
        else:
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


def _undo_conversion(model: nn.Module, before: dict, checkpointed: list[tuple[nn.Module, object]]) -> None:
    """Put back what rewrite() set on the model (call, `compile`, `_graphamp`, hook tables, checkpointed forwards)."""
    for module in model.modules():
        module.__dict__.update({k: OrderedDict(v) for k, v in vars(module).items() if type(v) is _HookTable})
    for name in _INSTALLED:
        model.__dict__.pop(name, None)
    model.__dict__.update({name: before[name] for name in _INSTALLED if name in before})
    for module, forward in checkpointed:
        module.__dict__.pop("forward", None)
        if forward is not None:
            module.forward = forward
    _REWRITTEN.discard(model)


def _checkpoint_modules(model: nn.Module, pattern: str) -> list[tuple[nn.Module, object]]:
    """torch.utils.checkpoint around the forward of every submodule matching `pattern` (kept through copies);
    returns each module with the instance forward it had (None if its class's)."""
    from torch.utils.checkpoint import checkpoint

    if not isinstance(pattern, str):
        raise ArgumentError(f"checkpoint={pattern!r}: pass one module path or glob, e.g. 'transformer.h.*'.")
    matched = [name for name, _ in model.named_modules() if name and fnmatch.fnmatchcase(name, pattern)]
    if not matched:
        names = [name for name, _ in model.named_modules() if name][:8]
        raise ArgumentError(
            f"checkpoint={pattern!r} matches no submodule of {type(model).__name__}; module paths look like "
            f"{', '.join(names)}."
        )
    # The outermost matches only: fnmatch's * crosses dots, so "transformer.h.*" also matches every module inside
    # a block, and a checkpoint inside a checkpoint recomputes twice for nothing.
    outermost = [name for name in matched if not any(name.startswith(outer + ".") for outer in matched)]
    checkpointed = []
    for name in outermost:
        module = model.get_submodule(name)
        checkpointed.append((module, module.__dict__.get("forward")))
        # module.forward, not the class's: an instance forward (accelerate's hooks set one) stays inside.
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
    return checkpointed


def _refuse_composable_checkpoint(model: nn.Module) -> None:
    """torch.distributed's checkpoint(module) works by hooks that dynamo runs outside the graphs: backward
    recomputes the module eagerly, in float32, where its forward ran graphamp's casts, and fails with a
    CheckpointError (as it does under plain torch.compile)."""
    for name, module in model.named_modules():
        if "checkpoint" in composable_apis_on(module):
            raise ArgumentError(
                f"'{name or type(model).__name__}' is checkpointed by torch.distributed's checkpoint(module), whose "
                f"recomputation runs outside torch.compile's graphs and cannot repeat graphamp's casts. Fix: "
                f"checkpoint it inside the graph instead: graphamp.rewrite(model, ..., checkpoint='{name or '*'}') "
                f"(a pattern such as 'layers.*' takes every block), torch.utils.checkpoint in forward, or "
                f"checkpoint_wrapper (torch.distributed.algorithms._checkpoint.checkpoint_wrapper)."
            )


def _accept_deprecated(deprecated: dict, mode: str | None) -> str | None:
    """The arguments of the export-based rewrite(): accepted for this release with a DeprecationWarning that
    says what replaces each; `compile_mode` still sets the mode."""
    for name, value in deprecated.items():
        if name == "compile_mode":
            warnings.warn("rewrite(compile_mode=...) is now rewrite(mode=...), torch.compile's own argument.",
                          DeprecationWarning, stacklevel=3)
            mode = mode if mode is not None else value
        elif name in _DEPRECATED:
            warnings.warn(f"rewrite({name}=...) is ignored since graphamp 0.3 and goes in 0.4: {_DEPRECATED[name]}.",
                          DeprecationWarning, stacklevel=3)
        else:
            raise ArgumentError(f"rewrite() got an unexpected keyword argument {name!r}.")
    return mode
