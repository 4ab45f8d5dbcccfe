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
from graphamp.runtime.compiled import CompiledGraph
from graphamp.errors import CaptureError
from graphamp.lists import Decision

__all__ = ["Regions", "check_sharding", "region_paths"]

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


def check_sharding(model: nn.Module, regions) -> None:
    """FSDP2 groups run their all-gathers in their modules' hooks: only the root and regions are called as modules.

    Raises CaptureError with the fix for a sharded model without regions, or a sharded submodule no region covers.
    """
    from torch.distributed.fsdp import FSDPModule

    sharded = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if not sharded:
        return
    if regions is None:
        raise CaptureError(
            f"{type(model).__name__} is sharded with FSDP2 (fully_shard), whose all-gathers run in the sharded "
            f"modules' hooks, which a whole-model graph never calls. Fix: pass regions= naming the blocks you "
            f"sharded, e.g. rewrite(model, ..., regions={_block_example(model)!r})."
        )
    paths = region_paths(model, regions)
    uncovered = [name for name in sharded if name and name not in paths]
    if uncovered:
        raise CaptureError(
            f"'{uncovered[0]}' is sharded with fully_shard but is not one of the regions {regions!r}: its "
            f"parameters would never be gathered. Fix: shard only the regions and the root, or add it to regions."
        )


@dataclass
class Piece:
    """One block call's part of the rewritten graph, callable as (its tensor inputs, its parameters and buffers)."""

    graph_module: torch.fx.GraphModule
    run: object  # graph_module, or its CompiledGraph
    tensor_positions: list[int]  # which leaves of the flattened (args, kwargs) the graph takes
    state: list[LiftedInput]  # the block's parameters/buffers, read at call time
    outputs: list  # per output leaf: an index into the graph's outputs, or a ConstantArgument
    out_spec: pytree.TreeSpec


class RegionForward:
    """Installed as a region module's `forward`: runs the piece captured for this call's signature.

    A call no capture has seen (the block called on its own, another shape) runs the class's own forward.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.pieces: dict = {}

    def __call__(self, *args, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        piece = self.pieces.get(_call_key(self.module.training, spec, flat))
        if piece is None:
            return type(self.module).forward(self.module, *args, **kwargs)
        results = piece.run(*(flat[i] for i in piece.tensor_positions), *(source.get() for source in piece.state))
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

    def __init__(self, captured: Captured):
        self.captured = captured

    def __call__(self, *args, **kwargs):
        captured = self.captured
        flat = pytree.tree_leaves((args, dict(sorted(kwargs.items()))))
        outputs = captured.run(*(source.get() for source in captured.lifted), *flat)
        return pytree.tree_unflatten([outputs[i] for i in captured.user_outputs], captured.out_spec)


@dataclass
class Regions:
    """The regions of one AmpModule: their paths, their installed forwards, and the pieces shared between blocks."""

    model: nn.Module
    paths: list[str]
    forwards: dict[str, RegionForward] = field(default_factory=dict)
    shared: dict = field(default_factory=dict)  # a piece's structure -> (graph_module, run), for identical blocks

    def __post_init__(self):
        for path in self.paths:
            module = self.model.get_submodule(path)
            self.forwards[path] = RegionForward(module)
            module.forward = self.forwards[path]

    @contextlib.contextmanager
    def capturing(self):
        """The model as torch.export must see it: class forwards, no hooks on root and regions, FSDP2 gathered."""
        from torch.distributed.fsdp import FSDPModule

        modules = [self.model, *(self.model.get_submodule(p) for p in self.paths)]
        sharded = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
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

    def call(self, captured: Captured, args: tuple, kwargs: dict):
        """Call the model through its own __call__ (the root's hooks run), with the glue graph as its forward."""
        self.model.forward = _GlueForward(captured)
        try:
            return self.model(*args, **kwargs)
        finally:
            del self.model.forward

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
            run = CompiledGraph(piece_gm, progress, timings) if compile else piece_gm
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
