"""transformers' DynamicCache as a pytree node, so that a decoder's cache is a graph input and output.

A decoder's forward with use_cache=True (the config default) returns its DynamicCache, and generate() passes it
back in: with the cache registered before the first capture, torch.export flattens it like a tuple of tensors.
"""

from __future__ import annotations

import itertools
import sys

import torch.utils._pytree as pytree

__all__ = ["register_cache_pytree", "register_cache_pytree_for"]


def register_cache_pytree_for(model) -> None:
    """For a transformers model, DynamicCache as a pytree node before its first capture: a forward that returns
    its cache (use_cache=True, the default of decoder configs) captures, and the cache comes back from the graph."""
    # The loaded module, never the package's lazy attribute: that would import transformers' modeling stack
    # (accelerate, scipy, boto3: about 80 MiB resident) for a model that is not one of its own.
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is not None and isinstance(model, modeling_utils.PreTrainedModel):
        register_cache_pytree()


def register_cache_pytree() -> None:
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
