"""graphamp as a torch.compile backend: dynamo captures, graphamp's lists and passes decide the dtypes.

Each graph is lowered to ATen (lowering.py), goes through the passes and is compiled by inductor (or run as fx
code): docs/how_it_works.md, "The training front end"; docs/backend.md for the ways to reach it.
"""

from __future__ import annotations

import difflib
import time
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch.amp.autocast_mode import is_autocast_available
from torch.fx import GraphModule

from graphamp.errors import ArgumentError, DoubleAmpError
from graphamp.frontends.eager_policy import policy_lifted
from graphamp.frontends.lowering import to_aten
from graphamp.frontends.low_storage import LowStorageTensor, graph_inputs, presented_as_float32
from graphamp.frontends.module_paths import ModulePaths
from graphamp.passes import run_passes
from graphamp.passes.cast_pass import RewriteReport
from graphamp.policy.config import CAST_AFTER, AmpConfig, check_module, refuse_half_parameters
from graphamp.policy.dtypes import HALF_DTYPES, dtype_name
from graphamp.policy.lists import AutoMixedPrecisionLists
from graphamp.torch_private import (
    ENTER_AUTOCAST, EXIT_AUTOCAST, compile_with_inductor, fsdp2_param_dtypes, generate_code_now, inductor_options,
    set_dynamo_config, torch_function_off,
)

__all__ = [
    "GRAPHAMP_OPTIONS", "LIST_OPTIONS", "AmpBackend", "BackendGraph", "GraphRunner", "backend", "configure_dynamo",
    "refuse_fsdp2_param_dtype", "refuse_outer_autocast", "refuse_unknown_inductor_options",
]

# The one link between the graphs and training: run one graph, `run(*args)`, with loss scaling inside, and return its
# outputs. graphamp.training makes it (OptimizerWithMixedPrecision.run_graph_scaled); the backend only calls it.
GraphRunner = Callable[[Callable, tuple], Any]
_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
_RUNNABLE = "graphamp_runnable"  # a checkpointed body's meta: the copy of it that runs (checkpointed_region)

# torch.compile's options that are graphamp's, not inductor's (named_backend.py reads them; a rewritten model refuses
# them in model.compile()).
LIST_OPTIONS = ("custom_white_list", "custom_black_list", "custom_gray_list", "custom_black_modules", "lists_dir")
GRAPHAMP_OPTIONS = ("amp_lists", "dtype", "level", *LIST_OPTIONS)


def backend(
    amp_lists: AutoMixedPrecisionLists | None = None,
    level: str = "O1",
    inductor: bool = True,
    inductor_options: dict | None = None,
    model: torch.nn.Module | None = None,
) -> AmpBackend:
    """A torch.compile backend that runs each captured graph in mixed precision by graphamp's lists.

    Args:
        amp_lists: the lists that decide each ATen op's dtype (default: the shipped lists in float16).
        level: 'O1' (the lists decide) or 'O2' (all but black ops run low; normalization weights stay FP32).
        inductor: compile each rewritten graph with inductor (the default); False runs the rewritten fx code
            as it is (no compile: eager speed, and a TorchDispatchMode sees every kernel and its dtypes).
        inductor_options: inductor config patches, merged under those torch.compile's `options=` passes.
        model: the whole model, when you compile parts of it (its blocks one at a time, FSDP2's recipe): module
            paths are then the model's, as black-module patterns are written. Without it they are those of the
            module torch.compile got (a framework wrapper's attribute in front, DDP's `module.`, is dropped).

    Returns:
        An AmpBackend: pass it as `torch.compile(model, backend=..., mode=..., options=...)`; its `graphs` hold each
        graph's rewrite and `graphamp.export(it, folder)` writes them.
    """
    if inductor_options and not inductor:
        raise ArgumentError("backend(inductor_options=...) are inductor's: pass inductor=True with them, or drop them.")
    refuse_unknown_inductor_options(inductor_options, "backend(inductor_options=...)")
    config = AmpConfig(amp_lists if amp_lists is not None else AutoMixedPrecisionLists(), level)
    if model is not None:
        check_module(model, "backend(model=...)")
        config.lists.warn_unmatched_black_modules(model, stacklevel=3)
    return AmpBackend(config, inductor, inductor_options, model)


def refuse_unknown_inductor_options(options: dict | None, argument: str) -> None:
    """torch.compile refuses an unknown inductor option at once; a backend of one's own gets it unchecked, and
    inductor would fail on it only at the first call, after the capture."""
    if not options:
        return
    known = inductor_options()
    for key in (key for key in options if key not in known):
        close = difflib.get_close_matches(str(key), known, n=3)
        fix = f"did you mean {', '.join(map(repr, close))}?" if close else "drop it."
        if key in GRAPHAMP_OPTIONS:
            fix = "it is graphamp's: pass amp_lists=graphamp.AutoMixedPrecisionLists(...) or level= instead."
        raise ArgumentError(f"{argument} got {key!r}, which is not one of inductor's options "
                            f"(torch._inductor.list_options()); {fix}")


@dataclass
class BackendGraph:
    """One graph dynamo handed over, as the passes left it."""

    graph_module: GraphModule  # pre-autograd ATen, casts inserted: what inductor compiled (or what runs)
    report: RewriteReport
    original_code: str  # the ATen graph before the passes (export's diff.txt)
    parameter_placeholders: dict[str, str]  # placeholder name -> the parameter's or buffer's path in the model
    timings: dict = field(default_factory=dict)  # phase -> seconds: lower to ATen, passes, inductor
    runs: int = 0


class AmpBackend:
    """The backend object: `__call__(gm, example_inputs, mode=None, options=None)` is dynamo's compiler_fn
    contract. Make it with graphamp.backend(); rewrite() makes one per model."""

    def __init__(self, config: AmpConfig, inductor: bool = True, inductor_options: dict | None = None,
                 model: torch.nn.Module | None = None):
        self.config = config
        self.inductor = inductor
        self.inductor_options = dict(inductor_options or {})
        self.graphs: list[BackendGraph] = []
        self.graph_runs = 0  # every run of every graph: rewrite() tells a call that ran none of them
        self._link = None  # () -> the linked GraphRunner, or None
        self._module_paths = ModulePaths(config, model)
        configure_dynamo()

    @property
    def amp_lists(self) -> AutoMixedPrecisionLists:
        return self.config.lists

    @property
    def level(self) -> str:
        return self.config.level

    @property
    def reports(self) -> list[RewriteReport]:
        """Each rewritten graph's RewriteReport, in the order dynamo compiled them (recompiles add more)."""
        return [graph.report for graph in self.graphs]

    @property
    def linked_loss_scaling(self) -> GraphRunner | None:
        """The function that runs each graph with loss scaling inside (see `link_loss_scaling`), or None."""
        return self._link() if self._link is not None else None

    @property
    def linked_optimizer(self):
        """The decorated optimizer whose `run_graph_scaled` is linked, or None."""
        run_scaled = self.linked_loss_scaling
        return run_scaled.__self__ if isinstance(run_scaled, types.MethodType) else None

    def link_loss_scaling(self, run_scaled: GraphRunner | None) -> None:
        """Run every graph through `run_scaled(run, args)` while autograd is on, so that a plain `loss.backward()`
        (any training loop) leaves true FP32 gradients in `.grad`; None unlinks. One link per backend: the latest
        wins. `decorate(optimizer, lists, model=model)` links `optimizer.run_graph_scaled` so.

        Args:
            run_scaled: `(run, args) -> outputs`, e.g. a decorated optimizer's `run_graph_scaled`. A bound method
                is held weakly (the link ends with its optimizer); another callable is held as it is.
        """
        if run_scaled is not None and not callable(run_scaled):
            raise ArgumentError(f"link_loss_scaling() takes a function (run, args) -> outputs, got a "
                                f"{type(run_scaled).__name__}: pass a decorated optimizer's run_graph_scaled.")
        if isinstance(run_scaled, types.MethodType):
            self._link = weakref.WeakMethod(run_scaled)
        else:
            self._link = None if run_scaled is None else (lambda: run_scaled)

    def link_optimizer(self, optimizer) -> None:
        """Scale gradients inside every graph by this decorated optimizer's loss scaling (for a backend of one's
        own): `link_loss_scaling(optimizer.run_graph_scaled)`, as training/in_graph_scaling.py describes. One
        optimizer per backend: give each model its own backend. `rewrite()` links itself at `decorate(..., model=...)`.

        Args:
            optimizer: what `graphamp.decorate()` returned (the latest link wins).
        """
        run_scaled = getattr(optimizer, "run_graph_scaled", None)  # OptimizerWithMixedPrecision's public method
        if not callable(run_scaled):
            raise ArgumentError(
                f"link_optimizer() takes the optimizer graphamp.decorate() returns, got {type(optimizer).__name__}: "
                f"decorate it first."
            )
        self.link_loss_scaling(run_scaled)

    def __call__(self, gm: GraphModule, example_inputs: list, mode: str | None = None, options: dict | None = None):
        with policy_lifted():  # lowering and inductor trace the graph as dynamo captured it, never cast eagerly
            return self._compile(gm, example_inputs, mode, options)

    def _refuse_half_parameters(self, example_inputs: list) -> None:
        """Dynamo guards on a parameter's dtype: a model cast by `.half()` after its conversion compiles anew, and
        the graph must not run (its kernels would fail on the mixed dtypes, or train without master weights)."""
        half = [v for v in example_inputs if isinstance(v, torch.nn.Parameter) and v.dtype in HALF_DTYPES]
        paths = self._module_paths
        if half and paths.model is not None:  # fully_shard(..., mp_policy=...) after rewrite(): not a cast of the user's
            refuse_fsdp2_param_dtype(paths.model)
        named = ((paths.state_path(p) or f"<one of shape {tuple(p.shape)}>", p) for p in half)
        refuse_half_parameters(named, CAST_AFTER)

    def _compile(self, gm: GraphModule, example_inputs: list, mode: str | None, options: dict | None):
        refuse_unknown_inductor_options(options, "torch.compile(options=...)")
        refuse_outer_autocast(example_inputs, "graphamp was asked to compile a graph")
        refuse_autocast_inside(gm)
        self._refuse_half_parameters(example_inputs)
        timings = {}
        start = time.perf_counter()
        aten_graph, traced_inputs = to_aten(gm, example_inputs, len(self.graphs))
        paths = self._module_paths.name_graph(gm, aten_graph, example_inputs)
        original_code = aten_graph.print_readable(print_output=False)
        timings["lower to ATen"] = time.perf_counter() - start
        start = time.perf_counter()
        report = run_passes(aten_graph, paths.config, frozenset(paths.state), timings, outputs_stay_low=True)
        timings["passes"] = time.perf_counter() - start
        graph = BackendGraph(aten_graph, report, original_code, paths.state, timings)
        self.graphs.append(graph)
        reuse_check = paths.reuse_check
        if not self.inductor:
            # Its code as a function, not a module call: global module hooks (register_module_forward_hook) would
            # otherwise fire on graphamp's GraphModule, a module eager never calls.
            runnable = _checkpoints_keeping_the_random_state(aten_graph)
            generate_code_now(runnable)
            return self._runner(graph, runnable.forward, reuse_check)
        start = time.perf_counter()
        # Another graph's low outputs go in as their storage, faked as to_aten traced them (their sizes are the inputs')
        inputs = [traced if isinstance(v, LowStorageTensor) else v for v, traced in zip(example_inputs, traced_inputs)]
        compiled = compile_with_inductor(aten_graph, inputs, mode, {**self.inductor_options, **(options or {})})
        timings["inductor"] = time.perf_counter() - start
        return self._runner(graph, compiled, reuse_check)

    def _runner(self, graph: BackendGraph, run, reuse_check=None):
        def as_the_caller_sees_it(*args):
            # Another graph's low outputs go in as their storage (to_aten); the low outputs come out as float32.
            return _presented(run(*graph_inputs(args)), graph.report.outputs_kept_low)

        def call(*args):
            if reuse_check is not None:
                reuse_check(args)
            self.graph_runs += 1
            graph.runs += 1
            self._module_paths.graph_ran(graph.runs)
            run_scaled = self.linked_loss_scaling
            # The graph holds its casts: graphamp's eager policy leaves its calls alone, and no torch-function mode
            # sees the fx code's ATen calls one by one (dynamo traced the modes; inductor's kernels skip them too).
            with policy_lifted(), torch_function_off():
                if run_scaled is None or not torch.is_grad_enabled():
                    return as_the_caller_sees_it(*args)
                # The loss scaling inside the graph (training/in_graph_scaling), around the float32 the caller sees:
                # a gradient is scaled in float32 before it is cast low, as the loss is before autocast's casts.
                return run_scaled(as_the_caller_sees_it, args)

        return call

    def __getstate__(self) -> dict:
        """A pickled backend (torch.save of a compiled model) keeps its configuration; graphs and link are remade."""
        return {**self.__dict__, "graphs": [], "graph_runs": 0, "_link": None,
                "_module_paths": ModulePaths(self.config)}

    def __repr__(self) -> str:
        return (
            f"graphamp.backend(dtype={self.amp_lists.dtype_name}, level={self.level}, inductor={self.inductor}, "
            f"graphs={len(self.graphs)})"
        )


def _checkpoints_keeping_the_random_state(graph_module: GraphModule) -> GraphModule:
    """What runs as fx code. The tag_activation_checkpoint op calls torch.utils.checkpoint with preserve_rng_state
    off (inductor functionalizes the random state; fx code has no one to), so backward's recompute drew other dropout
    masks than the forward and the gradients were wrong: a copy of the graph calls torch.utils.checkpoint as eager
    code does, and the graph itself stays as the pass left it, for inspection."""
    if not graph_module.graph.find_nodes(op="call_function", target=_CHECKPOINT):
        return graph_module
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    for node in graph.find_nodes(op="call_function", target=_CHECKPOINT):
        node.target = checkpointed_region
    return GraphModule(graph_module, graph)


def checkpointed_region(body: GraphModule, *args, **kwargs):
    """A checkpointed region of a rewritten graph, run by torch.utils.checkpoint with the random state kept (unless
    the model asked otherwise) and the region's selective-checkpoint policy, if it has one."""
    options = {**kwargs, "use_reentrant": False, "preserve_rng_state": kwargs.get("preserve_rng_state", True)}
    if "_checkpoint_context_fn" in body.meta:
        options["context_fn"] = body.meta["_checkpoint_context_fn"]
    runnable = body.meta.get(_RUNNABLE)
    if runnable is None:  # a nested region keeps its own random state too
        runnable = body.meta[_RUNNABLE] = _checkpoints_keeping_the_random_state(body)
        generate_code_now(runnable)  # its code as a function: a module call would fire global module hooks
    return torch.utils.checkpoint.checkpoint(runnable.forward, *args, **options)


def _presented(outputs, kept_low: list[int]):
    """The graph's outputs, those the model's call returns low (cast pass: outputs_kept_low) as float32 tensors."""
    if not kept_low:
        return outputs
    outputs = list(outputs)
    for i, shown in zip(kept_low, presented_as_float32([outputs[i] for i in kept_low])):
        outputs[i] = shown
    return outputs


def refuse_fsdp2_param_dtype(model: torch.nn.Module) -> None:
    """FSDP2's MixedPrecisionPolicy(param_dtype=...) gives the graphs parameters in that dtype: no FP32 master weights
    to cast from, and model.float() cannot undo it (the sharded parameters are float32). Say so, with the fix."""
    for path, dtype in fsdp2_param_dtypes(model).items():
        if dtype in HALF_DTYPES:
            raise ArgumentError(
                f"FSDP2's MixedPrecisionPolicy(param_dtype={dtype}) on '{path or type(model).__name__}' gathers the "
                f"parameters in {dtype_name(dtype)} for compute, so graphamp gets no FP32 master weights to cast from. "
                f"Fix: fully_shard without param_dtype (reduce_dtype may stay); graphamp casts inside the graphs by "
                f"the lists."
            )


def refuse_outer_autocast(tensors, what: str) -> None:
    """torch.autocast around graphamp's graphs would recast their ops by its own lists: say so, with the fix.

    Args:
        tensors: the values the call or graph runs on (their device types are the ones checked; CPU if none).
        what: the subject of the message ("graphamp was asked to compile a graph", "GPT2LMHeadModel, rewritten
            by graphamp, was called").
    """
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)} or {"cpu"}
    active = sorted(d for d in devices if is_autocast_available(d) and torch.is_autocast_enabled(d))
    if active:
        raise DoubleAmpError(
            f"{what} inside an active torch.autocast region on {active[0]}: two AMP systems are on, and autocast "
            "would override graphamp's lists. Turn one off: drop the torch.autocast context (with accelerate, "
            "Accelerator(mixed_precision='no'); with Lightning, precision='32-true'; with the HF Trainer, "
            "bf16=False and fp16=False), or train under autocast without graphamp."
        )


def refuse_autocast_inside(gm: GraphModule) -> None:
    """torch.autocast turned on inside the code dynamo captured runs its own policy over the graph's ops: the same
    two AMP systems as an outer region, with no outer region to see. accelerate's mixed_precision (and so the HF
    Trainer's bf16=True/fp16=True) wraps the model's forward in it. A region that turns autocast off is the model's
    own FP32 choice, and one turned on again inside it follows graphamp's lists (docs/numerics.md): both stay."""
    enter, leave = ENTER_AUTOCAST, EXIT_AUTOCAST
    for graph_module in (m for m in gm.modules() if isinstance(m, GraphModule)):
        enabled_by_region = {}
        disabled_around = 0
        for node in graph_module.graph.nodes:
            if node.op != "call_function" or node.target not in (enter, leave):
                continue
            if node.target is leave:
                disabled_around -= not enabled_by_region.get(node.args[0], True)
                continue
            arguments = dict(zip(("device_type", "dtype", "enabled"), node.args)) | node.kwargs
            enabled_by_region[node] = bool(arguments.get("enabled", True))
            disabled_around += not enabled_by_region[node]
            if enabled_by_region[node] and not disabled_around:
                raise DoubleAmpError(
                    f"the model's forward turns torch.autocast on ({arguments.get('device_type')}, "
                    f"{arguments.get('dtype')}) inside the code graphamp compiles: two AMP systems are on, and "
                    "autocast would override graphamp's lists. Turn one off: with accelerate, "
                    "Accelerator(mixed_precision='no'); with the HF Trainer (or TRL's configs), bf16=False and "
                    "fp16=False; or drop the model's own torch.autocast."
                )


def configure_dynamo() -> None:
    """Dynamo settings graphamp's eager-semantics promise needs, process-wide (documented in docs/backend.md):
    hooks registered after the first call are guarded on (by default dynamo would never run them), and RNN
    modules are traced (by default dynamo runs nn.LSTM/GRU eagerly, outside any graph, in FP32)."""
    set_dynamo_config(skip_nnmodule_hook_guards=False, allow_rnn=True)
