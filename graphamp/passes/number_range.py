"""Numbers the model wrote for float32 keep their meaning where the cast pass makes them low.

The FP32 trace freezes `torch.finfo(x.dtype).min` as float32's min (-3.4e38), where eager code under autocast reads
the low dtype's. Cast down, it would become -inf: a fully masked row's softmax then gives NaN. The low dtype's own
finite min/max means what the model meant there; infinities and NaN stay as they are.
"""

from __future__ import annotations

import math

import torch
from torch.fx import Graph, Node

from graphamp.policy.aten_ops import argument_value, set_argument
from graphamp.torch_private import FakeTensor, OpOverload, op_schema

__all__ = ["CONSTANT_INPUT", "ConstantsBeyondRange", "clamp_scalars_to_range"]

# The meta key a front end sets on a placeholder that holds a constant the model made (export's lifted constants).
CONSTANT_INPUT = "graphamp_constant_input"


def clamp_scalars_to_range(node: Node, dtype: torch.dtype) -> None:
    """An op the pass made run low keeps the meaning of its number arguments beyond that dtype's range.

    HF writes "minus infinity" as `torch.finfo(float32).min` (`masked_fill(scores, mask, -3.4e38)`), which
    bfloat16 and float16 kernels refuse."""
    limit = torch.finfo(dtype).max
    for argument in op_schema(node.target).arguments:
        kind = argument.type  # clamp's bounds are optional numbers (`Scalar?`): clamp(min=finfo(h.dtype).min)
        kind = kind.getElementType() if isinstance(kind, torch.OptionalType) else kind
        value = argument_value(node, argument, None) if isinstance(kind, torch.NumberType) else None
        if _beyond(value, limit):
            set_argument(node, argument, math.copysign(limit, value))


class ConstantsBeyondRange:
    """Which values of a graph are constants (made from no input, parameter or buffer) that may hold finite
    numbers beyond a low dtype's range: `torch.tensor(finfo.min)`, `full([], -3.4e38)`, ops on those.

    A constant's cast down saturates (the cast pass's `_saturate`); other values' casts stay plain, so that an
    activation that overflows is inf under graphamp as under autocast, and loss scaling sees it."""

    def __init__(self, graph: Graph, dtype: torch.dtype):
        self.limit = torch.finfo(dtype).max
        self.beyond: dict[Node, bool] = {}  # constants only: whether the value may hold numbers beyond the range
        for node in graph.nodes:
            if node.op == "get_attr" or node.op == "placeholder" and node.meta.get(CONSTANT_INPUT):
                self.beyond[node] = self._attribute_beyond(graph, node)
            elif node.op == "call_function" and self._made_of_constants(node):
                self.beyond[node] = any(self.beyond.get(n, False) for n in node.all_input_nodes) or any(
                    _beyond(value, self.limit) for value in (*node.args, *node.kwargs.values())
                )

    def may_exceed(self, value: Node) -> bool:
        return self.beyond.get(value, False)

    def _made_of_constants(self, node: Node) -> bool:
        """Every tensor it reads is a constant, and it draws no random numbers."""
        if isinstance(node.target, OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
            return False
        return all(n in self.beyond or not isinstance(n.meta.get("val"), torch.Tensor) for n in node.all_input_nodes)

    def _attribute_beyond(self, graph: Graph, node: Node) -> bool:
        """A real tensor's values are known; a fake one's, or a constant input's, are not."""
        value = getattr(graph.owning_module, node.target, None) if node.op == "get_attr" else None
        if node.op == "placeholder" or isinstance(value, FakeTensor):
            return True
        return isinstance(value, torch.Tensor) and bool(
            value.is_floating_point() and (value.isfinite() & (value.abs() > self.limit)).any())


def _beyond(value, limit: float) -> bool:
    return isinstance(value, float) and math.isfinite(value) and abs(value) > limit
