"""What a rewritten model's call returns, where the cast pass computed it low: a float32 tensor over low storage.

The FP32 model returns float32; torch.autocast returns what its last op made (bfloat16 logits). Returning the low
value as it is would make the user's code after the call (their own loss) compute in bfloat16 what eager code and
autocast's region compute in float32; returning a float32 copy doubles the largest activation of a language
model, and the graph saves that copy for backward. So the value stays low and is handed out as a `LowStorageTensor`
(the pattern of torchao's float8 training tensors): its dtype is float32, and every op that reads it reads it
upcast, as a float32 tensor holding the same values would be read. What only moves or reshapes it (views, clone,
`.to(device)`, detach) stays low; a cast to its storage dtype takes the stored values as they are; writes into it
(in place, `out=`) round to its storage dtype, as they would into autocast's low output. Reads allocate their
float32 copy for the op and free it after, so concurrent readers share nothing mutable.
"""

from __future__ import annotations

import copy

import torch

from graphamp.torch_private import (
    disabled_torch_function_impl, make_wrapper_subclass, never_a_frame_of_its_own, op_schema, pytree, view_base,
)

__all__ = [
    "LowStorageTensor", "example_of_storage", "graph_inputs", "presented_as_float32", "stored_values", "upcasts_of",
]

aten = torch.ops.aten

# Ops that only move, reshape or copy their input: applied to the stored values, their result stays low.
_STORAGE_OPS = {
    aten.detach.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
    aten.as_strided.default, aten.unfold.default, aten.flatten.using_ints,
}


class LowStorageTensor(torch.Tensor):
    """A float32 tensor whose values are stored in bfloat16 or float16: what a rewritten model returns where the
    cast pass computed the value low. Use it as the float32 tensor it presents; `stored_values(t)` is the low
    tensor itself (no copy)."""

    @staticmethod
    def __new__(cls, stored: torch.Tensor):
        return make_wrapper_subclass(cls, stored, torch.float32)

    def __init__(self, stored: torch.Tensor):
        self._stored = stored

    __torch_function__ = disabled_torch_function_impl

    @classmethod
    @never_a_frame_of_its_own  # runs eagerly between graphs: dynamo must not compile it as a frame of its own
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in _STORAGE_OPS and isinstance(first, LowStorageTensor):
            result = func(first._stored, *args[1:], **kwargs)
            return pytree.tree_map_only(torch.Tensor, LowStorageTensor, result)
        if func is aten._to_copy.default and isinstance(first, LowStorageTensor):
            target = kwargs.get("dtype")
            if target == first._stored.dtype:  # a cast to the storage dtype: the stored values, exactly
                return func(first._stored, **kwargs)
            if target is None:  # .to(device): moves, stays low
                return LowStorageTensor(func(first._stored, **kwargs))
        if op_schema(func).is_mutable:  # a write into one: rounded into its storage, as into a low tensor
            return _written(func, args, kwargs)
        return func(*pytree.tree_map_only(LowStorageTensor, _upcast, args),
                    **pytree.tree_map_only(LowStorageTensor, _upcast, kwargs))

    def __tensor_flatten__(self):
        return ["_stored"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return LowStorageTensor(inner["_stored"])

    def __repr__(self, *, tensor_contents=None):
        return f"LowStorageTensor({_upcast(self)!r}, stored as {self._stored.dtype})"

    def __reduce_ex__(self, protocol):  # pickled (torch.save) as the float32 tensor it presents
        return _upcast(self).detach().__reduce_ex__(protocol)

    def data_ptr(self) -> int:  # where its values are (in the storage dtype): what identity checks compare
        return self._stored.data_ptr()

    def __deepcopy__(self, memo):  # torch's own tells a wrapper by data_ptr() == 0, which data_ptr() above is not
        if not self.is_leaf:
            return torch.Tensor.__deepcopy__(self, memo)  # torch's own refusal of a non-leaf
        if id(self) not in memo:
            memo[id(self)] = LowStorageTensor(copy.deepcopy(self._stored, memo))
        return memo[id(self)]

    def numpy(self, *, force: bool = False):
        return _upcast(self).detach().numpy(force=force)

    def tolist(self):
        return _upcast(self).tolist()


def upcasts_of(func, args: tuple, kwargs: dict) -> list[torch.dtype]:
    """The storage dtypes of the LowStorageTensors `func(*args, **kwargs)` reads upcast, one each (a recorder of
    the kernels that ran counts these casts, which run inside __torch_dispatch__, below any dispatch mode)."""
    shown = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, LowStorageTensor)]
    first = args[0] if args else None
    if not shown or (isinstance(first, LowStorageTensor) and (
            func in _STORAGE_OPS or func is aten._to_copy.default and kwargs.get("dtype") in (None, first._stored.dtype))):
        return []
    if op_schema(func).is_mutable:
        schema = op_schema(func).arguments
        writes = {a.name for a in schema if a.alias_info is not None and a.alias_info.is_write}
        written = [v for a, v in [*zip(schema, args), *((_Named(n), v) for n, v in kwargs.items())] if a.name in writes]
        shown = [t for t in shown if not any(t is w for w in written)]
    return [t._stored.dtype for t in shown]


class _Named:
    def __init__(self, name: str):
        self.name = name


def _upcast(tensor: LowStorageTensor) -> torch.Tensor:
    return tensor._stored.to(torch.float32)


def _written(func, args: tuple, kwargs: dict):
    """A mutating op: the LowStorageTensors it writes are replaced by their storage, those it reads upcast."""
    schema = op_schema(func).arguments
    writes = {a.name for a in schema if a.alias_info is not None and a.alias_info.is_write}
    targets = {}

    def argument(name, value):
        if not isinstance(value, LowStorageTensor):
            return value
        if name in writes:
            targets[id(value._stored)] = value
            return value._stored
        return _upcast(value)

    args = [argument(a.name, v) for a, v in zip(schema, args)]
    kwargs = {name: argument(name, v) for name, v in kwargs.items()}
    result = func(*args, **kwargs)
    return pytree.tree_map_only(torch.Tensor, lambda t: targets.get(id(t), t), result)


class _PresentAsFloat32(torch.autograd.Function):
    """The low value as a LowStorageTensor; the float32 gradient that reaches it goes back in the value's dtype."""

    @staticmethod
    def forward(ctx, low: torch.Tensor):
        ctx.low_dtype = low.dtype
        return LowStorageTensor(low.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return stored_values(grad) if isinstance(grad, LowStorageTensor) else grad.to(ctx.low_dtype)


@never_a_frame_of_its_own
def presented_as_float32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each low tensor of `tensors` as the float32 tensor the FP32 model would have returned; those that view one
    base (an output and its slice) come back as views of one LowStorageTensor, so they stay each other's views."""
    shown: dict[int, torch.Tensor] = {}
    result = []
    for tensor in tensors:
        base = view_base(tensor) if view_base(tensor) is not None else tensor
        if id(base) not in shown:
            shown[id(base)] = _PresentAsFloat32.apply(base) if base.requires_grad else LowStorageTensor(base)
        whole = shown[id(base)]
        result.append(whole if base is tensor else whole.as_strided(tensor.size(), tensor.stride(),
                                                                     tensor.storage_offset()))
    return result


class _Stored(torch.autograd.Function):
    """A LowStorageTensor's storage itself, for a graph that takes it low; its gradient goes back presented as
    float32 over the low gradient (no float32 copy: _PresentAsFloat32's backward takes its storage)."""

    @staticmethod
    def forward(ctx, shown: LowStorageTensor):
        return shown._stored.view_as(shown._stored)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return LowStorageTensor(grad)


@never_a_frame_of_its_own
def graph_inputs(args) -> list:
    """A graph's arguments, each LowStorageTensor among them replaced by its storage (gradients pass through)."""
    if not any(isinstance(a, LowStorageTensor) for a in args):
        return args
    return [(_Stored.apply(a) if a.requires_grad else a._stored) if isinstance(a, LowStorageTensor) else a
            for a in args]


def stored_values(tensor: torch.Tensor) -> torch.Tensor:
    """The low tensor a LowStorageTensor stores (itself, not a copy); any other tensor as it is."""
    return tensor._stored if isinstance(tensor, LowStorageTensor) else tensor


def example_of_storage(value):
    """What a graph taking `value` low is traced and compiled on: its storage, requiring grad as `value` does."""
    if not isinstance(value, LowStorageTensor):
        return value
    return value._stored.detach().requires_grad_(value.requires_grad)
