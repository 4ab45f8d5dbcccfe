"""transformers' DynamicCache as a pytree node, so that a decoder's cache is a graph input and output.

A decoder's forward with use_cache=True (the config default) returns its DynamicCache, and generate() passes it
back in: with the cache registered before the first capture, torch.export flattens it like a tuple of tensors.
"""

from __future__ import annotations

import itertools
import sys

import torch.utils._pytree as pytree

__all__ = ["register_cache_pytree", "register_cache_pytree_for", "update_given_caches"]


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


def update_given_caches(args: tuple, kwargs: dict, outputs):
    """`outputs` with the DynamicCache the call was given in place of the one the graph returned, that given cache
    holding the returned one's state: the eager model updates the cache it is passed in place and returns it, and a
    decoding loop that keeps passing one cache object (`past_key_values=cache`) reads its update from there."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return outputs
    cache_type = cache_utils.DynamicCache
    given = [value for value in (*args, *kwargs.values()) if isinstance(value, cache_type)]
    if len(given) != 1:  # none, or several a returned cache could not be matched to
        return outputs
    (cache,) = given
    if isinstance(outputs, dict):  # a ModelOutput, or a plain dict
        keys = [key for key, value in outputs.items() if isinstance(value, cache_type)]
        if len(keys) == 1 and outputs[keys[0]] is not cache:
            _take_state(cache, outputs[keys[0]])
            outputs[keys[0]] = cache
    elif isinstance(outputs, tuple) and type(outputs) is tuple:
        places = [i for i, value in enumerate(outputs) if isinstance(value, cache_type)]
        if len(places) == 1 and outputs[places[0]] is not cache:
            _take_state(cache, outputs[places[0]])
            outputs = (*outputs[: places[0]], cache, *outputs[places[0] + 1 :])
    return outputs


def _take_state(cache, returned) -> None:
    """Make `cache` hold `returned`'s layers, as its own `update()` calls would have: layer objects kept in place."""
    for index, layer in enumerate(returned.layers):
        if index < len(cache.layers) and type(cache.layers[index]) is type(layer):
            cache.layers[index].__dict__.update(layer.__dict__)
        elif index < len(cache.layers):
            cache.layers[index] = layer
        else:
            cache.layers.append(layer)
