"""What a rewritten model's call returns, where the cast pass computed it low: a float32 tensor over low storage.

A float32 copy would double a language model's largest activation; the low value is handed out as a
`LowStorageTensor` (torchao float8's pattern) that every op reads upcast. What it keeps low, and why: docs/compile.md,
"The logits". Reads allocate their float32 copy for the op and free it after: concurrent readers share nothing.
"""

from __future__ import annotations

import copy
import functools

import torch

from graphamp.policy.aten_ops import is_written
from graphamp.torch_private import (
    disabled_torch_function_impl, make_wrapper_subclass, never_a_frame_of_its_own, op_schema, pytree, view_base,
)

__all__ = [
    "LowStorageTensor", "example_of_storage", "graph_inputs", "presented_as_float32", "stored_values", "times_of",
    "upcasts_of",
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
# Ops whose result (indices) is the same on the stored values: the upcast is exact and keeps the order. Run on them,
# they take no float32 copy of the whole tensor (an accuracy's argmax over the logits, autocast's bytes).
_INDEX_OPS = {aten.argmax.default, aten.argmin.default}


class LowStorageTensor(torch.Tensor):
    """A float32 tensor whose values are stored in bfloat16 or float16: what a rewritten model returns where the
    cast pass computed the value low. Use it as the float32 tensor it presents; `stored_values(t)` is the low
    tensor itself (no copy).

    `times` (a float32 scalar tensor) makes it present `stored * times`: a float16 gradient that still holds the
    loss scaling (times = 1/scale) between two graphs, since float16 cannot hold it unscaled
    (training/in_graph_scaling.py). A write into such a tensor first stores its values in float32."""

    @staticmethod
    def __new__(cls, stored: torch.Tensor, times: torch.Tensor | None = None):
        return make_wrapper_subclass(cls, stored, torch.float32)

    def __init__(self, stored: torch.Tensor, times: torch.Tensor | None = None):
        self._stored = stored
        self._times = times

    __torch_function__ = disabled_torch_function_impl

    @classmethod
    @never_a_frame_of_its_own  # runs eagerly between graphs: dynamo must not compile it as a frame of its own
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        how = _how_it_runs(func, args, kwargs)
        if how == "on the storage":
            times = args[0]._times
            return pytree.tree_map_only(torch.Tensor, lambda t: LowStorageTensor(t, times),
                                        func(args[0]._stored, *args[1:], **kwargs))
        if how == "the stored values":
            return func(args[0]._stored, *args[1:], **kwargs)
        if how == "moved":
            return LowStorageTensor(func(args[0]._stored, **kwargs))
        # A read upcasts each LowStorageTensor; a write goes into the storage of those it writes (rounded to the
        # storage dtype, as into a low tensor) and returns them.
        writes, written = _written_arguments(func), {}
        args = [_storage_if_written(v, a.name in writes, written) for a, v in zip(op_schema(func).arguments, args)]
        kwargs = {name: _storage_if_written(v, name in writes, written) for name, v in kwargs.items()}
        result = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, lambda t: written.get(id(t), t), result)

    def __tensor_flatten__(self):
        return ["_stored"] + (["_times"] if self._times is not None else []), None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return LowStorageTensor(inner["_stored"], inner.get("_times"))

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
            memo[id(self)] = LowStorageTensor(copy.deepcopy(self._stored, memo), copy.deepcopy(self._times, memo))
        return memo[id(self)]

    def numpy(self, *, force: bool = False):
        return _upcast(self).detach().numpy(force=force)

    def tolist(self):
        return _upcast(self).tolist()


def upcasts_of(func, args: tuple, kwargs: dict) -> list[torch.dtype]:
    """The storage dtypes of the LowStorageTensors `func(*args, **kwargs)` reads upcast, one each (a recorder of
    the kernels that ran counts these casts, which run inside __torch_dispatch__, below any dispatch mode)."""
    if _how_it_runs(func, args, kwargs) != "read or write":
        return []
    writes = _written_arguments(func)
    named = [*zip((a.name for a in op_schema(func).arguments), args), *kwargs.items()]
    return [t._stored.dtype for name, value in named if name not in writes
            for t in pytree.tree_leaves(value) if isinstance(t, LowStorageTensor)]


def _how_it_runs(func, args: tuple, kwargs: dict) -> str:
    """How __torch_dispatch__ runs `func`: "on the storage" (it only moves or reshapes its first argument: the
    result stays low), "the stored values" (a cast to the storage dtype, an index op), "moved" (`.to(device)`), else
    "read or write"."""
    first = args[0] if args else None
    if isinstance(first, LowStorageTensor):
        if func in _STORAGE_OPS:
            return "on the storage"
        if first._times is not None:
            return "read or write"
        if func in _INDEX_OPS or (func is aten._to_copy.default and kwargs.get("dtype") == first._stored.dtype):
            return "the stored values"
        if func is aten._to_copy.default and kwargs.get("dtype") is None:
            return "moved"
    return "read or write"


@functools.cache  # asked on every op that reads a LowStorageTensor
def _written_arguments(func) -> frozenset[str]:
    """The names of the arguments `func` writes into (in-place and out= ops)."""
    return frozenset(a.name for a in op_schema(func).arguments if is_written(a))


def _storage_if_written(value, written: bool, targets: dict):
    """An argument as the op takes it: the storage of a LowStorageTensor it writes (remembered in `targets`, so
    that the op's result is the LowStorageTensor again), every LowStorageTensor it reads upcast."""
    if written and isinstance(value, LowStorageTensor):
        if value._times is not None:  # the op writes presented values: hold them as they are, in float32
            value._stored, value._times = _upcast(value), None
        targets[id(value._stored)] = value
        return value._stored
    return pytree.tree_map_only(LowStorageTensor, _upcast, value)


def _upcast(tensor: LowStorageTensor) -> torch.Tensor:
    if tensor._times is None:
        return tensor._stored.to(torch.float32)
    return tensor._stored.to(torch.float32, copy=True).mul_(tensor._times)


class _PresentAsFloat32(torch.autograd.Function):
    """The low value as a LowStorageTensor; the float32 gradient that reaches it goes back in the value's dtype."""

    @staticmethod
    def forward(ctx, low: torch.Tensor):
        ctx.low_dtype = low.dtype
        ctx.set_materialize_grads(False)  # no float32 zeros for an output nothing read: the graph makes its own
        return LowStorageTensor(low.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None
        if isinstance(grad, LowStorageTensor) and grad._times is None:
            return grad._stored
        return grad.to(ctx.low_dtype)


@never_a_frame_of_its_own
def presented_as_float32(tensors: list[torch.Tensor], by_itself: bool = False) -> list[torch.Tensor]:
    """Each low tensor of `tensors` as the float32 tensor the FP32 model would have returned; those that view one
    base (an output and its slice) come back as views of one LowStorageTensor, so they stay each other's views.
    `by_itself`: each presented over itself, its own autograd record kept (eager code's view may come from an
    autograd Function: a module's full backward hook, a gradient reversal's view_as; its base would skip it)."""
    shown: dict[int, torch.Tensor] = {}
    result = []
    for tensor in tensors:
        base = None if by_itself else view_base(tensor)
        # A view of a graph input views its detached storage (no autograd record): shown by itself, it keeps its grad
        base = tensor if base is None or (tensor.requires_grad and not base.requires_grad) else base
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


def times_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The factor a LowStorageTensor presents its stored values times (a gradient holding the loss scaling)."""
    return tensor._times if isinstance(tensor, LowStorageTensor) else None


def example_of_storage(value):
    """What a graph taking `value` low is traced and compiled on: its storage, requiring grad as `value` does."""
    if not isinstance(value, LowStorageTensor):
        return value
    return value._stored.detach().requires_grad_(value.requires_grad)
