"""The eager policy's rules: what the lists say of each torch callable the model's Python code calls.

A torch call names its ATen op (`Tensor.__radd__` is 'add', F.linear 'linear'); the lists decide it (white, black,
gray, unlisted; an overload entry its overload), and its schema tells what it writes and whether it takes `dtype=`.
`Rules` computes that once per AmpConfig and torch callable, with the test, on a call's input values, that the rule
casts none of them: shared by every policy and thread. eager_policy.py's TorchFunctionMode applies them, as the cast
pass applies the same lists to graph nodes (the config apart from the pass, as torch.ao's QConfigMapping).
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from graphamp.frontends.low_storage import LowStorageTensor
from graphamp.policy.aten_ops import NORM_OPS, SAME_DTYPE_OPS, is_written
from graphamp.policy.config import AmpConfig
from graphamp.policy.dtypes import HALF_DTYPES
from graphamp.policy.kernel_support import runs_low_on
from graphamp.policy.lists import BLACK, GRAY, WHITE, Decision
from graphamp.torch_private import OpOverload, OpOverloadPacket, op_schema, qualified_op_name, resolve_overload

__all__ = [
    "FOLLOW", "FOLLOWS_INPUTS", "SCALED_CAST", "SCALED_WRITE", "UNKNOWN", "ByOverload", "Rule", "Rules", "all_tensors",
    "first_tensor", "has_rules", "rules_for", "runs_low_on_cached",
]

# Torch calls that name no op the lists decide, or that only read or reshape what they get: never cast.
_LEFT_ALONE = frozenset({
    "__get__", "__set__", "__getitem__", "__setitem__", "__len__", "__iter__", "__repr__", "__format__", "__bool__",
    "__contains__", "__hash__", "__eq__", "__ne__", "size", "dim", "numel", "stride", "storage_offset", "item",
    "tolist", "is_floating_point", "is_complex", "is_contiguous", "data_ptr", "element_size", "backward",
    "requires_grad_", "retain_grad", "register_hook", "detach", "detach_", "clone", "contiguous", "view", "reshape",
    "view_as", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "permute", "transpose", "t", "expand",
    "expand_as", "narrow", "select", "slice", "split", "chunk", "unbind", "movedim", "as_strided", "unfold",
    "copy_", "zero_", "fill_", "normal_", "uniform_", "cpu", "cuda",
})
# The model's own casts: kept as written, as the cast pass keeps them.
_MODEL_CASTS = frozenset({"to", "_to_copy", "type", "type_as", "float", "half", "bfloat16", "double"})
# Python operators as the ATen ops they run (the reflected and in-place forms are derived from these).
_OPERATOR_OPS = {"truediv": "div", "div": "div", "floordiv": "floor_divide", "mod": "remainder"}
# Python functions of these modules whose name is no ATen op are followed inside (F.cross_entropy,
# F.interpolate): the ATen ops they call are decided, as the cast pass decides them after tracing.
_FOLLOWED_MODULES = ("torch.nn.functional", "torch.functional")
FOLLOW = object()  # the rule of such a function
UNKNOWN = object()  # a callable not looked up yet
_HALF = frozenset(HALF_DTYPES)
FOLLOWS_INPUTS = (GRAY, Decision.UNLISTED)  # a module constant: an enum member read off its class costs ~0.2 µs

# runs_low_on per (op, device, dtype), remembered: it reads device.type (~0.2 µs a read) on every normalization call.
runs_low_on_cached = functools.lru_cache(maxsize=None)(runs_low_on)
# Every floating dtype torch names: a black op keeps its inputs when their dtypes are all in _FLOATING - _HALF.
_FLOATING = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point)


@dataclass(frozen=True)
class Rule:
    """What the lists say of one torch callable."""

    decision: str  # a Decision
    source: str
    op: str  # the ATen op (packet) name
    written: frozenset  # the positions and names of the arguments it writes, never cast (add_'s self: 0, 'self')
    norm: bool  # a normalization: only its first tensor is data, the rest are FP32 parameters
    dtype_argument: bool  # a black op that computes in float32 inside when passed dtype=float32 (softmax, sum)
    promotes: bool  # promote.txt: mixed inputs are cast to the widest
    same_dtype: bool  # index_copy_ and the like: the kernel wants the source in its target's dtype
    plain: bool  # neither in-place nor a normalization: a white call casts every floating input down
    # Bound once for the hot path: whether the rule casts none of a call's input values (args, then kwargs), told
    # from their dtypes alone.
    keeps: Callable[[tuple], bool]


class Rules:
    """The rules of one AmpConfig, per torch callable, computed once and shared by every call and thread."""

    def __init__(self, config: AmpConfig):
        self.config = config
        self.by_function: dict = {}
        self.scaled_by_function: dict = {}  # the same, for a policy whose float16 casts scale (scaled_rule)
        self.promotion: dict = {}  # (function, input dtypes) -> whether torch's promotion already runs it in FP32

    def rule_for(self, function):
        rule = self.by_function.get(function)
        if rule is None:
            rule = self.by_function[function] = self._rule(function)
        return rule

    def scaled_rule_for(self, function):
        rule = self.scaled_by_function.get(function, UNKNOWN)
        if rule is UNKNOWN:
            rule = self.scaled_by_function[function] = _scaled_rule(self.rule_for(function), function)
        return rule

    def _rule(self, function):
        name = _op_name(function)
        if name is None:
            module = getattr(function, "__module__", None)
            return FOLLOW if isinstance(function, types.FunctionType) and module in _FOLLOWED_MODULES else None
        if name in _LEFT_ALONE or name in _MODEL_CASTS:
            return None
        entry = self.config.lists.classify_packet(name)
        rule = self._rule_of(name, entry)
        # An overload entry of another color ('add.Tensor' black, 'add' gray) decides its overload, as in the graphs:
        # a torch call names only the packet, so such a packet's calls are resolved to their overload.
        overloads = {overload: self._rule_of(name, other)
                     for overload, other in self.config.lists.overload_entries(name).items()
                     if entry is None or other.color != entry.color}
        return ByOverload(qualified_op_name(_aten_packet(name)), overloads, rule) if overloads else rule

    def _rule_of(self, name: str, entry) -> Rule:
        """The rule of the op `name` decided by the list `entry` (None: unlisted)."""
        lists = self.config.lists
        decision, source = (Decision(entry.color), entry.source) if entry is not None else (Decision.UNLISTED, "")
        packet = _aten_packet(name)
        dtype_argument = decision == BLACK and packet is not None and any(
            argument.name == "dtype"
            for overload in packet.overloads() for argument in op_schema(getattr(packet, overload)).arguments
        )
        written = _written_arguments(packet)
        if name.endswith("_") and not name.startswith("_"):  # in place, also for a packet torch.ops does not have
            written.add(0)
        norm = name in NORM_OPS
        return Rule(decision, source, name, frozenset(written), norm, dtype_argument,
                    lists.promotes_packet(name), name in SAME_DTYPE_OPS, not (written or norm),
                    _keeps(decision, name, norm, self.config))


def _scaled_rule(rule, function):
    """A rule under linked float16 loss scaling, where every crossing of float16's edge must be a scaled cast
    (training/eager_scaling.py): the model's own casts are looked at, and a normalization keeps no float16 data
    beside its float32 parameters, whose gradients would come out scaled; a copy into a tensor (`x32[i] = y16`) is one
    more place where a value crosses."""
    if type(rule) is ByOverload:  # each overload's rule scaled once, here: a call then picks among them
        return replace(rule, default=_scaled_rule(rule.default, function),
                       rules={overload: _scaled_rule(one, function) for overload, one in rule.rules.items()})
    name = (_op_name(function) or getattr(function, "__name__", None)) if rule is None else None
    if name in _MODEL_CASTS:  # x.float()
        return SCALED_CAST
    if name in ("__setitem__", "copy_"):
        return SCALED_WRITE
    if isinstance(rule, Rule) and rule.norm:
        return replace(rule, keeps=functools.partial(_only_dtypes, frozenset({torch.float32, torch.float64})))
    return rule


def _needs_no_gradient(values) -> bool:
    return not (values and isinstance(values[0], torch.Tensor) and values[0].requires_grad)


def _never(*_args) -> bool:
    return False


# _scaled_rule's rules for the model's own casts and for a copy into a tensor: each is looked at, as a crossing
SCALED_CAST = Rule(Decision.UNLISTED, "", "to", frozenset(), False, False, False, False, False, _needs_no_gradient)
SCALED_WRITE = Rule(Decision.UNLISTED, "", "copy_", frozenset({0}), False, False, False, False, False, _never)


@dataclass(frozen=True)
class ByOverload:
    """The rules of a packet whose overloads the lists decide apart: each call is resolved to its overload."""

    packet: str  # 'aten::add'
    rules: dict  # overload name -> its Rule
    default: Rule  # the packet's own rule, for the other overloads

    def pick(self, args, kwargs) -> Rule:
        try:
            overload = resolve_overload(self.packet, *args, **(kwargs or {}))
        except RuntimeError:  # no overload fits: the call raises as written, by the packet's rule
            return self.default
        return self.rules.get(overload or "default", self.default)


def _written_arguments(packet) -> set:
    """The positions and names of the arguments an op writes in place in any overload (a torch.library op's
    mutates_args), `out=` aside: they keep their tensor, as the cast pass leaves written inputs alone."""
    written = set()
    for overload in packet.overloads() if packet is not None else ():
        for index, argument in enumerate(op_schema(getattr(packet, overload)).arguments):
            if is_written(argument) and not argument.is_out:
                written |= {argument.name} if argument.kwarg_only else {index, argument.name}
    return written


def _keeps(decision: str, op: str, norm: bool, config: AmpConfig):
    """The test, on a call's input values, that the rule casts none of them: a white op on low (or float64) inputs, a
    black op on no low input, a gray op (O1) whose floating inputs share one dtype, a normalization (O1) whose data
    need no cast. One loop that stops at the first input it would cast: it runs on every torch call."""
    if norm and decision in FOLLOWS_INPUTS and config.level == "O1":
        return functools.partial(_norm_data_kept, op, config.dtype)
    if decision is WHITE:
        return functools.partial(_only_dtypes, frozenset({config.dtype, torch.float64}))
    if decision is BLACK:
        return functools.partial(_only_dtypes, _FLOATING - _HALF)
    return _one_floating_dtype if config.level == "O1" else _never


def _op_name(function) -> str | None:
    """The ATen op (packet) name of a torch callable, or None if it is no op: `__radd__` is 'add', `__iadd__`
    'add_', torch._C._nn.linear 'linear', torch.ops.mylib.op 'mylib::op'."""
    if isinstance(function, (OpOverload, OpOverloadPacket)):
        namespace, _, name = qualified_op_name(function).partition("::")
        return name if namespace == "aten" else f"{namespace}::{name}"
    name = getattr(function, "__name__", None)
    if not isinstance(name, str):
        return None
    if name.startswith("__") and name.endswith("__") and name != "__get__":
        base = name[2:-2]
        if base.startswith("i") and _operator_op(base[1:]) is not None:  # __iadd__: in place
            return _operator_op(base[1:]) + "_"
        if base.startswith("r") and base != "rsub" and _operator_op(base[1:]) is not None:
            return _operator_op(base[1:])
        return _operator_op(base) or name
    return name if _aten_packet(name) is not None else None


def _operator_op(name: str) -> str | None:
    name = _OPERATOR_OPS.get(name, name)
    return name if _aten_packet(name) is not None else None


def _aten_packet(name: str):
    if "::" in name:
        namespace, _, op = name.partition("::")
        return getattr(getattr(torch.ops, namespace, None), op, None) if hasattr(torch.ops, namespace) else None
    return getattr(torch.ops.aten, name, None) if not name.startswith("__") else None


def _only_dtypes(allowed: frozenset, values) -> bool:
    """Whether every floating tensor among the values (one level into lists) has a dtype in `allowed`."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dtype not in allowed and value.dtype.is_floating_point:
                return False
        elif isinstance(value, (list, tuple)) and not _only_dtypes(
                allowed, [item for item in value if isinstance(item, torch.Tensor)]):
            return False
    return True


def _norm_data_kept(op: str, low: torch.dtype, values) -> bool:
    """Whether a normalization's data (its first tensor) is float32, or low where this device's kernel takes low data
    with FP32 parameters."""
    data = first_tensor(values)
    if type(data) is LowStorageTensor:
        return False
    return data is None or data.dtype == torch.float32 or (
        data.dtype == low and runs_low_on_cached(op, data.device, low))


def _one_floating_dtype(values) -> bool:
    """Whether the floating tensors among the values (one level into lists) share one dtype, none a graph's low
    output presented as float32 (decided by its storage: eager_policy._deciding_dtypes)."""
    seen = None
    for value in values:
        if isinstance(value, torch.Tensor):
            if type(value) is LowStorageTensor:
                return False
            dtype = value.dtype
            if dtype is not seen and dtype.is_floating_point:
                if seen is not None:
                    return False
                seen = dtype
        elif isinstance(value, (list, tuple)):
            # rare (torch.cat): count them all; a graph's low output in the list decides by its storage too
            tensors = all_tensors(values, None)
            return not any(type(t) is LowStorageTensor for t in tensors) and \
                len({t.dtype for t in tensors if t.dtype.is_floating_point}) <= 1
    return True


def all_tensors(args, kwargs) -> list[torch.Tensor]:
    """The call's tensors, one level into lists and tuples (a loop: generators cost a frame each)."""
    tensors = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            tensors += [v for v in value if isinstance(v, torch.Tensor)]
    return tensors


def first_tensor(values) -> torch.Tensor | None:
    """The first tensor among the values, one level into lists and tuples: a normalization's data."""
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    return item
    return None


_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rules_for(config: AmpConfig) -> Rules:
    """The rules of one config, shared by every policy made of it while the config lives (an AmpConfig is frozen)."""
    found = _RULES.get(config)
    if found is None:
        found = _RULES[config] = Rules(config)
    return found


def has_rules(config: AmpConfig) -> bool:
    """Whether a policy of this config was made before (its rules are kept while the config lives)."""
    return config in _RULES
