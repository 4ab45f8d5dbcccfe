"""A float32 output whose cast up from the low-precision value is made when something first reads its values.

fp32_outputs returns a language model's logits in float32, batch x sequence x vocabulary: 32 MiB on a CPU-size
GPT-2, alive beside the bfloat16 logits the loss saved for its backward. A loop that only reads the loss HF
computed inside (`model(**batch).loss`) never reads them, and torch.autocast, which returns the bfloat16 logits,
never makes that copy. A DeferredUpcast holds the low-precision value and says what the float32 output says
(dtype, shape, strides, requires_grad) without allocating it; the first op that reads its values makes the cast and
swaps it into the same Python object (`torch.utils.swap_tensors`), which from then on is a plain float32 tensor with
the autograd history of the eager cast. The values are those of the eager cast: a widening cast is exact.

Where the swap cannot be made (torch holds a reference of its own, as inside an autograd.Function's forward, or
something keeps a weak reference), the cast is made once and kept, and every op reads it through
__torch_dispatch__. Either way the object behaves as the float32 tensor, reads and writes alike.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

__all__ = ["DeferredUpcast", "deferred_upcast", "plain_arguments", "plain_tensor"]

_Tensor = torch.Tensor
# What these return is known without the values: they never make the cast.
_READS_NO_VALUES = frozenset(
    [getattr(_Tensor, name).__get__ for name in (
        "dtype", "shape", "device", "requires_grad", "ndim", "layout", "grad_fn", "is_leaf", "itemsize", "nbytes",
        "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested",
    )]
    + [getattr(_Tensor, name) for name in (
        "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
        "is_floating_point", "is_complex", "is_signed", "element_size", "get_device", "__len__", "__hash__",
    )]
)


class DeferredUpcast(torch.Tensor):
    """The float32 output `cast(low)` (same sizes and strides), made on the first read of its values."""

    @staticmethod
    def __new__(cls, low: torch.Tensor, dtype: torch.dtype, cast: Callable[[torch.Tensor], torch.Tensor]):
        self = torch.Tensor._make_wrapper_subclass(
            cls, low.size(), strides=low.stride(), dtype=dtype, device=low.device, requires_grad=False
        )
        self._low = low.detach()
        self._cast = cast
        self._values = None  # the cast, once made and kept (when the swap could not be made)
        return self

    def _kept_values(self) -> torch.Tensor:
        if self._values is None:
            self._values = self._cast(self._low)
            self._low = None
        return self._values

    @torch.compiler.disable  # a function dynamo compiles reads it as the plain tensor it becomes here
    def _become_plain(self) -> None:
        """Make the cast; swap it into this object if nothing else references it, else keep it."""
        if self._values is not None:
            return
        with torch._C.DisableTorchFunctionSubclass():
            swappable = self._use_count() == 1 and not weakref.getweakrefs(self)
            if swappable:
                # A copy of this tensor, which __torch_dispatch__ answers with the cast: autograd links the result to
                # this tensor's own history, whatever made it, through the eager cast's ToCopyBackward0.
                # inference_mode(False): a training call's output stays a normal tensor when first read in inference.
                with torch.inference_mode(False), torch.enable_grad():
                    plain = self.to(self.dtype, copy=True)
        try:
            if swappable:
                torch.utils.swap_tensors(self, plain)
                return
        except RuntimeError:  # torch's own checks of the swap (a use count taken between): keep the cast instead
            pass
        self._kept_values()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _READS_NO_VALUES:
            for arg in pytree.tree_leaves((args, kwargs)):
                if type(arg) is cls:
                    arg._become_plain()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if (
            func is torch.ops.aten._to_copy.default and type(source) is cls and source._values is None
            and kwargs == {"dtype": source.dtype}
        ):
            return source._cast(source._low)  # a copy in its own dtype (the swap's): a fresh cast, nothing kept here
        args, kwargs = pytree.tree_map_only(cls, cls._kept_values, (args, kwargs))
        return func(*args, **kwargs)


class _DeferredUpcastFunction(torch.autograd.Function):
    """The autograd node of the cast: the gradient goes back to the low-precision value in its own dtype."""

    @staticmethod
    def forward(ctx, low: torch.Tensor, dtype: torch.dtype, cast):
        ctx.low_dtype = low.dtype
        return DeferredUpcast(low, dtype, cast)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.low_dtype), None, None


def deferred_upcast(low: torch.Tensor, dtype: torch.dtype, cast: Callable[[torch.Tensor], torch.Tensor]):
    """`cast(low)` (a `low.to(dtype)` without autograd), made when its values are first read; differentiable."""
    return _DeferredUpcastFunction.apply(low, dtype, cast)


def plain_tensor(value: DeferredUpcast) -> torch.Tensor:
    """The float32 tensor a DeferredUpcast stands for, as a plain tensor (a graph's input, a capture's example)."""
    value._become_plain()
    if type(value) is not DeferredUpcast:
        return value  # swapped: the object itself is plain now
    with torch._C.DisableTorchFunctionSubclass():
        return torch.ops.aten.alias.default(value)  # a view of the kept cast; autograd: a view of `value`


def plain_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) with every DeferredUpcast in them (one AmpModule's output fed to another) made plain."""
    top = (*args, *kwargs.values())
    if not any(type(x) is DeferredUpcast or isinstance(x, (list, tuple, dict)) for x in top):
        return args, kwargs  # the usual call, tensors and scalars: no walk
    if not any(type(x) is DeferredUpcast for x in pytree.tree_leaves(top)):
        return args, kwargs
    return pytree.tree_map_only(DeferredUpcast, plain_tensor, (args, kwargs))
