"""What the cast pass and the doctor's probe ask of an ATen op node, answered from the op's schema.

Which inputs an op writes in place, which are a normalization's FP32 parameters, whether it draws random
numbers, whether the model chose its dtype itself, and the op families the cast pass treats specially.
"""

from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from graphamp.policy.lists import op_lookup_keys
from graphamp.torch_private import op_schema

__all__ = [
    "FP32_ACCUMULATING_OPS", "MODEL_CAST_OPS", "NORM_OPS", "RESHAPE_OPS", "SAME_DTYPE_OPS", "TRACE_ASSERTS",
    "VIEW_OPS", "argument_value", "draws_random_numbers", "functional_of_out_call", "has_explicit_float_dtype",
    "is_written", "norm_parameter_inputs", "set_argument", "viewed_input", "written_inputs",
]

aten = torch.ops.aten

# Casts the model writes itself; they are kept as written and never folded away.
MODEL_CAST_OPS = {
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other,
    aten.type_as.default,
}
# Normalization kernels take half X with FP32 scale/bias/statistics and accumulate in FP32 inside (Paddle
# keeps these inputs FP32 too): those inputs are never cast and do not decide a gray op's dtype.
NORM_OPS = {
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "instance_norm", "layer_norm", "native_layer_norm", "group_norm",
    "native_group_norm",
}
# Kernels that compute in FP32 inside on a float16/bfloat16 input (CPU and CUDA softmax and sum accumulate in
# float, at::opmath_type) and write the input's dtype: fed to a GEMM only, their low output is what a cast of
# their FP32 result would have given.
FP32_ACCUMULATING_OPS = {"softmax", "_softmax", "_safe_softmax", "sum", "mean"}
_NORM_PARAMETER_ARGS = {"weight", "bias", "running_mean", "running_var"}
# Ops that only reshape (same elements, same order): a cast of their result is their result on a cast of
# their input, so one cast serves a value and all its reshapes.
RESHAPE_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
}
# Ops that only re-index their input (a view): a normalization's output read through them still reaches its reader
# in the low dtype unchanged.
VIEW_OPS = {aten.permute.default, aten.transpose.int, aten.t.default, aten.contiguous.default, aten.expand.default}
# Kernels that refuse a source of another floating dtype than the tensor they index into, though their fake (meta)
# kernels accept it: type promotion cannot be asked of fake values for them.
SAME_DTYPE_OPS = {op + "_" * in_place for op in ("index_copy", "index_add", "index_put", "index_reduce", "put",
                                                 "_index_put_impl") for in_place in (False, True)}
# export's checks that a `.to()` result has the traced dtype; after the rewrite the dtype may differ.
TRACE_ASSERTS = {aten._assert_tensor_metadata.default}

_NOT_GIVEN = object()


def argument_value(node: Node, argument: torch.Argument, default=_NOT_GIVEN):
    """What `node` passes for one schema argument: by keyword, by position, else `default` (the schema's own
    default when none is given)."""
    index = op_schema(node.target).arguments.index(argument)
    if argument.name in node.kwargs:
        return node.kwargs[argument.name]
    if index < len(node.args):
        return node.args[index]
    return argument.default_value if default is _NOT_GIVEN else default


def set_argument(node: Node, argument: torch.Argument, value) -> None:
    """Pass `value` for one schema argument: in place of a positional one, else by keyword."""
    index = op_schema(node.target).arguments.index(argument)
    if index < len(node.args) and argument.name not in node.kwargs:
        node.args = (*node.args[:index], value, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, argument.name: value}


def _inputs_where(node: Node, predicate) -> set[Node]:
    """The input nodes passed for the schema arguments that satisfy `predicate`."""
    found = set()
    for argument in op_schema(node.target).arguments:
        if predicate(argument):
            map_arg(argument_value(node, argument, None), found.add)
    return found


def viewed_input(node: Node) -> Node | None:
    """The input whose storage the op's output is: the base of a view (slice's, transpose's, each of split's pieces'
    self) or the tensor an in-place op writes and returns (relu_'s self); None where the output is new memory."""
    schema = op_schema(node.target)
    alias = schema.returns[0].alias_info if schema.returns else None
    shared = [a for a in schema.arguments if a.alias_info and alias and alias.before_set <= a.alias_info.before_set]
    value = argument_value(node, shared[0], None) if len(shared) == 1 else None
    return value if isinstance(value, Node) else None


def is_written(argument) -> bool:
    """Whether an op writes into this argument of its schema (`relu_`'s self, a `torch.library` op's mutates_args, an
    `out=` tensor)."""
    return argument.alias_info is not None and argument.alias_info.is_write


def written_inputs(node: Node) -> set[Node]:
    """The inputs an op writes into in place (`relu_`'s self, `add_`'s self, an `out=` tensor)."""
    return _inputs_where(node, is_written)


def functional_of_out_call(node: Node):
    """For a call that writes its result into one `out=` tensor (`mm.out`, `addmm.out`): the overload that returns it
    instead (`mm.default`), taking the same other arguments; None for any other call."""
    schema = op_schema(node.target)
    outs = [a for a in schema.arguments if a.is_out]
    if len(outs) != 1 or len(schema.returns) != 1:
        return None
    inputs = [a.name for a in schema.arguments if not a.is_out]
    packet = node.target.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        if [a.name for a in op_schema(candidate).arguments] == inputs and not op_schema(candidate).is_mutable:
            return candidate
    return None


def norm_parameter_inputs(node: Node) -> set[Node]:
    """A normalization op's weight, bias and running statistics (they stay FP32)."""
    if op_lookup_keys(node.target)[1] not in NORM_OPS:
        return set()
    return _inputs_where(node, lambda argument: argument.name in _NORM_PARAMETER_ARGS)


def has_explicit_float_dtype(node: Node) -> bool:
    """softmax(x, -1, dtype=torch.float32) and the like: the model picked the compute dtype."""
    for argument in op_schema(node.target).arguments:
        if argument.name == "dtype":
            value = argument_value(node, argument, None)
            return isinstance(value, torch.dtype) and value.is_floating_point
    return False


def draws_random_numbers(node: Node) -> bool:
    """Random ops (dropout, bernoulli); attention and dropout with a probability of 0 draw none."""
    if torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    for argument in op_schema(node.target).arguments:
        value = argument_value(node, argument)
        if (argument.name in ("p", "dropout_p") and value == 0) or (argument.name == "train" and value is False):
            return False
    return True
