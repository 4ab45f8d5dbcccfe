"""Input signatures and dynamic shapes: which capture serves a call (graphamp.dynamic_dims marks the dims a
capture leaves symbolic).

torch.compile's "automatic dynamic" rule, applied to torch.export: a signature's first capture is static; a
call that differs from it only in tensor sizes is captured once more with every dim torch.export can keep
symbolic, and that capture serves every later size its guards admit. A dynamic capture's cache key is the
signature without sizes; the shape environment's own guards say whether it fits a call.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, replace

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._guards import detect_fake_mode

__all__ = [
    "InputGuard", "InputSignature", "is_dynamic", "signature_of", "specialized_dims", "without_defaults",
]


@dataclass(frozen=True)
class InputSignature:
    """What decides a capture: mode, device, input structure, each leaf's kind and dtype, and (static) sizes."""

    training: bool
    device: Hashable
    spec: pytree.TreeSpec
    leaves: tuple[tuple[str, Hashable], ...]  # (leaf name, kind/dtype/rank or the non-tensor value)
    sizes: tuple | None  # each tensor leaf's shape (None for non-tensors); None in a dynamic capture's key

    def without_sizes(self) -> InputSignature:
        return replace(self, sizes=None)

    def differences(self, other: InputSignature) -> list[str]:
        """What differs from `other`, in the user's words: mode, keywords added or dropped, dtype, shape, value."""
        found = []
        if self.training != other.training:
            found.append(f"mode {'train' if other.training else 'eval'} → {'train' if self.training else 'eval'}")
        if self.device != other.device:
            found.append(f"device {other.device} → {self.device}")
        mine, theirs = dict(self.leaves), dict(other.leaves)
        found += [f"{name} added" for name in mine if name not in theirs]
        found += [f"{name} dropped" for name in theirs if name not in mine]
        for name in (n for n in mine if n in theirs and mine[n] != theirs[n]):
            found.append(f"{name} {_leaf_text(theirs[name])} → {_leaf_text(mine[name])}")
        if self.sizes is not None and other.sizes is not None and self.spec == other.spec:
            for (name, _), size, old in zip(self.leaves, self.sizes, other.sizes):
                if size != old:
                    found.append(f"{name} shape {tuple(old)} → {tuple(size)}")
        return found or ["input structure"]


def signature_of(training: bool, device, args: tuple, kwargs: dict) -> tuple[InputSignature, list]:
    """The call's signature and its flat inputs (the graph's user placeholders, in order)."""
    flat, spec, names = _flatten(args, kwargs)
    signature = InputSignature(
        training=training,
        device=device,
        spec=spec,
        leaves=tuple(zip(names, (_leaf_kind(x) for x in flat))),
        sizes=tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat),
    )
    return signature, flat


# (type and number of positional arguments, keyword names) -> (spec, leaf names), for calls whose every argument is a leaf.
_flat_calls: dict[tuple, tuple[pytree.TreeSpec, tuple[str, ...]]] = {}


def _flatten(args: tuple, kwargs: dict) -> tuple[list, pytree.TreeSpec, tuple[str, ...]]:
    """pytree's flattening of (args, kwargs) with each leaf's name; a call of tensors and scalars only (the
    usual one) reuses the spec and names of its shape of call: pytree's walk cost more than the rest of a call."""
    flat = [*args, *kwargs.values()]
    if all(_is_leaf(x) for x in flat):
        key = (type(args), len(args), tuple(kwargs))
        known = _flat_calls.get(key)
        if known is not None:
            return flat, *known
    else:
        key = None
    leaves_with_path, spec = pytree.tree_flatten_with_path((args, kwargs))
    names = tuple(_leaf_name(path) for path, _ in leaves_with_path)
    if key is not None and len(_flat_calls) < 256:
        _flat_calls[key] = (spec, names)
    return [leaf for _, leaf in leaves_with_path], spec, names


def _is_leaf(value) -> bool:
    """A value pytree never flattens: a tensor (unless its type is a registered node) or a plain scalar."""
    kind = type(value)
    return kind in (int, float, bool, str) or (isinstance(value, torch.Tensor) and kind not in pytree.SUPPORTED_NODES)


# forward's function -> its parameters (inspect.signature costs more than the rest of a call).
_forward_parameters = weakref.WeakKeyDictionary()


def without_defaults(model: nn.Module, kwargs: dict) -> dict:
    """kwargs without those passed at forward()'s own default value: they cannot change the graph."""
    if not kwargs:
        return kwargs
    forward = model.forward
    function = getattr(forward, "__func__", forward)  # a bound method's signature is its function's, less self
    keyable = _weakly_keyable(function)
    parameters = _forward_parameters.get(function) if keyable else None
    if parameters is None:
        try:
            parameters = inspect.signature(forward).parameters
        except (TypeError, ValueError):
            return kwargs
        if keyable:
            _forward_parameters[function] = parameters

    def is_default(name, value) -> bool:
        default = parameters[name].default if name in parameters else inspect.Parameter.empty
        if default is inspect.Parameter.empty or isinstance(value, torch.Tensor):
            return False
        return value is default or (type(value) is type(default) and isinstance(value, (bool, int, str)) and value == default)

    return {name: value for name, value in kwargs.items() if not is_default(name, value)}


def _weakly_keyable(function) -> bool:
    try:
        weakref.ref(function)
    except TypeError:
        return False
    return True


class InputGuard:
    """torch's guards over a dynamic capture's input sizes: whether a call of the same signature fits the graph."""

    def __init__(self, graph_module: torch.fx.GraphModule, lifted_count: int):
        values = [node.meta.get("val") for node in user_placeholders(graph_module, lifted_count)]
        self.tensor_positions = [i for i, value in enumerate(values) if isinstance(value, torch.Tensor)]
        fake_inputs = [values[i] for i in self.tensor_positions]
        self.shape_env = detect_fake_mode(fake_inputs).shape_env
        # Static dims included: the cache key of a dynamic capture carries no sizes.
        self.expression = self.shape_env.produce_guards_expression(fake_inputs, ignore_static=False)
        # Compiled once: evaluate_guards_expression evals what it is given, and compiling the text was most of a call.
        self._code = compile(self.expression, "<graphamp input guard>", "eval") if self.expression else None

    def fits(self, flat_inputs: list) -> bool:
        if self._code is None:
            return True
        return self.shape_env.evaluate_guards_expression(self._code, [flat_inputs[i] for i in self.tensor_positions])


def user_placeholders(graph_module: torch.fx.GraphModule, lifted_count: int) -> list[torch.fx.Node]:
    return list(graph_module.graph.find_nodes(op="placeholder"))[lifted_count:]


def is_dynamic(graph_module: torch.fx.GraphModule) -> bool:
    """Whether any placeholder of the graph has a symbolic size."""
    return any(
        isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape)
        for value in (node.meta.get("val") for node in graph_module.graph.find_nodes(op="placeholder"))
    )


def specialized_dims(
    graph_module: torch.fx.GraphModule, lifted_count: int, signature: InputSignature, seen_sizes: list[tuple]
) -> list[str]:
    """Dims that took more than one size in the calls seen but are static in the dynamic capture, and why."""
    found = []
    placeholders = user_placeholders(graph_module, lifted_count)
    for index, ((name, _), node) in enumerate(zip(signature.leaves, placeholders)):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            seen = {sizes[index][dim] for sizes in seen_sizes if sizes[index] is not None and len(sizes[index]) > dim}
            if isinstance(size, int) and len(seen) > 1:
                why = (
                    f"the call that made the dynamic capture had {size} there, and a dim of 0 or 1 is captured static"
                    if size in (0, 1)
                    else "the model's code requires this size (it meets a fixed size, e.g. a weight's)"
                )
                found.append(f"{name} dim {dim} is static at {size}: {why}")
    return found


def _leaf_name(path) -> str:
    """'input_ids', 'args[0]', 'past_key_values.key_cache[1]' for a leaf of (args, kwargs)."""
    where, *rest = path
    head = f"args[{rest[0].idx}]" if where.idx == 0 and rest else ""
    parts = rest[1:] if where.idx == 0 else rest
    text = head + "".join(
        f".{k.key}" if isinstance(k, pytree.MappingKey) and isinstance(k.key, str) else str(k) for k in parts
    )
    return text.lstrip(".") or "input"


def _leaf_kind(value) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.dim(), value.device)
    return (type(value), value) if isinstance(value, Hashable) else (type(value), id(value))


def _leaf_text(kind) -> str:
    if kind[0] == "tensor":
        return f"{str(kind[1]).removeprefix('torch.')} {kind[2]}-d tensor"
    return repr(kind[1]) if isinstance(kind[1], Hashable) else type(kind[1]).__name__
