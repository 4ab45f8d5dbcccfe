"""Regional rewrite: the model's blocks run as their own rewritten graphs, called through nn.Module.__call__.

`rewrite(model, ..., regions="transformer.h.*")` still captures and casts the whole model as one graph, so every
cast decision is the whole-model one. That graph is then cut along the blocks' calls, which torch.export keeps
whole (`preserve_module_call_signature`): each block call becomes one piece, and what is left, the glue
(embeddings, final norm, head, loss), calls each block as the model did, `block(*args, **kwargs)`. The block's
forward is replaced (on the instance) by its piece, so its hooks run around it on every call as in eager: FSDP2's
all-gather and reduce-scatter, user hooks, activation checkpointing. A piece reads its parameters from the block
when it runs, after the pre-forward hooks (FSDP2 has just gathered them). Identical blocks share one piece and,
with compile=True, one inductor compile.
"""

from __future__ import annotations

import contextlib
import fnmatch
import operator
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export.graph_signature import TensorArgument

from graphamp.capture import Captured, LiftedInput
from graphamp.runtime.checkpointing import checkpointed
from graphamp.runtime.compiled import CompiledGraph
from graphamp.errors import CaptureError, HookError
from graphamp.lists import Decision
from graphamp.runtime.in_graph_scaling import scale_gradients, scaling_factors, unscale_gradients
from graphamp.runtime.module_hooks import runs_hooks_a_graph_cannot, hooked_module_paths

__all__ = ["Regions", "called_module_paths", "region_paths", "root_is_called_as_module"]

_HOOK_TABLES = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks",
)
# What a piece may recompute on its own side of a cut: a cast or a reshape of a value that side has.
_RECOMPUTABLE = {Decision.INSERTED_CAST, Decision.EXPLICIT_CAST}


def region_paths(model: nn.Module, regions) -> list[str]:
    """The module paths `regions` names: glob patterns matched one path component at a time.

    Args:
        model: the model whose submodules are matched.
        regions: a pattern or a list of them, e.g. "transformer.h.*" (GPT-2) or "model.layers.*" (Llama);
            `*` stands for one component of a module path, so "transformer.h.*" does not match "transformer.h.0.attn".
    """
    patterns = [regions] if isinstance(regions, str) else list(regions)
    paths = [
        name for name, _ in model.named_modules()
        if name and any(_matches(name, pattern) for pattern in patterns)
    ]
    if not paths:
        raise CaptureError(
            f"regions={regions!r} matches no submodule of {type(model).__name__}. Fix: name the blocks by their "
            f"module path, as model.named_modules() lists them (e.g. {_block_example(model)!r})."
        )
    nested = [(a, b) for a in paths for b in paths if b.startswith(a + ".")]
    if nested:
        raise CaptureError(
            f"regions={regions!r} matches '{nested[0][1]}' inside '{nested[0][0]}'. Fix: name regions that do not "
            f"contain each other (the blocks, not their layers)."
        )
    return paths


def _matches(path: str, pattern: str) -> bool:
    parts, pattern_parts = path.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(map(fnmatch.fnmatchcase, parts, pattern_parts))


def _block_example(model: nn.Module) -> str:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return f"{name}.*"
    return "layers.*"


def called_module_paths(model: nn.Module, regions=None) -> list[str]:
    """The submodules an AmpModule calls through their own nn.Module.__call__, in module order: the regions
    named, those with hooks of the user's (graphamp.runtime.module_hooks), and those FSDP2 shards (their
    all-gathers and reduce-scatters run in their hooks). Derived again whenever the model's tree or hooks change.

    Args:
        model: the original model.
        regions: the patterns passed to rewrite(..., regions=...), or None.
    """
    why = {path: "named in regions=" for path in (region_paths(model, regions) if regions is not None else [])}
    for path in hooked_module_paths(model):
        why.setdefault(path, "it has hooks that must run on every call")
    for path in sharded_module_paths(model):
        why.setdefault(path, "it is sharded with fully_shard")
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    paths = sorted(why, key=order.__getitem__)
    for outer in paths:
        for inner in paths:
            if inner.startswith(outer + "."):
                raise HookError(
                    f"'{inner}' ({why[inner]}) lies inside '{outer}' ({why[outer]}); both must be called as modules "
                    f"on every call, and graphamp runs what is inside a called module as one graph. Fix: keep hooks "
                    f"and fully_shard on modules that do not contain each other (the blocks, or their layers)."
                )
    return paths


def root_is_called_as_module(model: nn.Module) -> bool:
    """Whether the model's own call must run its hooks around the graph (hooks of the user's, FSDP2's root)."""
    return runs_hooks_a_graph_cannot(model) or model in _fsdp_modules(model)


def sharded_module_paths(model: nn.Module) -> list[str]:
    sharded = _fsdp_modules(model)
    return [name for name, module in model.named_modules() if name and module in sharded]


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@dataclass
class Piece:
    """One block call's part of the rewritten graph, callable as (its tensor inputs, its parameters and buffers)."""

    graph_module: torch.fx.GraphModule
    run: object  # graph_module, or its CompiledGraph
    tensor_positions: list[int]  # which leaves of the flattened (args, kwargs) the graph takes
    state: list[LiftedInput]  # the block's parameters/buffers, read at call time
    outputs: list  # per output leaf: an index into the graph's outputs, or a ConstantArgument
    out_spec: pytree.TreeSpec


class _CallScaling:
    """1/scale of the AmpModule call running now under loss scaling in the graph, else None: the gradients
    leaving each piece into its parameters are divided by it, as run_scaled does for a whole-model graph."""

    inv_scale: torch.Tensor | None = None


class RegionForward:
    """Installed as a region module's `forward`: runs the piece captured for this call's signature.

    A call no capture has seen (the block called on its own, another shape) runs the class's own forward.
    """

    def __init__(self, module: nn.Module, scaling: _CallScaling):
        self.module = module
        self.scaling = scaling
        self.pieces: dict = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "pieces": {}}  # a copy's AmpModule captures its own pieces

    def __call__(self, *args, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        piece = self.pieces.get(_call_key(self.module.training, spec, flat))
        if piece is None:
            return type(self.module).forward(self.module, *args, **kwargs)
        state = [source.get() for source in piece.state]
        if self.scaling.inv_scale is not None:
            state = unscale_gradients(self.scaling.inv_scale, state)
        results = piece.run(*(flat[i] for i in piece.tensor_positions), *state)
        leaves = [results[o] if isinstance(o, int) else o.value for o in piece.outputs]
        return pytree.tree_unflatten(leaves, piece.out_spec)


class _RegionCall(nn.Module):
    """The glue's call of one block: rebuilds the block's (args, kwargs) and calls it through nn.Module.__call__."""

    def __init__(self, module: nn.Module, inputs: list, in_spec: pytree.TreeSpec, output_count: int):
        super().__init__()
        self.__dict__["block"] = module  # not registered: its parameters are the model's
        self.inputs = inputs  # per leaf: None for a tensor the glue passes, else the ConstantArgument
        self.in_spec = in_spec
        self.output_count = output_count

    def forward(self, *tensors):
        tensors = iter(tensors)
        leaves = [next(tensors) if i is None else i.value for i in self.inputs]
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        outputs = pytree.tree_leaves(self.block(*args, **kwargs))
        if len(outputs) != self.output_count:
            raise CaptureError(
                f"a hook on '{type(self.block).__name__}' changed the structure of its outputs: graphamp's glue "
                f"expects {self.output_count} leaves. Fix: return outputs of the same structure from hooks."
            )
        return tuple(outputs)


class _GlueForward:
    """The root's forward while an AmpModule call runs: the glue graph, its state read after the root's hooks."""

    def __init__(self, captured: Captured, scaling: _CallScaling, scale: torch.Tensor | None):
        self.captured = captured
        self.scaling = scaling
        self.scale = scale

    def __call__(self, *args, **kwargs):
        captured = self.captured
        flat = pytree.tree_leaves((args, dict(sorted(kwargs.items()))))
        inputs = [*(source.get() for source in captured.lifted), *flat]
        if self.scale is None:
            outputs = captured.run(*inputs)
        else:
            # Only what enters the outputs from outside is scaled; every piece's parameters are unscaled on the way.
            up, self.scaling.inv_scale = scaling_factors(self.scale)
            outputs = scale_gradients(up, list(captured.run(*unscale_gradients(self.scaling.inv_scale, inputs))))
        return pytree.tree_unflatten([outputs[i] for i in captured.user_outputs], captured.out_spec)


@dataclass
class Regions:
    """The modules of one AmpModule called as modules (regions): their installed forwards, and the pieces
    shared between identical blocks. With no paths it still calls the root through its __call__ (its hooks)."""

    model: nn.Module
    paths: list[str]
    forwards: dict[str, RegionForward] = field(default_factory=dict)
    shared: dict = field(default_factory=dict)  # a piece's structure -> (graph_module, run), for identical blocks
    scaling: _CallScaling = field(default_factory=_CallScaling)

    def __post_init__(self):
        for path in self.paths:
            module = self.model.get_submodule(path)
            self.forwards[path] = RegionForward(module, self.scaling)
            module.forward = self.forwards[path]

    def uninstall(self) -> None:
        """Give each region back its class's forward (the regions are about to be derived again)."""
        for path, forward in self.forwards.items():
            try:
                module = self.model.get_submodule(path)
            except AttributeError:  # the module was removed from the tree
                module = forward.module
            if module.__dict__.get("forward") is forward:
                del module.forward
            if forward.module.__dict__.get("forward") is forward:
                del forward.module.forward

    @contextlib.contextmanager
    def capturing(self):
        """The model as torch.export must see it: class forwards, no hooks on root and regions, FSDP2 gathered."""
        modules = [self.model, *(self.model.get_submodule(p) for p in self.paths)]
        sharded = _fsdp_modules(self.model)
        stashed = [(m, {t: getattr(m, t) for t in _HOOK_TABLES if hasattr(m, t)}) for m in modules]
        for module, tables in stashed:
            for table, hooks in tables.items():
                setattr(module, table, type(hooks)())
            module.__dict__.pop("forward", None)
        for module in sharded:
            module.unshard()
        try:
            yield
        finally:
            for module in sharded:
                module.reshard()
            for module, tables in stashed:
                for table, hooks in tables.items():
                    setattr(module, table, hooks)
            for path, forward in self.forwards.items():
                self.model.get_submodule(path).forward = forward

    def call(self, captured: Captured, args: tuple, kwargs: dict, scale: torch.Tensor | None = None):
        """Call the model through its own __call__ (the root's hooks run), with the glue graph as its forward.

        Args:
            scale: the loss scaling to apply in the graph (a linked decorated optimizer's), or None.
        """
        self.model.forward = _GlueForward(captured, self.scaling, scale)
        try:
            return self.model(*args, **kwargs)
        finally:
            del self.model.forward
            self.scaling.inv_scale = None

    def split(self, captured: Captured, compile: bool, progress, timings: dict) -> torch.fx.GraphModule:
        """Cut the rewritten whole-model graph into the glue (returned) and one piece per block call (installed)."""
        whole = captured.graph_module
        glue = torch.fx.GraphModule(whole, _copy_graph(whole.graph))
        lifted = dict(zip([n.name for n in whole.graph.find_nodes(op="placeholder")], captured.lifted))
        training = self.model.training
        aliases = {}  # a block's output node name -> the glue's getitem of the block call that replaced it
        for path in self.paths:
            signature = captured.module_calls.get(path)
            if signature is None:
                continue  # the model does not call this block on this input signature
            if signature.in_spec.num_leaves != len(signature.inputs):
                raise CaptureError(
                    f"'{path}' must be called as a module (named in regions=, hooked or sharded), but one of its "
                    f"arguments is an object torch.export does not record leaf by leaf (a transformers cache, say), "
                    f"so graphamp cannot call it with that argument. Fix: do not pass it (for a transformers model, "
                    f"use_cache=False: training needs no cache), or move the hook to a module that does not take it."
                )
            if any(f.startswith(path + "@") for f in captured.module_calls):
                raise CaptureError(
                    f"region '{path}' is called more than once per forward, which regional rewrite cannot cut. "
                    f"Fix: name regions that are called once (or rewrite without regions)."
                )
            key, piece = self._piece(glue, path, signature, lifted, aliases, compile, progress, timings)
            self.forwards[path].pieces[(training, key)] = piece
        glue.graph.eliminate_dead_code()
        glue.graph.lint()
        glue.recompile()
        return glue

    def _piece(self, glue, path, signature, lifted, aliases, compile, progress, timings):
        graph = glue.graph
        nodes = {n.name: n for n in graph.nodes} | aliases
        members = [n for n in graph.nodes if n.op == "call_function" and _inside(n, path)]
        member_set = set(members)
        leaf_inputs = [nodes[a.name] if isinstance(a, TensorArgument) else a for a in signature.inputs]
        tensor_inputs = [a for a in leaf_inputs if isinstance(a, torch.fx.Node)]
        outputs = [nodes[a.name] if isinstance(a, TensorArgument) else a for a in signature.outputs]
        tensor_outputs = list(dict.fromkeys(o for o in outputs if isinstance(o, torch.fx.Node)))

        piece_graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for i, node in enumerate(tensor_inputs):
            placeholder = piece_graph.placeholder(f"input_{i}")
            placeholder.meta = dict(node.meta)
            env.setdefault(node, placeholder)
        state: list[LiftedInput] = []

        def value_of(node):
            if node in env:
                return env[node]
            if node.op == "placeholder" and node.name in lifted:
                env[node] = piece_graph.placeholder(node.name)
                env[node].meta = dict(node.meta)
                state.append(lifted[node.name])
            elif _recomputable(node):
                env[node] = piece_graph.node_copy(node, value_of)
            else:
                raise CaptureError(
                    f"region '{path}' uses '{node.name}', computed outside the block and not passed to it. Fix: "
                    f"pass it to the block's forward as an argument, or name a region that computes it."
                )
            return env[node]

        for node in members:
            env[node] = piece_graph.node_copy(node, value_of)
        piece_graph.output(tuple(env[o] for o in tensor_outputs))

        # The glue: one call of the block where its nodes were; whatever else left the block is recomputed after.
        with graph.inserting_before(members[0]):
            call_name = f"region_{len([m for m in glue.children() if isinstance(m, _RegionCall)])}"
            glue.add_submodule(call_name, _RegionCall(
                self.model.get_submodule(path), [None if isinstance(a, torch.fx.Node) else a for a in leaf_inputs],
                signature.in_spec, len(outputs),
            ))
            call = graph.call_module(call_name, tuple(tensor_inputs))
        replaced = {}
        with graph.inserting_after(call):
            for index, leaf in enumerate(outputs):
                if isinstance(leaf, torch.fx.Node) and leaf not in replaced:
                    replaced[leaf] = graph.call_function(operator.getitem, (call, index))
                    replaced[leaf].meta = dict(leaf.meta)
                    aliases[leaf.name] = replaced[leaf]
        for node in reversed(members):
            for user in list(node.users):
                if user not in member_set:
                    node_value = replaced.get(node) or _recompute_in_glue(graph, node, replaced, member_set, path)
                    user.replace_input_with(node, node_value)
        for node in reversed(members):
            graph.erase_node(node)

        piece_gm = torch.fx.GraphModule(glue, piece_graph)
        key = _structure(piece_graph)
        if key not in self.shared:
            runnable = checkpointed(piece_gm)  # checkpoint= may name the block, or modules inside it
            run = CompiledGraph(runnable, progress, timings) if compile else runnable
            self.shared[key] = (piece_gm, run)
        piece_gm, run = self.shared[key]
        flat_positions = [i for i, a in enumerate(leaf_inputs) if isinstance(a, torch.fx.Node)]
        output_index = {node: i for i, node in enumerate(tensor_outputs)}
        piece = Piece(
            graph_module=piece_gm, run=run, tensor_positions=flat_positions, state=state,
            outputs=[output_index[o] if isinstance(o, torch.fx.Node) else o for o in outputs],
            out_spec=signature.out_spec,
        )
        example = [a.meta["val"] if isinstance(a, torch.fx.Node) else a.value for a in leaf_inputs]
        return _call_key_of_example(signature.in_spec, example), piece


def _inside(node: torch.fx.Node, path: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(p == path or p.startswith(path + ".") for p, _ in stack.values())


def _recomputable(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (node.meta.get("graphamp") or {}).get("decision") in _RECOMPUTABLE


def _recompute_in_glue(graph, node, replaced, member_set, path):
    """A cast made inside the block but also used after it, recomputed in the glue from the block's outputs."""
    if not _recomputable(node):
        raise CaptureError(
            f"'{node.name}', computed inside region '{path}', is used after the block without being returned by it. "
            f"Fix: return it from the block's forward, or name a region that contains its use."
        )
    if node not in replaced:
        def glue_value(n):
            if n in member_set:
                return replaced.get(n) or _recompute_in_glue(graph, n, replaced, member_set, path)
            return n
        anchor = max((replaced[n] for n in replaced), key=lambda n: list(graph.nodes).index(n))
        with graph.inserting_after(anchor):
            replaced[node] = graph.node_copy(node, glue_value)
    return replaced[node]


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    output = copy.graph_copy(graph, {})
    copy.output(output)
    return copy


def _structure(graph: torch.fx.Graph) -> str:
    """The graph's code with placeholders numbered and shapes/dtypes listed: equal for identical blocks."""
    index = {node: f"%{i}" for i, node in enumerate(graph.nodes)}
    lines = []
    for node in graph.nodes:
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        val = node.meta.get("val")
        described = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
        lines.append(f"{node.op} {node.target if node.op != 'placeholder' else ''} {args} {described}")
    return "\n".join(lines)


def _leaf_signature(value) -> Hashable:
    """A block call's leaf as its key sees it: a tensor's shape, dtype and device; any other value itself."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    return (type(value), value) if isinstance(value, Hashable) else (type(value), id(value))


def _call_key(training: bool, spec: pytree.TreeSpec, flat: list):
    return (training, (spec, tuple(_leaf_signature(x) for x in flat)))


def _call_key_of_example(in_spec: pytree.TreeSpec, leaves: list):
    """The key a call with these (fake) leaves will have: real devices, not the capture's fake ones."""
    return (in_spec, tuple(_leaf_signature(x) for x in leaves))
