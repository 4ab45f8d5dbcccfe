"""The doctor's instrument: one captured FP32 graph, run node by node in FP32 and rewritten, on the same inputs.

`Probe` captures the model once, as an FP32 ExportedProgram (capture_program). `reference(seed)` runs the FP32
graph and keeps every node's value and output gradient; `compare(amp_lists, reference)` rewrites a copy of the
graph with those lists and runs it, measuring each op node against the reference as it goes (error, local_error,
low_error, grad_error: the table in docs/doctor.md). Both runs draw the same random numbers (dropout), and neither
touches the model's parameters, gradients or buffers: they run on copies.
"""

from __future__ import annotations

import copy
import math
import operator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.node import map_arg
from torch.export.graph_signature import InputKind, OutputKind

from graphamp.frontends.export_program import capture_program
from graphamp.policy.aten_ops import draws_random_numbers, norm_parameter_inputs, written_inputs
from graphamp.passes.cast_pass import cannot_run_message, insert_casts, module_path, node_dtype
from graphamp.passes.marks import mark_of
from graphamp.policy.dtypes import dtype_name
from graphamp.errors import RewriteError
from graphamp.policy.lists import BLACK, GRAY, WHITE, AutoMixedPrecisionLists, Decision, op_lookup_keys
from graphamp.policy.config import AmpConfig
from graphamp.diagnosis.numerics import floating_leaves, nonfinite_where_finite, range_in, relative_error, worst
from graphamp.torch_private import HigherOrderOperator, OpOverload, pytree

__all__ = ["Comparison", "NodeNumerics", "Probe", "Reference", "by_list_entry"]

_INDEX = "graphamp_doctor_index"  # meta key: a node's place in the captured graph, kept by the rewritten copy
_LIST_DECISIONS = (WHITE, BLACK, GRAY, Decision.UNLISTED)  # the ops the lists decide (not the model's casts, not ours)


@dataclass
class NodeNumerics:
    """One op node of the rewritten graph, measured against the FP32 run (worst over the steps)."""

    index: int
    name: str
    op: str  # 'addmm.default'
    entry: str  # the list entry that decides it ('mul' or 'mul.Tensor'), or the op's packet when unlisted
    module: str
    decision: str
    source: str
    runs_in: str | None
    max_abs: float | None = None  # of the FP32 run's value
    overflow: float = 0.0  # fraction of the FP32 run's values that are inf in the low dtype
    underflow: float = 0.0  # fraction that flush to zero in it
    error: float | None = None
    local_error: float | None = None
    low_error: float | None = None
    grad_error: float | None = None
    nonfinite: bool = False
    grad_nonfinite: bool = False
    inputs: tuple[str, ...] = ()  # the op nodes feeding it, through graphamp's casts

    def merge(self, other: NodeNumerics) -> None:
        """Keep the worst of two steps' figures."""
        for name in ("max_abs", "overflow", "underflow", "error", "local_error", "low_error", "grad_error"):
            setattr(self, name, worst(getattr(self, name), getattr(other, name)))
        self.nonfinite |= other.nonfinite
        self.grad_nonfinite |= other.grad_nonfinite


def by_list_entry(nodes: list[NodeNumerics]) -> dict[str, list[NodeNumerics]]:
    """The floating op nodes the lists decide, by the entry that decides them, in execution order."""
    found: dict[str, list[NodeNumerics]] = {}
    for record in nodes:
        if record.decision in _LIST_DECISIONS and record.runs_in is not None:
            found.setdefault(record.entry, []).append(record)
    return found


@dataclass
class Reference:
    """The FP32 run: every node's value, the gradients reaching op outputs and parameters, and the outputs."""

    seed: int
    values: dict[int, object] = field(default_factory=dict)
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    parameter_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    outputs: object = None
    loss: torch.Tensor | None = None


@dataclass
class Comparison:
    """One rewritten run against a Reference."""

    nodes: list[NodeNumerics]
    first_nonfinite: NodeNumerics | None
    first_nonfinite_grad: NodeNumerics | None
    output_error: float | None
    loss: torch.Tensor | None
    parameter_grads: dict[str, torch.Tensor | None]
    failure: str | None = None  # the node where the rewritten graph raised, and the error


class NodeRunFailed(Exception):
    """A node of a probed graph raised: the doctor reports where, instead of crashing."""

    def __init__(self, node: Node, error: Exception):
        super().__init__(cannot_run_message(node, error))


class Probe:
    """A model captured once as an FP32 ExportedProgram, with the inputs and parameter copies both runs are fed."""

    def __init__(self, model, example_args, example_kwargs, level="O1", loss_fn=None, loss_scaling=1.0, dynamic=False,
                 *, promote_ops: frozenset[str]):
        kwargs = dict(example_kwargs or {})
        self.model = model  # its module paths: a shared module's ops are black by any of its names
        self.level = level
        self.loss_fn = loss_fn
        self.loss_scaling = float(loss_scaling)
        self.program = capture_program(model, example_args, kwargs, dynamic, promote_ops)
        self.graph_module = self.program.graph_module
        self.user_inputs = pytree.tree_leaves((example_args, kwargs))
        signature = self.program.graph_signature
        self._user_outputs = [i for i, s in enumerate(signature.output_specs) if s.kind == OutputKind.USER_OUTPUT]
        self._out_spec = self.program.call_spec.out_spec
        for index, node in enumerate(self.graph_module.graph.nodes):
            node.meta[_INDEX] = index
        # Values a later op writes into (BatchNorm's output under ReLU(inplace=True)) are kept as copies.
        self._overwritten = {
            value.meta[_INDEX]
            for node in self.graph_module.graph.nodes
            if node.op == "call_function" and isinstance(node.target, OpOverload)
            for value in written_inputs(node)
        }
        self._parameter_placeholders = frozenset(signature.inputs_to_parameters)
        # Leaf copies of the parameters (one per tensor: tied weights share it): autograd.grad on them leaves the
        # model's own .grad alone. Buffers and constants are cloned per run: BatchNorm updates its statistics in place.
        self.parameters: dict[str, torch.Tensor] = {}
        leaves: dict[int, torch.Tensor] = {}
        self._feeds, state = [], {**self.program.state_dict, **self.program.constants}
        for spec in (s for s in signature.input_specs if s.kind != InputKind.USER_INPUT):
            value = state[spec.target]
            if spec.kind == InputKind.PARAMETER:
                leaf = leaves.setdefault(id(value), value.detach().clone().requires_grad_(value.requires_grad))
                self.parameters.setdefault(spec.target, leaf)
                self._feeds.append(lambda leaf=leaf: leaf)
            else:  # a custom object (torch.classes) is fed as it is
                self._feeds.append(lambda v=value: v.detach().clone() if isinstance(v, torch.Tensor) else v)

    def rewritten(self, amp_lists: AutoMixedPrecisionLists) -> GraphModule:
        """A copy of the captured graph with the cast pass run on it by `amp_lists`."""
        graph_module = copy.deepcopy(self.graph_module)
        config = AmpConfig(amp_lists, self.level).for_model(self.model)
        insert_casts(graph_module, config, parameters=self._parameter_placeholders)
        return graph_module

    # -- runs ----------------------------------------------------------------------------------------------
    def reference(self, seed: int, backward: bool = True) -> Reference:
        """Run the FP32 graph, keeping every node's value and (with backward) the gradient reaching it."""
        reference = Reference(seed)

        def observe(node, value):
            index = node.meta[_INDEX]
            copied = index in self._overwritten
            reference.values[index] = pytree.tree_map_only(torch.Tensor, torch.clone, value) if copied else value
            if backward and _is_op(node):
                for position, tensor in enumerate(floating_leaves(value)):
                    if tensor.requires_grad:
                        key = (index, position)
                        tensor.register_hook(lambda grad, key=key: reference.grads.__setitem__(key, grad.detach()))

        reference.outputs, reference.loss, reference.parameter_grads = self._run(
            self.graph_module, seed, observe, backward, 1.0
        )
        return reference

    def compare(self, amp_lists: AutoMixedPrecisionLists, reference: Reference, backward: bool = True) -> Comparison:
        """Rewrite a copy of the graph with `amp_lists`, run it on the reference's inputs and measure every op."""
        try:
            graph_module = self.rewritten(amp_lists)
        except RewriteError as error:
            return Comparison([], None, None, None, None, {}, failure=str(error))
        low = amp_lists.dtype
        nodes: list[NodeNumerics] = []
        aligned: dict[Node, object] = {}
        grad_order: list[NodeNumerics] = []

        def observe(node, value):
            if not _is_op(node) or _INDEX not in node.meta:
                return  # graphamp's casts and getitems are measured through the ops that read them
            index = node.meta[_INDEX]
            expected = reference.values[index]
            record = _record(node, value, amp_lists, len(nodes))
            record.max_abs, record.overflow, record.underflow = range_in(expected, low)
            record.error = relative_error(value, expected)
            record.nonfinite = nonfinite_where_finite(value, expected)
            if _reruns(node):
                record.local_error = relative_error(_call(node, lambda n: _aligned(n, reference, aligned)), expected)
                runs_low = record.runs_in == dtype_name(low)
                record.low_error = record.local_error if runs_low else self._low_error(node, reference, low, aligned)
            nodes.append(record)
            for position, tensor in enumerate(floating_leaves(value)):
                if tensor.requires_grad and (index, position) in reference.grads:
                    tensor.register_hook(lambda grad, key=(index, position), record=record: _compare_grad(
                        grad, key, record, reference, self.loss_scaling, grad_order
                    ))

        try:
            outputs, loss, parameter_grads = self._run(
                graph_module, reference.seed, observe, backward, self.loss_scaling
            )
        except NodeRunFailed as failed:
            return Comparison(nodes, None, None, None, None, {}, failure=str(failed))
        # Under an inf/NaN loss every gradient is NaN: a first one in backward would name nothing.
        finite_loss = loss is None or bool(torch.isfinite(loss))
        return Comparison(
            nodes=nodes,
            first_nonfinite=next((r for r in nodes if r.nonfinite), None),
            first_nonfinite_grad=next((r for r in grad_order if r.grad_nonfinite), None) if finite_loss else None,
            output_error=relative_error(outputs, reference.outputs),
            loss=loss,
            parameter_grads=parameter_grads,
        )

    def output_error(self, amp_lists: AutoMixedPrecisionLists, reference: Reference) -> float:
        """The rewritten model's loss (or outputs) against FP32, forward only and without instruments: fast."""
        try:
            graph_module = self.rewritten(amp_lists)
            with torch.no_grad():
                outputs, loss, _ = self._run(graph_module, reference.seed, None, False, 1.0)
        except (NodeRunFailed, RewriteError):
            return math.inf
        both_losses = loss is not None and reference.loss is not None
        error = relative_error(loss, reference.loss) if both_losses else relative_error(outputs, reference.outputs)
        return math.inf if error is None or math.isnan(error) else error

    def _run(self, graph_module, seed, observe, backward, loss_scaling):
        """(user outputs, loss, parameter gradients) of one run; the model's RNG state is left as it was."""
        devices = sorted({t.device.index for t in self.parameters.values() if t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), torch.enable_grad() if backward else nullcontext():
            torch.manual_seed(seed)
            flat = _Observed(graph_module, observe).run(*(feed() for feed in self._feeds), *self.user_inputs)
        outputs = pytree.tree_unflatten([flat[i] for i in self._user_outputs], self._out_spec)
        loss = self.loss_fn(outputs) if self.loss_fn is not None else _scalar_loss(outputs)
        grads = {}
        trainable = {name: p for name, p in self.parameters.items() if p.requires_grad}
        if backward and loss is not None and loss.requires_grad and trainable:
            found = torch.autograd.grad(loss * loss_scaling, list(trainable.values()), allow_unused=True)
            grads = {name: None if g is None else g / loss_scaling for name, g in zip(trainable, found)}
        detached = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, outputs)
        return detached, None if loss is None else loss.detach(), grads

    def _low_error(self, node: Node, reference: Reference, low: torch.dtype, aligned: dict) -> float | None:
        """The op on the FP32 run's inputs cast down to `low` (normalization parameters stay FP32)."""
        keep = norm_parameter_inputs(node)

        def value(n):
            v = _aligned(n, reference, aligned)
            cast = isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != torch.float64 and n not in keep
            return v.to(low) if cast else v

        try:
            return relative_error(_call(node, value), reference.values[node.meta[_INDEX]])
        except Exception:  # the op has no low-precision kernel here: it cannot move to white
            return None


class _Observed(Interpreter):
    """Runs a graph node by node, handing each node's value to `observe` while its inputs are still alive."""

    def __init__(self, graph_module, observe):
        super().__init__(graph_module)
        self.observe = observe

    def run_node(self, node):
        try:
            value = super().run_node(node)
        except Exception as error:
            raise NodeRunFailed(node, error) from error
        if self.observe is not None:
            self.observe(node, value)
        return value


def _is_op(node: Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, (OpOverload, HigherOrderOperator))


def _reruns(node: Node) -> bool:
    """Whether the op can run again on other inputs: not random (dropout), not in place, not a sub-graph."""
    if not isinstance(node.target, OpOverload) or draws_random_numbers(node):
        return False
    mark = mark_of(node)
    if mark is not None and mark.decision in (Decision.EXPLICIT_CAST, Decision.INSERTED_CAST):
        return False
    return not written_inputs(node)


def _record(node: Node, value, amp_lists: AutoMixedPrecisionLists, index: int) -> NodeNumerics:
    mark = mark_of(node)
    decision, source, module = (mark.decision, mark.source, mark.module) if mark else ("", "", module_path(node))
    if isinstance(node.target, OpOverload):
        op, packet = op_lookup_keys(node.target)
        entry = amp_lists.classify(node.target)
        entry_name = entry.name if entry is not None else packet
    else:
        op = entry_name = node.target.__name__
    floats = floating_leaves(value) or [n.meta["val"] for n in node.all_input_nodes if node_dtype(n) is not None
                                        and node_dtype(n).is_floating_point]
    return NodeNumerics(
        index=index, name=node.name, op=op, entry=entry_name, module=module, decision=decision, source=source,
        runs_in=dtype_name(floats[0].dtype) if floats else None, inputs=_producers(node),
    )


def _producers(node: Node) -> tuple[str, ...]:
    """The op nodes whose values `node` reads, looking through inserted casts, recast reshapes and getitems."""
    names = []
    for value in node.all_input_nodes:
        while value.op == "call_function" and _INDEX not in value.meta or value.target is operator.getitem:
            value = value.all_input_nodes[0]
        if _is_op(value):
            names.append(value.name)
    return tuple(names)


def _aligned(node: Node, reference: Reference, memo: dict):
    """The FP32 run's value of `node`, in the dtype the rewritten graph gives it; graphamp's own casts and
    reshapes are recomputed on such values."""
    if node in memo:
        return memo[node]
    if _INDEX in node.meta:
        value = _in_dtypes_of(reference.values[node.meta[_INDEX]], node.meta.get("val"))
    else:
        value = _call(node, lambda n: _aligned(n, reference, memo))
    memo[node] = value
    return value


def _in_dtypes_of(value, like):
    """`value` with each floating tensor in the dtype of its counterpart in `like` (a node's meta value)."""
    if isinstance(value, torch.Tensor) and isinstance(like, torch.Tensor):
        return value.to(like.dtype) if value.is_floating_point() and value.dtype != like.dtype else value
    if isinstance(value, (tuple, list)) and isinstance(like, (tuple, list)) and len(value) == len(like):
        return type(value)(_in_dtypes_of(v, l) for v, l in zip(value, like))
    return value


def _call(node: Node, value_of):
    args, kwargs = map_arg((node.args, node.kwargs), value_of)
    with torch.no_grad():
        return node.target(*args, **kwargs)


def _compare_grad(grad, key, record, reference, loss_scaling, grad_order) -> None:
    """A gradient hook of the rewritten run: measure the gradient against FP32's and note the first inf/NaN."""
    unscaled = grad.detach() / loss_scaling
    expected = reference.grads[key]
    record.grad_error = worst(record.grad_error, relative_error(unscaled, expected))
    if nonfinite_where_finite(unscaled, expected):
        record.grad_nonfinite = True
    grad_order.append(record)


def _scalar_loss(outputs) -> torch.Tensor | None:
    """The model's loss: its first scalar floating output (transformers' `.loss`)."""
    return next((t for t in floating_leaves(outputs) if t.dim() == 0), None)
