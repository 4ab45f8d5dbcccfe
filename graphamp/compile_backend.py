"""graphamp as a torch.compile backend: dynamo captures, graphamp's lists and cast pass decide the dtypes.

`torch.compile(model, backend=graphamp.backend(lists))`. Dynamo keeps eager semantics around each graph it
hands over (guards on module state, parameters, hooks and shapes; recompiles; graph breaks around what it
cannot trace, such as `if x.mean() > t:`). Each graph is lowered here to the pre-autograd ATen IR that
`rewrite()` captures (torch.export's training IR, traced by make_fx in dynamo's own fake mode, so symbolic
shapes stay symbolic), goes through the same cast pass, and is compiled by inductor (or run as fx code).
Autograd differentiates through the casts, so the model's FP32 parameters stay the master weights and their
gradients arrive in FP32.

The file is not `backend.py`: no public function shares its name with a submodule (the house style, and
tests/test_architecture.py).
"""

from __future__ import annotations

import functools
import re
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx.traceback as fx_traceback
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from graphamp.cast_pass import RewriteReport, check_level, insert_casts
from graphamp.errors import ArgumentError, CaptureError
from graphamp.lists import AutoMixedPrecisionLists
from graphamp.optimizer import OptimizerWithMixedPrecision
from graphamp.runtime.in_graph_scaling import run_scaled

__all__ = ["AmpBackend", "BackendGraph", "backend"]

_NORM_TYPES = (torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm)


def backend(
    amp_lists: AutoMixedPrecisionLists | None = None,
    level: str = "O1",
    inductor: bool = True,
    inductor_options: dict | None = None,
) -> AmpBackend:
    """A torch.compile backend that runs each captured graph in mixed precision by graphamp's lists.

    Args:
        amp_lists: the lists that decide each ATen op's dtype (default: the shipped lists in float16).
        level: 'O1' (the lists decide) or 'O2' (all but black ops run low; normalization weights stay FP32).
        inductor: compile each rewritten graph with inductor (the default); False runs the rewritten fx code
            as it is, for debugging (slower, but a TorchDispatchMode sees every kernel and its dtypes).
        inductor_options: inductor config patches (as torch.compile's `options=`), e.g. {"max_autotune": True}.

    Returns:
        An AmpBackend: pass it as `torch.compile(model, backend=...)`; its `reports` hold each graph's
        RewriteReport and `graphamp.export(it, folder)` writes its graphs.
    """
    return AmpBackend(amp_lists or AutoMixedPrecisionLists(), level, inductor, dict(inductor_options or {}))


@dataclass
class BackendGraph:
    """One graph dynamo handed over, as the cast pass left it."""

    graph_module: GraphModule  # pre-autograd ATen, casts inserted: what inductor compiled (or what runs)
    report: RewriteReport
    original_code: str  # the ATen graph before the cast pass (export's diff.txt)
    parameter_placeholders: dict[str, str]  # placeholder name -> the parameter's or buffer's path in the model
    timings: dict = field(default_factory=dict)  # phase -> seconds: lower to ATen, cast pass, inductor


class AmpBackend:
    """The backend object: `__call__(gm, example_inputs)` is dynamo's compiler_fn contract. Make it with backend()."""

    def __init__(self, amp_lists: AutoMixedPrecisionLists, level: str, inductor: bool, inductor_options: dict):
        if not isinstance(amp_lists, AutoMixedPrecisionLists):
            raise ArgumentError(
                f"graphamp.backend(amp_lists=...) got a {type(amp_lists).__name__}; pass "
                f"graphamp.AutoMixedPrecisionLists(dtype='bfloat16') (or 'float16')."
            )
        check_level(level)
        self.amp_lists = amp_lists
        self.level = level
        self.inductor = inductor
        self.inductor_options = inductor_options
        self.graphs: list[BackendGraph] = []
        self._linked_optimizer = None
        # Dynamo skips its guards on module hooks by default, so a hook registered after the first call would
        # silently never run: graphamp's promise is eager semantics, so the guards are on from here.
        torch._dynamo.config.skip_nnmodule_hook_guards = False

    def link_optimizer(self, optimizer: OptimizerWithMixedPrecision) -> None:
        """Scale gradients inside every graph by this decorated optimizer's loss scaling, so that a plain
        `loss.backward()` (any training loop) leaves true FP32 gradients in `.grad`, as a linked AmpModule does.

        Each graph's floating outputs pass the gradient on times the scale and its inputs (the master weights,
        the activations from a graph before a graph break) divide it again: between graphs and in `.grad` the
        gradients are true, inside them (the float16 backward) scaled. Without a link, use
        `optimizer.backward(loss)` or `minimize(loss)`.

        Args:
            optimizer: what `graphamp.decorate()` returned (the latest link wins).
        """
        if not isinstance(optimizer, OptimizerWithMixedPrecision):
            raise ArgumentError(
                f"link_optimizer() takes the optimizer graphamp.decorate() returns, got {type(optimizer).__name__}: "
                f"decorate it first."
            )
        self._linked_optimizer = weakref.ref(optimizer)

    @property
    def reports(self) -> list[RewriteReport]:
        """Each rewritten graph's RewriteReport, in the order dynamo compiled them (recompiles add more)."""
        return [graph.report for graph in self.graphs]

    def __call__(self, gm: GraphModule, example_inputs: list):
        timings = {}
        start = time.perf_counter()
        aten_graph = to_aten(gm, example_inputs, len(self.graphs))
        original_code = aten_graph.print_readable(print_output=False)
        timings["lower to ATen"] = time.perf_counter() - start
        start = time.perf_counter()
        state = state_placeholders(gm, aten_graph)
        # fp32_outputs: the values leave in the dtypes dynamo traced, which the code after a graph break expects.
        report = insert_casts(
            aten_graph, self.amp_lists, self.level, fp32_outputs=True,
            fp32_placeholders=norm_parameter_placeholders(aten_graph, state) if self.level == "O2" else frozenset(),
        )
        timings["cast pass"] = time.perf_counter() - start
        graph = BackendGraph(aten_graph, report, original_code, state, timings)
        self.graphs.append(graph)
        if not self.inductor:
            return self._scaling_when_linked(aten_graph)
        from torch._inductor.compile_fx import compile_fx  # imported late: inductor takes seconds to import

        start = time.perf_counter()
        compiled = compile_fx(aten_graph, example_inputs, config_patches=self.inductor_options or None)
        timings["inductor"] = time.perf_counter() - start
        return self._scaling_when_linked(compiled)

    def _scaling_when_linked(self, run):
        def call(*args):
            optimizer = self._linked_optimizer() if self._linked_optimizer is not None else None
            if optimizer is None or not torch.is_grad_enabled():
                return run(*args)
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
            scale = optimizer._scale_in_graph(device)  # None while the scale is fixed at 1.0 (bfloat16's default)
            return run(*args) if scale is None else run_scaled(run, list(args), scale)
        return call

    def __repr__(self) -> str:
        return (
            f"graphamp.backend(dtype={self.amp_lists.dtype_name}, level={self.level}, inductor={self.inductor}, "
            f"graphs={len(self.graphs)})"
        )


def to_aten(gm: GraphModule, example_inputs: list, index: int = 0) -> GraphModule:
    """Dynamo's torch-level graph as pre-autograd ATen (torch.export's training IR), same flat inputs and outputs.

    Traced in the fake mode dynamo gave the backend, from fakes of the real inputs made as aot_autograd makes
    them, so that the graph's symbolic sizes (automatic dynamic shapes) stay symbolic. Each node keeps its
    dynamo metadata (nn_module_stack, stack_trace), which the cast pass reads for black modules.
    """
    fake_mode, fake_inputs = _fake_inputs(gm, example_inputs)
    _give_checkpoints_their_policy(gm)

    def run(*args):
        with fx_traceback.preserve_node_meta():  # each new node takes the meta of the dynamo node it came from
            return torch.fx.Interpreter(gm).run(*args)

    allowed = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True  # tensors the graph holds as attributes (get_attr) become constants
    try:
        with fake_mode:
            aten_graph = make_fx(run, pre_dispatch=True)(*fake_inputs)
    except Exception as error:
        raise CaptureError(
            f"graphamp.backend could not lower graph #{index} that dynamo captured to ATen ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}). Fix: run that part outside "
            f"torch.compile (torch.compiler.disable), or use graphamp.rewrite() for this model."
        ) from error
    finally:
        fake_mode.allow_non_fake_inputs = allowed
    aten_graph = _autocast_regions_as_higher_order_ops(aten_graph)
    for node in aten_graph.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:  # dynamo's paths (L['self'].layers[0].mlp) as named_modules() paths (layers.0.mlp)
            node.meta["nn_module_stack"] = {key: (module_fqn(path), kind) for key, (path, kind) in stack.items()}
    return aten_graph


def _autocast_regions_as_higher_order_ops(aten_graph: GraphModule) -> GraphModule:
    """`with torch.autocast(..., enabled=False)` in the model traces as enter/exit calls; torch.export's own pass
    wraps each region in the wrap_with_autocast op, whose body the cast pass keeps as the model wrote it."""
    enter = torch.amp.autocast_mode._enter_autocast
    if not aten_graph.graph.find_nodes(op="call_function", target=enter):
        return aten_graph
    try:  # a private module of torch.export's: without it the regions are cast like the rest
        from torch._export.passes.replace_autocast_with_hop_pass import replace_autocast_with_hop_pass
    except ImportError:
        return aten_graph
    return replace_autocast_with_hop_pass(aten_graph, None)[0]


def _give_checkpoints_their_policy(gm: GraphModule) -> None:
    """Tracing a checkpointed region (dynamo's tag_activation_checkpoint) to pre-autograd ATen reads the body's
    `_checkpoint_context_fn`, which dynamo sets only when the user passed a context_fn (torch 2.13): give plain
    checkpoints the policy torch itself gives them, recompute everything."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    checkpoint_op = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    for node in gm.graph.find_nodes(op="call_function", target=checkpoint_op) if checkpoint_op else []:
        body = getattr(gm, node.args[0].target)
        body.meta.setdefault(
            "_checkpoint_context_fn", functools.partial(create_selective_checkpoint_contexts, _recompute_all)
        )


def _recompute_all(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def _fake_inputs(gm: GraphModule, example_inputs: list):
    from torch._guards import TracingContext, detect_fake_mode

    context = TracingContext.try_get()
    placeholders = gm.graph.find_nodes(op="placeholder")
    fake_mode = context.fake_mode if context is not None and context.fake_mode is not None else None
    if fake_mode is None:  # called outside dynamo (a test calling the backend on a GraphModule itself)
        fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.FakeTensorMode(
            shape_env=torch.fx.experimental.symbolic_shapes.ShapeEnv()
        )
    symbolic = getattr(context, "tensor_to_context", {}) if context is not None else {}

    def fake(value, node):
        if isinstance(value, torch._subclasses.FakeTensor):
            return value if value.fake_mode is fake_mode else fake_mode.from_tensor(value)
        if isinstance(value, torch.Tensor):
            # The symbolic context dynamo made for this very tensor: its dynamic dims map to the same symbols.
            symbolic_context = symbolic.get(value) if symbolic else None
            source = getattr(symbolic_context, "tensor_source", None)
            return fake_mode.from_tensor(value, symbolic_context=symbolic_context, source=source)
        traced = node.meta.get("example_value") if node is not None else None
        return traced if isinstance(value, int) and isinstance(traced, torch.SymInt) else value

    nodes = placeholders + [None] * (len(example_inputs) - len(placeholders))
    return fake_mode, [fake(value, node) for value, node in zip(example_inputs, nodes)]


_INDEX = re.compile(r"\[(\d+)\]")
_KEY = re.compile(r"\[['\"]([^'\"]+)['\"]\]")


def module_fqn(dynamo_path: str) -> str:
    """`L['self'].model.layers[0]._modules['mlp']` -> `model.layers.0.mlp`, the path named_modules() gives
    (`..._parameters['weight']` -> `...weight`, as named_parameters())."""
    path = re.sub(r"^[LG]\[['\"][^'\"]*['\"]\]\.?", "", dynamo_path)
    path = _KEY.sub(r".\1", _INDEX.sub(r".\1", path))
    parts = [part for part in path.split(".") if part and part not in ("_modules", "_parameters", "_buffers")]
    return ".".join(parts)


def state_placeholders(gm: GraphModule, aten_graph: GraphModule) -> dict[str, str]:
    """{ATen placeholder name: parameter or buffer path} for the model state dynamo passes as graph inputs.

    The ATen graph's placeholders are dynamo's, in order; dynamo's `grapharg.source` says where each came from
    (`L['self']._modules['inp']._parameters['weight']` -> `inp.weight`).
    """
    names = {}
    aten_inputs = aten_graph.graph.find_nodes(op="placeholder")
    for dynamo_input, aten_input in zip(gm.graph.find_nodes(op="placeholder"), aten_inputs):
        source = getattr(dynamo_input.meta.get("grapharg"), "source", None)
        where = source.name() if callable(getattr(source, "name", None)) else getattr(source, "name", "")
        if "._parameters[" in where or "._buffers[" in where:
            names[aten_input.name] = module_fqn(where)
    return names


def norm_parameter_placeholders(aten_graph: GraphModule, state: dict[str, str]) -> frozenset[str]:
    """Under O2, the parameters read by a normalization module's ops (its weight and bias) stay FP32.

    Dynamo passes parameters as plain inputs (`state`: placeholder -> path); what marks one as a norm weight is the
    module its readers run in (LayerNorm, BatchNorm, GroupNorm, or a class named *Norm, such as LlamaRMSNorm), as
    rewrite() asks of the parameter's owner.
    """
    names = set()
    for placeholder in aten_graph.graph.find_nodes(op="placeholder"):
        if placeholder.name not in state:
            continue
        for reader in placeholder.users:
            stack = reader.meta.get("nn_module_stack")
            kind = next(reversed(stack.values()))[1] if stack else None
            name = kind.__name__ if isinstance(kind, type) else str(kind)
            if (isinstance(kind, type) and issubclass(kind, _NORM_TYPES)) or "Norm" in name:
                names.add(placeholder.name)
    return frozenset(names)
