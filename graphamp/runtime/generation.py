"""HF `generate()` through rewritten graphs: `amp_model.generate(...)` runs its forward calls in mixed precision.

generate() calls the model's forward once on the prompt (prefill) and once per new token (decode), passing the
KV cache in and taking the updated cache from the output. For the length of the call, the original's forward
is routed through the AmpModule: with transformers' pytree registration of DynamicCache (the one it made for
torch.export), the cache's tensors are graph inputs and outputs, and each step's signature is captured with
dynamic dims at once, so a generation costs one prefill and one decode capture, whatever the lengths.
Where a step cannot be captured, generation runs the original model in FP32 and says why, once.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import warnings
import weakref

import torch.utils._pytree as pytree

from graphamp.errors import CaptureError

__all__ = ["generate", "register_cache_pytree_for"]

# AmpModule -> why its generation cannot be captured: later calls go straight to the original.
_uncapturable: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate(amp_model, *args, **kwargs):
    """`amp_model.original_module.generate(*args, **kwargs)`, its forward calls running through rewritten graphs.

    Args:
        amp_model: an AmpModule whose original model has HF's `generate()`.
        *args, **kwargs: what `generate()` takes (input_ids, max_new_tokens, do_sample, ...).
    """
    original = amp_model.original_module
    if amp_model in _uncapturable:
        return original.generate(*args, **kwargs)
    _register_cache_pytree()
    try:
        with _forward_through(amp_model):
            return original.generate(*args, **kwargs)
    except CaptureError as error:
        _uncapturable[amp_model] = str(error)
        warnings.warn(
            f"graphamp could not capture the generation steps of {type(original).__name__}, so generate() runs "
            f"the original model in FP32 (this is said once): {error}",
            stacklevel=3,
        )
        return original.generate(*args, **kwargs)


@contextlib.contextmanager
def _forward_through(amp_model):
    """Route the original's forward through `amp_model` while the block runs."""
    original = amp_model.original_module
    own_forward = original.__dict__.get("forward")  # a hook's wrapper (accelerate) stays the inner call
    inner = own_forward or functools.partial(type(original).forward, original)
    dynamic = True if amp_model.dynamic is None else amp_model.dynamic
    capturing = False

    def forward(*args, **kwargs):
        nonlocal capturing
        if capturing:  # torch.export is tracing the model itself
            return inner(*args, **kwargs)
        capturing = True
        try:
            return amp_model._run(args, kwargs, dynamic)
        finally:
            capturing = False

    original.forward = forward
    try:
        yield
    finally:
        if own_forward is None:
            del original.forward
        else:
            original.forward = own_forward


def register_cache_pytree_for(model) -> None:
    """For a transformers model, DynamicCache as a pytree node before its first capture: a forward that returns
    its cache (use_cache=True, the default of decoder configs) captures, and the cache comes back from the graph."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        _register_cache_pytree()


def _register_cache_pytree() -> None:
    """DynamicCache as a pytree node, so that its tensors are graph inputs and outputs.

    transformers' own registration (made for torch.export) rebuilds a cache by concatenating its tensors into
    new ones, which drops the dynamic-dim markers torch.export reads and copies the cache on every step; the
    registration here keeps the tensors themselves, with the same flattened layout. When transformers' is in
    place already, it serves (the decode step is then captured per cache length).
    """
    from transformers import DynamicCache
    from transformers.integrations import executorch

    if DynamicCache in pytree.SUPPORTED_NODES:
        return

    def flatten(cache):
        return executorch._flatten_cache_dict(executorch._get_cache_dict(cache), executorch._get_dynamic_cache_layout(cache))

    def flatten_with_keys(cache):
        return executorch._flatten_cache_dict_with_keys(
            executorch._get_cache_dict(cache), executorch._get_dynamic_cache_layout(cache)
        )

    pytree.register_pytree_node(
        DynamicCache,
        flatten,
        _cache_keeping_tensors,
        serialized_type_name=f"{DynamicCache.__module__}.{DynamicCache.__name__}",
        flatten_with_keys_fn=flatten_with_keys,
    )


def _cache_keeping_tensors(values, context):
    """A DynamicCache whose layers hold `values` themselves (transformers' unflatten for sliding windows)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    from transformers.integrations import executorch

    dictionary_keys, layout = context
    if any(window is not None for window in layout):
        return executorch._unflatten_dynamic_cache(values, context)
    tensors = pytree._dict_unflatten(values, dictionary_keys)
    layers = []
    for keys, values_, _ in itertools.zip_longest(tensors["key_cache"], tensors["value_cache"], layout):
        layer = DynamicLayer()
        if keys is not None:
            layer.lazy_initialization(keys, values_)
            layer.keys, layer.values = keys, values_
        layers.append(layer)
    cache = DynamicCache()
    cache.layers = layers
    return cache
