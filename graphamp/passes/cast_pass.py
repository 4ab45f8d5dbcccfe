"""The cast pass: classify each node of a captured graph by the lists and insert the casts that follow.

Two walks over `graph.nodes`, as Paddle's `rewrite_program`: the first marks every op (marks.py), never by dtypes;
the second casts by those marks. docs/how_it_works.md ("The passes") describes both and the casts' folding.
"""

from __future__ import annotations

import logging
import operator
from contextlib import contextmanager, nullcontext
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from graphamp.errors import RewriteError
from graphamp.passes.marks import MARK, OpMark, mark_of
from graphamp.passes.number_range import ConstantsBeyondRange, clamp_scalars_to_range
from graphamp.policy.aten_ops import (
    FP32_ACCUMULATING_OPS, MODEL_CAST_OPS, NORM_OPS, RESHAPE_OPS, SAME_DTYPE_OPS, TRACE_ASSERTS, VIEW_OPS,
    argument_value, functional_of_out_call, has_explicit_float_dtype, norm_parameter_inputs, set_argument,
    viewed_input, written_inputs,
)
from graphamp.policy.cast_rule import cannot_run_fix, cast_target, decides_dtype
from graphamp.policy.config import AmpConfig, is_normalization_module
from graphamp.policy.dtypes import HALF_DTYPES, dtype_name
from graphamp.policy.kernel_support import runs_low_on
from graphamp.policy.lists import BLACK, GRAY, WHITE, Decision, op_lookup_keys
from graphamp.torch_private import (
    SET_GRAD_ENABLED, HigherOrderOperator, OpOverload, detect_fake_mode, enable_python_dispatcher, inside_the_vmaps_of,
    op_schema, pytree,
)

__all__ = ["INPUT_UPCAST", "RewriteReport", "insert_casts"]

aten = torch.ops.aten
# torch.autocast(..., enabled=False) captures as this higher-order op around a sub-graph.
AUTOCAST_REGION = torch.ops.higher_order.wrap_with_autocast
AUTOGRAD_FUNCTION = torch.ops.higher_order.autograd_function_apply
MODEL_FP32_REGION = "model: autocast(enabled=False)"
CAST_OP = aten._to_copy.default
# The meta key the front end sets on its upcast of an input that arrives low and presents float32.
INPUT_UPCAST = "graphamp_input_upcast"


@dataclass
class RewriteReport:
    """What the cast pass decided for one captured graph (sub-graphs of higher-order ops included)."""

    dtype: torch.dtype
    level: str
    decisions: Counter = field(default_factory=Counter)
    unlisted_ops: Counter = field(default_factory=Counter)
    casts_inserted: int = 0
    # Positions of the outputs left low where the trace had float32 (insert_casts(..., outputs_stay_low=True)).
    outputs_kept_low: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"graphamp rewrite ({dtype_name(self.dtype)}, {self.level}): {self.casts_inserted} casts inserted",
            "  ops by decision: " + ", ".join(f"{d}={n}" for d, n in sorted(self.decisions.items())),
        ]
        if self.unlisted_ops:
            lines.append(
                "  unlisted ops (treated as gray; add them to a list to decide): "
                + ", ".join(f"{op} x{n}" for op, n in self.unlisted_ops.most_common())
            )
        return "\n".join(lines)


def insert_casts(
    graph_module: GraphModule, config: AmpConfig, parameters: frozenset[str] = frozenset(),
    outputs_stay_low: bool = False,
) -> RewriteReport:
    """Rewrite `graph_module` in place for mixed precision and return what was decided.

    Args:
        graph_module: a pre-autograd ATen graph whose nodes carry `meta["val"]` (and `nn_module_stack`).
        config: the lists and level.
        parameters: the names of the placeholders that are the model's parameters; under O2 those a
            normalization module reads are never cast down.
        outputs_stay_low: leave an output low where the pass computed it low (report.outputs_kept_low lists them;
            the caller presents them as float32), instead of casting it back to its traced dtype.
    """
    report = RewriteReport(dtype=config.dtype, level=config.level)
    fp32 = _normalization_parameters(graph_module, parameters) if config.level == "O2" else frozenset()
    _CastPass(graph_module, config, report, fp32, outputs_stay_low=outputs_stay_low).run()
    return report


def _normalization_parameters(graph_module: GraphModule, parameters: frozenset[str]) -> frozenset[str]:
    """The O2 rule: the parameters read by a normalization module's ops (its weight and bias) stay FP32."""
    return frozenset(
        placeholder.name
        for placeholder in graph_module.graph.find_nodes(op="placeholder")
        if placeholder.name in parameters
        and any(is_normalization_module(_innermost_module(reader)[1]) for reader in placeholder.users)
    )


def node_dtype(node) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def module_path(node: Node) -> str:
    """The FQN of the innermost module the op ran in ('' at the top level)."""
    return _innermost_module(node)[0]


def _innermost_module(node: Node) -> tuple:
    """(FQN, class or its name) of the innermost module the op ran in; ('', None) at the top level."""
    stack = node.meta.get("nn_module_stack")
    return next(reversed(stack.values())) if stack else ("", None)


class _CastPass:
    """The walk over one graph; higher-order ops' sub-graphs get a walk of their own."""

    def __init__(self, graph_module, config: AmpConfig, report, fp32_placeholders=frozenset(), fp32_region=False,
                 outputs_stay_low=False, arriving_low: dict[int, torch.dtype] | None = None):
        self.graph_module = graph_module
        self.graph = graph_module.graph
        for node in self.graph.nodes:
            # torch.export gives the getitem of a no_grad region's result the very meta dict of the region's last op:
            # the dtype and decision the pass writes there are that op's, not the value's that leaves the region.
            node.meta = dict(node.meta)
        self.config = config
        self.low = config.dtype
        self.report = report
        # Inside a region the model keeps FP32 (autocast disabled), every op runs as traced, as under autocast.
        self.fp32_region = fp32_region
        # The dtype each value had when traced (a tuple of dtypes for multi-output ops).
        self.traced_dtype = {node: _dtype_signature(node.meta.get("val")) for node in self.graph.nodes}
        self.never_cast_down = {n for n in self.graph.nodes if n.op == "placeholder" and n.name in fp32_placeholders}
        if self.never_cast_down:  # O2's norm parameters: nothing to look for in an O1 graph
            for node in self.graph.nodes:  # Gemma's `self.weight.float()`: in eager code the weight itself, not a copy
                if self._no_op_alias(node) and node.args[0] in self.never_cast_down:
                    self.never_cast_down.add(node)
        self.casts: dict[tuple[Node, torch.dtype], Node] = {}
        self.cast_source: dict[Node, Node] = {}
        self.recast_reshapes: list[Node] = []  # reshapes remade on a cast of their input (_reshape_of_cast)
        self.constants = ConstantsBeyondRange(self.graph, self.low)  # what a cast down must saturate (_cast)
        # Random draws of the dtype the trace froze as float32, and what gray ops make of them alone (_draws).
        self.draws: dict[Node, None] = {}  # in graph order
        self.outputs_stay_low = outputs_stay_low
        # Inputs that arrive low and present float32 (a graph's low output, read by the next graph): the front end
        # traced their upcast; it is one of the pass's own casts, so a down-cast of it is the input itself.
        self.input_upcasts = {n for n in self.graph.nodes if n.meta.get(INPUT_UPCAST)}
        self.low_inputs = {n.args[0] for n in self.input_upcasts}
        for upcast in self.input_upcasts:
            self.cast_source[upcast] = upcast.args[0]
            self.casts[(upcast.args[0], torch.float32)] = upcast
            self.traced_dtype[upcast.args[0]] = torch.float32  # the FP32 model's value
            upcast.meta[MARK] = OpMark(Decision.INSERTED_CAST, "float32 of a low input", "")
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in self.graph.nodes]) or nullcontext()
        # A body's inputs that arrive low (by position), where the trace had float32: read as they are, and every
        # op reading them decided on their dtype (_visit_autograd_function).
        placeholders = self.graph.find_nodes(op="placeholder")
        for index, dtype in (arriving_low or {}).items():
            if self.traced_dtype.get(placeholders[index]) == torch.float32:
                placeholders[index].meta["val"] = self._val_in(placeholders[index].meta["val"], dtype)
                self.low_inputs.add(placeholders[index])

    def run(self) -> None:
        for node in self.graph.nodes:  # first decide every op: no decision depends on a dtype the casts change
            decided = node.op == "call_function" and node not in self.input_upcasts and node.target not in TRACE_ASSERTS
            if decided and isinstance(node.target, (OpOverload, HigherOrderOperator)):
                self._mark(node, self._decide(node))
        for node in list(self.graph.nodes):
            if node.op == "output":
                self._restore_traced_dtypes(node)
            elif node.op == "call_function":
                if node.target in TRACE_ASSERTS:
                    self.graph.erase_node(node)
                elif node in self.input_upcasts:
                    continue
                elif isinstance(node.target, OpOverload):
                    self._visit_op(node)
                elif isinstance(node.target, HigherOrderOperator):
                    self._visit_higher_order(node)
                elif node.target is operator.getitem:
                    self._refresh_meta(node)
                elif node.target is SET_GRAD_ENABLED:  # a cast made under no_grad has no history:
                    # shared past the block (as autocast's cache is not), its weight would train no more
                    self.casts = {key: cast for key, cast in self.casts.items() if cast in self.input_upcasts}
        self._draw_in_the_dtype_of_their_readers()
        for reshape in self.recast_reshapes:
            if not reshape.users:  # every user took the reshape of the cast instead
                self.graph.erase_node(reshape)
        for upcast in self.input_upcasts:  # each reader took the low input itself, or its float32 upcast
            if upcast.users:
                self.report.casts_inserted += 1
            else:
                self.graph.erase_node(upcast)
        self.graph.lint()
        self.graph_module.recompile()

    def _no_op_alias(self, node: Node) -> bool:
        """A model's `.to(dtype)`, `.float()` or `type_as` into the dtype its input already has: eager code returns
        the input itself."""
        if node.op != "call_function" or node.target not in MODEL_CAST_OPS or node.target is aten._to_copy.default:
            return False
        return not _copies(node) and isinstance(node.args[0], Node) \
            and self.traced_dtype.get(node) == self.traced_dtype.get(node.args[0])

    # -- deciding ------------------------------------------------------------------------------------------
    def _decide(self, node: Node) -> OpMark:
        """An op node's mark: from its target, its own arguments, its module and the region it is in."""
        op, module = node.target, module_path(node)
        if isinstance(op, HigherOrderOperator):  # its body is decided node by node, FP32 if autocast is off there
            fp32_region = _autocast_enabled(node) is False or (self.fp32_region and _autocast_enabled(node) is None)
            return OpMark(Decision.HIGHER_ORDER, MODEL_FP32_REGION if fp32_region else "", module)
        if op in MODEL_CAST_OPS or has_explicit_float_dtype(node):
            return OpMark(Decision.EXPLICIT_CAST, "model", module)
        if self.fp32_region:
            return OpMark(Decision.EXPLICIT_CAST, MODEL_FP32_REGION, module)
        pattern = self.config.black_module_for(module)
        if pattern is not None:
            return OpMark(BLACK, pattern.source, module)
        entry = self.config.lists.classify(op)
        return OpMark(Decision.UNLISTED, "", module) if entry is None else OpMark(entry.color, entry.source, module)

    def _mark(self, node: Node, mark: OpMark) -> None:
        node.meta[MARK] = mark
        self.report.decisions[mark.decision] += 1
        if mark.decision == Decision.UNLISTED:
            self.report.unlisted_ops[op_lookup_keys(node.target)[1]] += 1

    def _target_dtype(self, decision: str, floats: list[Node]) -> torch.dtype | None:
        """The dtype the op's floating inputs are cast to (policy/cast_rule.py), or None to leave them. A random
        draw decides only where nothing else does (_draws): it takes the dtype of the values it meets. An input that
        arrives low (the graph before a graph break computed it low) decides as the low value it is, as it would
        without the break."""
        floats = [n for n in floats if n not in self.draws] or floats
        deciding = [n for n in floats if decides_dtype(n.meta["val"])] or floats
        dtypes = [node_dtype(self.cast_source[n] if n in self.input_upcasts else n) for n in deciding]
        return cast_target(decision, self.config.level, self.low, dtypes)

    # -- visiting ------------------------------------------------------------------------------------------
    def _visit_op(self, node: Node) -> None:
        decision = mark_of(node).decision
        if decision in (WHITE, BLACK) and (functional := functional_of_out_call(node)) is not None:
            self._computed_then_copied(node, functional)
            return
        mutated = written_inputs(node)
        left_alone = mutated | norm_parameter_inputs(node)
        floats = [n for n in node.all_input_nodes if _is_castable(n) and n not in left_alone]
        target = None if decision == Decision.EXPLICIT_CAST else self._target_dtype(decision, floats)
        promotes = isinstance(node.target, OpOverload) and self.config.lists.promotes(node.target)
        follows_inputs = decision in (GRAY, Decision.UNLISTED)
        if target == torch.float32 and follows_inputs and not promotes and self._promotes_to_fp32(node):
            target = None  # add(bf16, fp32) already computes in FP32 inside the kernel: a cast would only cost
        if target == self.low and not self._kernel_takes(node, floats):
            target = torch.float32  # this device's norm kernel wants X in its parameters' dtype
        if target == torch.float32 and decision == BLACK and (inside := self._fp32_inside_the_kernel(node, floats)):
            if inside == "low as is" or self._converts_inside(node):
                target = None
        if target is not None:
            self._cast_inputs(node, [n for n in floats if self._needs_cast(n, target)], target)
        into = next((n for n in mutated if _is_castable(n)), None)
        unlike = [n for n in node.all_input_nodes if _is_castable(n) and n not in left_alone and into is not None
                  and node_dtype(n) != node_dtype(into)]
        if unlike and self._result_as_it_is(node) is None:  # the model's `.to(cache.dtype)` was a no-op in the trace
            self._cast_inputs(node, unlike, node_dtype(into))
            for value in unlike:  # a cast made above for the rule that this one folded back: nothing reads it
                if value.target is CAST_OP and value in self.cast_source and not value.users:
                    self._erase_cast(value)
        for value in mutated:  # an in-place op makes earlier casts of its target stale
            self._forget_casts_of(value)
        self._refresh_meta(node)
        if node_dtype(node) in HALF_DTYPES and node_dtype(node) != self.traced_dtype.get(node):
            clamp_scalars_to_range(node, node_dtype(node))
        if self._draws(node):
            self.draws[node] = None

    def _draws(self, node: Node) -> bool:
        """Whether `node` is a random draw whose float32 dtype the model likely took from a tensor, or a gray op
        of such draws and numbers alone (`keep_prob + rand`, `floor_`).

        HF's drop_path draws `torch.rand(shape, dtype=x.dtype)`: the FP32 trace froze x.dtype as float32, where x
        runs low here and under autocast, and the float32 mask would promote the residual stream. A draw with no
        dtype given keeps the default float32, as eager code does."""
        if mark_of(node).decision in (GRAY, Decision.UNLISTED):
            floats = [n for n in node.all_input_nodes if _is_castable(n)]
            return bool(floats) and all(n in self.draws for n in floats)
        return (
            not node.all_input_nodes and torch.Tag.nondeterministic_seeded in node.target.tags
            and has_explicit_float_dtype(node) and self.traced_dtype.get(node) == torch.float32
        )

    def _draw_in_the_dtype_of_their_readers(self) -> None:
        """A random draw that every other op reads through a cast down (_target_dtype) is drawn low instead, with
        the gray ops between: the dtypes eager code under autocast or auto_cast gives, and no cast."""
        for draw in [n for n in self.draws if not n.all_input_nodes]:
            chain = [draw]
            for node in self.draws:  # in graph order: a node is in the chain once all its floating inputs are
                if node.all_input_nodes and all(n in chain for n in node.all_input_nodes if _is_castable(n)):
                    chain.append(node)
            readers = [user for node in chain for user in node.users if user not in chain]
            casts_down = [r for r in readers if r in self.cast_source and node_dtype(r) == self.low]
            if not readers or len(casts_down) < len(readers):
                continue
            set_argument(draw, next(a for a in op_schema(draw.target).arguments if a.name == "dtype"), self.low)
            mark = mark_of(draw)
            draw.meta[MARK] = OpMark(mark.decision, "dtype traced float32: drawn in its readers' dtype", mark.module)
            for node in chain:
                node.meta["val"] = self._run_on_fake_values(node)
                clamp_scalars_to_range(node, self.low)
            for cast in casts_down:
                cast.replace_all_uses_with(cast.args[0])
                self._erase_cast(cast)

    def _computed_then_copied(self, node: Node, functional) -> None:
        """`torch.mm(a, b, out=buffer)`: the op runs in its listed dtype and its result is copied into the buffer,
        which keeps the dtype the code gave it (as auto_cast runs it, eager_policy.py); the out= kernel itself would
        refuse inputs of another dtype than the buffer's."""
        out_argument = next(a for a in op_schema(node.target).arguments if a.is_out)
        buffer = argument_value(node, out_argument)
        kwargs = {k: v for k, v in node.kwargs.items() if k != out_argument.name}
        with self.graph.inserting_before(node):
            result = self.graph.call_function(functional, node.args, kwargs)
            copied = self.graph.call_function(aten.copy_.default, (buffer, result))
        for made in (result, copied):
            made.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
            made.meta["val"] = self._run_on_fake_values(made)
        result.meta[MARK] = mark_of(node)  # the call's decision, counted once already
        self._mark(copied, self._decide(copied))
        node.replace_all_uses_with(copied)
        self.graph.erase_node(node)
        self._visit_op(result)
        self._visit_op(copied)

    def _fp32_inside_the_kernel(self, node: Node, floats: list[Node]) -> str | None:
        """How a black op can read its low inputs as they are and compute in FP32 inside, with no cast kernel:
        - "low as is": a normalization (kept black by the user) or a softmax, sum or mean whose output feeds only
          white ops (GEMMs): the kernel accumulates in FP32 and its low output is what the next GEMM would read
          after a cast of the FP32 result (autocast casts X up and the result back down);
        - "dtype=float32": an op with an unset `dtype` argument (sum, mean, softmax, cumsum), which casts inside.
        None where it cannot: its inputs are cast.
        """
        low = [n for n in floats if node_dtype(n) in HALF_DTYPES]
        if not low:
            return None
        name = op_lookup_keys(node.target)[1]
        if name in NORM_OPS or name in FP32_ACCUMULATING_OPS:
            if len(low) == len(floats) and self._kernel_takes(node, floats) and self._feeds_only_white(node):
                return "low as is"
            if name in NORM_OPS:
                return None
        dtype_argument = next((a for a in op_schema(node.target).arguments if a.name == "dtype"), None)
        return "dtype=float32" if dtype_argument is not None and argument_value(node, dtype_argument) is None else None

    def _converts_inside(self, node: Node) -> bool:
        """Passes `dtype=float32` where the kernel then reads the low inputs (sum, softmax); False, the node as it was,
        where it refuses them whatever the dtype (linalg.matrix_norm of ord 2 or 'nuc'): its inputs are cast."""
        args, kwargs = node.args, node.kwargs
        set_argument(node, next(a for a in op_schema(node.target).arguments if a.name == "dtype"), torch.float32)
        try:
            node.meta["val"] = self._run_on_fake_values(node)  # float32 now, also where no input changed dtype
        except Exception:
            node.args, node.kwargs = args, kwargs
            return False
        return True

    def _kernel_takes(self, node: Node, floats: list[Node]) -> bool:
        """False where this device's kernel cannot run the op low as the gray rule wants (kernel_support.py): a
        normalization that cannot read a low X with FP32 parameters, an interpolation whose backward
        accumulates in the low dtype."""
        name = op_lookup_keys(node.target)[1]
        if name in NORM_OPS and not norm_parameter_inputs(node):
            return True  # no FP32 parameters: nothing mixed
        data = floats[0].meta["val"] if floats else None
        return data is None or runs_low_on(name, data.device, self.low)

    def _feeds_only_white(self, node: Node) -> bool:
        """Whether every op reading `node`'s (first) output is white, looking through getitems, reshapes and
        gray ops of that one value (dropout, a scalar multiply): those would run low on a low input anyway."""
        readers = list(node.users)
        if not readers:
            return False
        while readers:
            reader = readers.pop()
            if reader.op != "call_function":
                return False
            if reader.target is operator.getitem:
                if reader.args[1] == 0:
                    readers.extend(reader.users)
            elif reader.target in RESHAPE_OPS or reader.target in VIEW_OPS:
                readers.extend(reader.users)
            elif not isinstance(reader.target, OpOverload) or self.config.black_module_for(module_path(reader)):
                return False
            else:
                entry = self.config.lists.classify(reader.target)
                if entry is not None and entry.color == GRAY and _reads_one_floating_value(reader):
                    readers.extend(reader.users)
                elif entry is None or entry.color != WHITE:
                    return False
        return True

    def _visit_higher_order(self, node: Node) -> None:
        """torch.cond, no_grad regions and the like: operands cross in their traced dtype, bodies are rewritten
        (left as traced inside an autocast-disabled region)."""
        fp32_region = mark_of(node).source == MODEL_FP32_REGION
        if node.target is AUTOGRAD_FUNCTION and not fp32_region:
            self._visit_autograd_function(node)
            return
        replace = {}
        for value in node.all_input_nodes:
            if value.op == "get_attr":
                body = getattr(self.graph_module, value.target)
                if isinstance(body, GraphModule):
                    _CastPass(body, self.config, self.report, fp32_region=fp32_region).run()
            elif _is_castable(value) and node_dtype(value) != self.traced_dtype.get(value):
                replace[value] = self._cast(value, self.traced_dtype[value], node)
        if replace:
            node.args, node.kwargs = map_arg((node.args, node.kwargs), lambda n: replace.get(n, n))

    def _visit_autograd_function(self, node: Node) -> None:
        """A custom autograd.Function (BLOOM's GELU): as eager code under autocast, its forward takes the operands in
        the dtypes they have here and its gray ops follow them; its backward takes the gradients and saved values in
        the dtypes the forward gives them. Casting the operands back to float32 would run its body FP32."""
        forward, backward = (getattr(self.graph_module, body.target) for body in node.args[:2])
        low = {i: node_dtype(v) for i, v in enumerate(node.args[2:]) if node_dtype(v) in HALF_DTYPES}
        kept_low = list(self.report.outputs_kept_low)  # positions in this graph's outputs, not in a body's
        _CastPass(forward, self.config, self.report, outputs_stay_low=True, arriving_low=low).run()
        leaves = pytree.tree_leaves(forward.graph.find_nodes(op="output")[0].args[0])
        low = {i: node_dtype(v) for i, v in enumerate(leaves) if node_dtype(v) in HALF_DTYPES}
        _CastPass(backward, self.config, self.report, outputs_stay_low=True, arriving_low=low).run()
        self.report.outputs_kept_low[:] = kept_low
        node.meta["val"] = self._run_on_fake_values(node)

    def _no_op_in_the_trace(self, node: Node) -> bool:
        """A `.to()` of the model's that returned its input itself in the trace (already that dtype and device)."""
        return (
            node.op == "call_function" and node.target in MODEL_CAST_OPS and node.target is not CAST_OP
            and node.target is not aten.type_as.default and not _copies(node)
            and isinstance(node.args[0], Node) and self.traced_dtype.get(node) == self.traced_dtype.get(node.args[0])
            and getattr(node.meta.get("val"), "device", None) == getattr(node.args[0].meta.get("val"), "device", 0)
        )

    def _restore_traced_dtypes(self, output: Node) -> None:
        """Each output leaves in its traced dtype, or, with `outputs_stay_low`, low where the pass computed it low
        (the front end presents it as float32). Outputs that shared storage in the trace (a view of another output,
        two views of one value, a view of an input) are remade as the same views of one restored base, so they
        leave as aliases again (AOTAutograd regenerates them, fx code returns them); the others are cast."""
        if self.outputs_stay_low:  # `logits.float()` in the model's loss was `logits` itself in the FP32 trace
            for value in output.all_input_nodes:
                if self._no_op_in_the_trace(value) or value in self.input_upcasts:
                    output.replace_input_with(value, value.args[0])
        sharing = Counter(self._storage_root(n) for n in output.all_input_nodes)
        remade: dict[Node, Node] = {}
        flat = pytree.tree_leaves(output.args[0])
        for value in output.all_input_nodes:
            if not _is_castable(value) or self.traced_dtype.get(value) in (None, node_dtype(value)):
                continue
            root = self._storage_root(value)
            computed_low = node_dtype(value) in HALF_DTYPES and self.traced_dtype[value] == torch.float32
            if self.outputs_stay_low and computed_low and (root.op == "call_function" or root in self.low_inputs):
                self.report.outputs_kept_low.extend(i for i, p in enumerate(flat) if p is value)
                continue
            if root.op in ("placeholder", "get_attr") or sharing[root] > 1:
                output.replace_input_with(value, self._remade_on_restored_base(value, output, remade))
            else:
                output.replace_input_with(value, self._cast(value, self.traced_dtype[value], output))
        for node in reversed(remade):  # the traced views, and the pass's casts under them, that nothing reads now
            pure = node in self.cast_source or not _writes_its_base(node)
            if remade[node] is not node and not node.users and pure and node not in self.recast_reshapes:
                self.report.casts_inserted -= node.target is CAST_OP
                self.graph.erase_node(node)

    def _storage_root(self, value: Node) -> Node:
        """The value whose storage `value` was in the trace: through views, in-place ops and the pass's own casts."""
        while (base := self.cast_source.get(value) or _viewed_value(value)) is not None:
            value = base
        return value

    def _remade_on_restored_base(self, value: Node, before: Node, remade: dict[Node, Node]) -> Node:
        """`value` in its traced dtype: the views it was traced as, applied to its root in the root's traced dtype."""
        if value not in remade:
            base = _viewed_value(value)
            if value in self.cast_source:  # a cast of the pass's own: the trace had its source there
                remade[value] = self._remade_on_restored_base(self.cast_source[value], before, remade)
            elif _dtype_signature(value.meta.get("val")) == self.traced_dtype.get(value):
                remade[value] = value
            elif base is None:
                remade[value] = self._cast(value, self.traced_dtype[value], before)
            elif _writes_its_base(value):  # relu_(x) is x
                remade[value] = self._remade_on_restored_base(base, before, remade)
            else:
                remade[value] = self._remade(value, base, self._remade_on_restored_base(base, before, remade), before)
        return remade[value]

    # -- casting -------------------------------------------------------------------------------------------
    def _needs_cast(self, value: Node, target: torch.dtype) -> bool:
        dtype = node_dtype(value)
        if dtype == target or dtype == torch.float64:
            return False  # float64 is the model's explicit choice, as autocast leaves it
        if target == torch.float32:
            return dtype in HALF_DTYPES
        return value not in self.never_cast_down

    def _val_in(self, val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The fake value of a cast (inside the vmaps a batched value was traced in)."""
        with self.fake_mode, inside_the_vmaps_of([val]):
            return val.to(dtype)

    def _cast(self, value: Node, dtype: torch.dtype, before: Node) -> Node:
        """`value` in `dtype`, sharing one cast per (value, dtype) and folding casts of our casts."""
        root = self.cast_source.get(value, value)
        if node_dtype(root) == dtype:
            return root
        cast = self.casts.get((root, dtype))
        if cast is None and root.op == "call_function" and root.target in RESHAPE_OPS and _is_castable(root.args[0]):
            cast = self._reshape_of_cast(root, dtype, before)
        elif cast is None:
            with self.graph.inserting_before(before):
                cast = self.graph.call_function(CAST_OP, (root,), {"dtype": dtype})
            cast.meta["val"] = self._val_in(root.meta["val"], dtype)
            cast.meta["nn_module_stack"] = before.meta.get("nn_module_stack", {})
            source = f"{dtype_name(dtype)} for {before.name}"
            cast.meta[MARK] = OpMark(Decision.INSERTED_CAST, source, module_path(before))
            self.casts[(root, dtype)] = cast
            self.cast_source[cast] = root
            self.report.casts_inserted += 1
            if dtype == self.low and self.constants.may_exceed(root):
                self._saturate(cast, root)
        return cast

    def _saturate(self, cast: Node, constant: Node) -> None:
        """`cast` reads `constant` clamped at the low dtype's finite range where finite (number_range.py): the
        float32 min the trace froze for `finfo(x.dtype).min` becomes the low min, not -inf."""
        limit = torch.finfo(self.low).max
        with self.graph.inserting_before(cast):
            clamped = self.graph.call_function(aten.clamp.default, (constant, -limit, limit))
            finite = self.graph.call_function(aten.isfinite.default, (constant,))
            saturated = self.graph.call_function(aten.where.self, (finite, clamped, constant))
        source = f"{constant.name} saturated at {dtype_name(self.low)}'s finite range"
        for node in (clamped, finite, saturated):
            node.meta["val"] = self._run_on_fake_values(node)
            node.meta["nn_module_stack"] = cast.meta["nn_module_stack"]
            node.meta[MARK] = OpMark(Decision.INSERTED_CAST, source, mark_of(cast).module)
        cast.replace_input_with(constant, saturated)

    def _reshape_of_cast(self, reshape: Node, dtype: torch.dtype, before: Node) -> Node:
        """`reshape` in `dtype`, made as the same reshape of its input's (shared) cast."""
        reshaped = self._remade(reshape, reshape.args[0], self._cast(reshape.args[0], dtype, before), before)
        self.casts[(reshape, dtype)] = reshaped
        self.cast_source[reshaped] = reshape
        self.recast_reshapes.append(reshape)
        return reshaped

    def _remade(self, node: Node, old: Node, new: Node, before: Node) -> Node:
        """`node` made again before `before`, reading `new` where it read `old`; its decision taken as for any op."""
        args, kwargs = map_arg((node.args, node.kwargs), lambda n: new if n is old else n)
        with self.graph.inserting_before(before):
            made = self.graph.call_function(node.target, args, kwargs)
        made.meta["val"] = self._run_on_fake_values(made)
        made.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        if isinstance(node.target, OpOverload):
            self._mark(made, self._decide(made))
        return made

    def _erase_cast(self, cast: Node) -> None:
        key = (self.cast_source.pop(cast), node_dtype(cast))
        if self.casts.get(key) is cast:
            del self.casts[key]
        self.graph.erase_node(cast)
        self.report.casts_inserted -= 1

    def _forget_casts_of(self, value: Node) -> None:
        root = self.cast_source.get(value, value)
        for key in [k for k in self.casts if k[0] is root]:
            del self.casts[key]

    def _cast_inputs(self, node: Node, values: list[Node], dtype: torch.dtype) -> None:
        replace = {n: self._cast(n, dtype, node) for n in values}
        node.args, node.kwargs = map_arg((node.args, node.kwargs), lambda n: replace.get(n, n))

    def _result_as_it_is(self, node: Node):
        """What the op returns on its inputs in their dtypes now (fake values), None where its kernel refuses them."""
        if op_lookup_keys(node.target)[1] in SAME_DTYPE_OPS:
            return None
        try:
            with _fake_tensor_errors_unlogged():
                return self._run_on_fake_values(node)
        except Exception:
            return None

    def _promotes_to_fp32(self, node: Node) -> bool:
        """Whether torch's type promotion runs this op in FP32 on its mixed inputs as they are."""
        result = self._result_as_it_is(node)  # None where the op wants matching dtypes: cast explicitly
        floats = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return bool(floats) and all(t.dtype == torch.float32 for t in floats)

    def _refresh_meta(self, node: Node) -> None:
        """Recompute node.meta['val'] on fake tensors when an input's dtype changed, so it stays true."""
        if all(_dtype_signature(n.meta.get("val")) == self.traced_dtype.get(n) for n in node.all_input_nodes):
            return
        try:
            node.meta["val"] = self._run_on_fake_values(node)
        except Exception as error:  # the op has no kernel for these dtypes: say which op, and the fix
            raise RewriteError(cannot_run_message(node, error)) from error

    def _fake_value(self, node: Node):
        """A node's meta value; a higher-order op's body (a get_attr with none) is the sub-module itself."""
        if node.op == "get_attr" and "val" not in node.meta:
            return getattr(self.graph_module, node.target)
        return node.meta.get("val")

    def _run_on_fake_values(self, node: Node):
        """What `node` returns on its inputs' meta values: shapes and dtypes, no data."""
        args, kwargs = map_arg((node.args, node.kwargs), self._fake_value)
        # The Python dispatcher runs composite ops' decompositions (linear, lstm) on symbolic sizes, as make_fx does.
        # An in-place op runs without autograd: export's meta value of a buffer it writes is a leaf requiring grad.
        writes = isinstance(node.target, OpOverload) and written_inputs(node)
        with self.fake_mode, enable_python_dispatcher(), torch.no_grad() if writes else nullcontext(), \
                inside_the_vmaps_of(pytree.tree_leaves((args, kwargs))):
            return node.target(*args, **kwargs)


@contextmanager
def _fake_tensor_errors_unlogged():
    """FakeTensorMode logs an ERROR traceback when an op refuses mixed dtypes (aten.dot, spectral_norm's
    vdot) before raising; _result_as_it_is expects that refusal, so the log would only alarm the user."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


def cannot_run_message(node: Node, error: Exception) -> str:
    """Which op failed on which dtypes, where, what decided them, and the fix (for the rewrite and the doctor)."""
    mark = mark_of(node)
    dtypes = ", ".join(sorted({dtype_name(node_dtype(n)) for n in node.all_input_nodes if _is_castable(n)}))
    entry = op_lookup_keys(node.target)[1] if isinstance(node.target, OpOverload) else str(node.target)
    decided = f" ({mark.decision}, {mark.source})" if mark and mark.source else ""
    fix = cannot_run_fix(entry, mark.decision, mark.source) if mark else cannot_run_fix(entry, None, "")
    first_line = (str(error).strip().splitlines() or [""])[0]
    return (
        f"{node.name} = {node.target} in {mark and mark.module or '(top level)'}{decided} cannot run on {dtypes} "
        f"inputs: {first_line}. Fix: {fix}."
    )


def _autocast_enabled(node: Node) -> bool | None:
    """For a `torch.autocast(...)` region: whether it enables autocast (any device type); None for other ops.

    A region disabled for CUDA is kept FP32 on every device: the graph does not know where it will run, and the
    model said that code needs FP32."""
    return bool(node.args[2]) if node.target is AUTOCAST_REGION else None


def _copies(node: Node) -> bool:
    """Whether a `.to()` node was asked for a copy (copy=True)."""
    argument = next((a for a in op_schema(node.target).arguments if a.name == "copy"), None)
    return argument is not None and bool(argument_value(node, argument, False))


def _dtype_signature(value):
    """The dtype of a tensor value, or of each tensor of a multi-output op's tuple."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (tuple, list)):
        return tuple(_dtype_signature(v) for v in value)
    return None


def _viewed_value(node: Node) -> Node | None:
    """The value whose storage `node`'s output is (aten_ops.viewed_input); a split's piece's is the split."""
    if isinstance(node, Node) and node.target is operator.getitem:
        return node.args[0] if _viewed_value(node.args[0]) is not None else None
    return viewed_input(node) if isinstance(node, Node) and isinstance(node.target, OpOverload) else None


def _writes_its_base(node: Node) -> bool:
    """An in-place op (relu_, index_copy_, an out= variant): its output is the very tensor it wrote."""
    return isinstance(node.target, OpOverload) and viewed_input(node) in written_inputs(node)


def _reads_one_floating_value(node: Node) -> bool:
    """One floating input besides a norm's FP32 parameters (which never decide its dtype)."""
    parameters = norm_parameter_inputs(node)
    return len([n for n in node.all_input_nodes if _is_castable(n) and n not in parameters]) == 1


def _is_castable(node: Node) -> bool:
    """Floating tensors are cast; integer and bool tensors and non-tensors never are."""
    dtype = node_dtype(node)
    return dtype is not None and dtype.is_floating_point
