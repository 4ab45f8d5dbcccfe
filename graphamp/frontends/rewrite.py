"""rewrite(): the user's model converted in place to train in mixed precision under torch.compile.

As `nn.Module.compile` does, the model's call goes through torch.compile, here with graphamp's backend: dynamo
captures each graph (guards, graph breaks, recompiles and hooks keep eager semantics), graphamp's passes cast it
by the lists, inductor compiles it (or, with compile=False, the rewritten graph runs as fx code). The model stays
the user's object: its class, `state_dict()` keys, hooks, `.data` writes, `generate()` and `save_pretrained` are
its own, and copies (deepcopy, pickle, torch.save) stay converted. What graphamp keeps on it is `model._graphamp`.

Where code runs outside graphamp's graphs, graphamp says so (docs/backend.md, "Outside the graphs"): a call that
ran no graph at all (dynamo's recompile limit) warns, and the call after each new compile is audited once for
white-list ops that ran eagerly in float32 (a module dynamo skips, code under torch.compiler.disable).
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import types
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from graphamp.errors import ArgumentError, GraphampError
from graphamp.frontends.compile_backend import AmpBackend, BackendGraph, refuse_outer_autocast
from graphamp.frontends.eager_audit import SHARED_RECOMPILE_LIMIT_HINT, TORCH_ISOLATES_RECOMPILES, EagerAudit
from graphamp.policy.config import AmpConfig, check_entry_arguments, check_master_weights

__all__ = ["AmpState", "rewrite", "rewritten_graphs", "rewritten_models"]

_models_compiled = itertools.count()
_GLOBAL_HOOK_TABLES = tuple(
    name for name, table in vars(module_globals).items() if name.startswith("_global_") and isinstance(table, dict)
)

# The models rewrite() converted and that are alive: decorate() links an optimizer to those holding its parameters.
_REWRITTEN: weakref.WeakSet = weakref.WeakSet()

# Dynamo keeps its graphs, and counts its recompile limit, per code object: shared by every rewritten model, past 8
# models a new one would run eagerly in float32. Each model compiles a code object of its own (_fresh_call_module),
# and where torch has it (>= 2.13) its own cache for the frames after a graph break (its class's forward code).
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
    if mode is not None and not compile:
        raise ArgumentError(f"mode={mode!r} is inductor's: pass compile=True with it.")
    example_args, example_kwargs, config = check_entry_arguments(
        "rewrite", model, example_args, example_kwargs, amp_lists, level, compile
    )
    _refuse_composable_checkpoint(model)
    if checkpoint is not None:
        _checkpoint_modules(model, checkpoint)
    settings = CompileSettings(compile, mode, dict(options or {}), dynamic, fullgraph)
    AmpState(model, config, settings).install()
    if example_args or example_kwargs:
        _compile_ahead(model, example_args, example_kwargs)
    return model


def rewritten_graphs(model: nn.Module) -> list[BackendGraph]:
    """The graphs graphamp rewrote for `model` so far, in the order dynamo compiled them: each with its
    `graph_module` (ATen, casts inserted), `report` (RewriteReport), `original_code` and `timings`.

    Args:
        model: a model graphamp.rewrite() converted, or the graphamp.backend(...) a model was compiled with.
    """
    if isinstance(model, AmpBackend):
        return list(model.graphs)
    state = getattr(model, "_graphamp", None)
    if not isinstance(state, AmpState):
        raise ArgumentError(
            f"rewritten_graphs() takes a model graphamp.rewrite() converted (or a graphamp.backend), got a "
            f"{type(model).__name__} that was not rewritten."
        )
    return list(state.backend.graphs)


def rewritten_models(parameters) -> list[nn.Module]:
    """The live rewritten models that hold any of `parameters`."""
    wanted = {id(p) for p in parameters}
    return [m for m in list(_REWRITTEN) if any(id(p) in wanted for p in m.parameters())]


class AmpState:
    """What rewrite() keeps on the model as `model._graphamp`: the config, the torch.compile settings and the
    backend that holds the rewritten graphs and the optimizer link. Copies of the model carry it and install a
    fresh compile of their own."""

    def __init__(self, model: nn.Module, config: AmpConfig, settings: CompileSettings):
        self.model = model
        self.config = config
        self.settings = settings
        self.backend: AmpBackend | None = None
        self.audit = EagerAudit(config.lists)
        self.warned_eager_call = False

    def install(self) -> None:
        """Route the model's calls through torch.compile with a backend of its own (as nn.Module.compile)."""
        model = self.model
        self.backend = AmpBackend(self.config, self.settings.inductor, model=model)
        model.__dict__["_compiled_call_impl"] = _AmpCall(self)
        # Dynamo, tracing a module call, inlines torch's own `_call_impl` and would skip `_compiled_call_impl`: with
        # a `_call_impl` of its own the model is called through `__call__`, which reaches _AmpCall.
        model.__dict__["_call_impl"] = types.MethodType(_call_impl, model)
        model.__dict__["_graphamp"] = self
        _REWRITTEN.add(model)

    def compiled_call(self):
        """A torch.compile of the model's call with this model's backend, on a code object of its own."""
        return torch.compile(
            _fresh_call_module(), backend=self.backend, mode=self.settings.mode, options=self.settings.options or None,
            dynamic=self.settings.dynamic, fullgraph=self.settings.fullgraph, **_ISOLATED_RECOMPILES,
        )

    def link_optimizer(self, optimizer) -> None:
        self.backend.link_optimizer(optimizer)

    def after_call(self, graph_runs_before: int, compiled_before: int) -> None:
        backend = self.backend
        if backend.graph_runs == graph_runs_before and not self.warned_eager_call:
            self.warned_eager_call = True
            warnings.warn(
                f"graphamp: this call of {type(self.model).__name__} ran none of graphamp's graphs: dynamo ran it "
                f"eagerly, in float32. The usual cause is dynamo's recompile limit "
                f"(torch._dynamo.config.recompile_limit={torch._dynamo.config.recompile_limit}), reached by as many "
                f"input signatures: new shapes with dynamic=False, or a Python argument taking many values. Fix: "
                f"rewrite(..., dynamic=True) (one graph for every size), keep Python arguments fixed, or raise the "
                f"limit; TORCH_LOGS=recompiles shows why it recompiled.{SHARED_RECOMPILE_LIMIT_HINT}",
                stacklevel=4,
            )
        if len(backend.graphs) != compiled_before:
            self.audit.due = True  # the next call runs the new graphs: look once at what runs outside them
            check_master_weights(self.model)  # a parameter's dtype is guarded on: `.half()` since makes new graphs

    def __getstate__(self) -> dict:
        # The graphs, the compiled code and the optimizer link belong to this model; a copy compiles its own.
        return {"model": self.model, "config": self.config, "settings": self.settings}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model"], state["config"], state["settings"])
        self.install()  # Module.__setstate__ runs after and keeps the compiled call (its state has none)


class _AmpCall:
    """The model's `_compiled_call_impl`: refuses an outer autocast, runs the compiled call, notices eager calls."""

    def __init__(self, state: AmpState):
        self.state = state
        self.compiled = state.compiled_call()
        self.global_hooks = _global_hooks()

    # A torch.compile around the model (Trainer(torch_compile=True), Lightning's) would trace into this call and have
    # its own backend compile the model without graphamp's casts: it breaks its graph here, and this call runs.
    @torch.compiler.disable
    def __call__(self, *args, **kwargs):
        state = self.state
        if torch.compiler.is_exporting():  # torch.export (export_program) traces the model's own FP32 code
            return state.model._call_impl(*args, **kwargs)
        refuse_outer_autocast(
            itertools.chain(args, kwargs.values()), f"{type(state.model).__name__}, rewritten by graphamp, was called"
        )
        hooks = _global_hooks()
        if hooks != self.global_hooks:  # dynamo guards no global module hook its graphs did not see: compile anew
            self.global_hooks, self.compiled = hooks, state.compiled_call()
        backend = state.backend
        runs, compiled = backend.graph_runs, len(backend.graphs)
        try:
            if state.audit.due:
                with state.audit.watching(backend, type(state.model).__name__):
                    result = self.compiled(state.model, *args, **kwargs)
            else:
                result = self.compiled(state.model, *args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            inner = getattr(error, "inner_exception", None)
            if isinstance(inner, GraphampError):  # graphamp's own error, typed, not dynamo's wrapper of it
                inner.__suppress_context__ = True
                raise inner
            raise
        state.after_call(runs, compiled)
        return result


def _call_impl(module: nn.Module, *args, **kwargs):
    """nn.Module's own `_call_impl`, as another function object (see AmpState.install). Named as the attribute it
    is bound to, and kept apart from `_call_module`: pickle saves a bound method as getattr(model, its name)."""
    return nn.Module._call_impl(module, *args, **kwargs)


def _call_module(module: nn.Module, *args, **kwargs):
    """The frame dynamo compiles: a module's own call, hooks included. Not `module._call_impl` itself, which
    torch's own modules (nn.Sequential, nn.Linear) would leave uncompiled: dynamo skips frames in torch.nn."""
    return nn.Module._call_impl(module, *args, **kwargs)


def _global_hooks() -> tuple:
    """The handles of the global module hooks (register_module_forward_hook and the like) now registered."""
    return tuple(tuple(getattr(module_globals, table)) for table in _GLOBAL_HOOK_TABLES)


def _fresh_call_module():
    """`_call_module` with a code object of its own, named apart: dynamo keeps its cache and recompile limit per code
    object, and its automatic-dynamic record of input sizes per (file, line, name)."""
    name = f"_call_module_{next(_models_compiled)}"
    code = _call_module.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):  # Python 3.11+
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, _call_module.__globals__, name)


def _compile_ahead(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """One call on the examples, so that dynamo and graphamp capture now; buffers and random state restored."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    with torch.random.fork_rng(devices=[]):
        model(*args, **kwargs)
    if cuda_states is not None:
        torch.cuda.set_rng_state_all(cuda_states)
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)


def _checkpoint_modules(model: nn.Module, pattern: str) -> None:
    """torch.utils.checkpoint around the forward of every submodule matching `pattern` (kept through copies)."""
    from torch.utils.checkpoint import checkpoint

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
    for name in outermost:
        module = model.get_submodule(name)
        # module.forward, not the class's: an instance forward (accelerate's hooks set one) stays inside.
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)


def _refuse_composable_checkpoint(model: nn.Module) -> None:
    """torch.distributed's checkpoint(module) works by hooks that dynamo runs outside the graphs: backward
    recomputes the module eagerly, in float32, where its forward ran graphamp's casts, and fails with a
    CheckpointError (as it does under plain torch.compile)."""
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:
        return
    for name, module in model.named_modules():
        if "checkpoint" in (_get_registry(module) or {}):
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
