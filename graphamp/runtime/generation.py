"""HF `generate()` through rewritten graphs: `amp_model.generate(...)` runs its forward calls in mixed precision.

generate() calls the model's forward once on the prompt (prefill) and once per new token (decode), passing the
KV cache in and taking the updated cache from the output. For the length of the call, the original's forward
is routed through the AmpModule: with transformers' pytree registration of DynamicCache (the one it made for
torch.export), the cache's tensors are graph inputs and outputs, and each step's signature is captured with
dynamic dims at once, so a generation costs one prefill and one decode capture, whatever the lengths.
Where a step cannot be captured, generation runs the original model in FP32 and says why, once.

For the length of one call, as torch.autocast keeps its weight casts for the length of its context:
- the weights' float16/bfloat16 casts are kept from token to token (a WeightCache, so a weight written meanwhile
  is still recast): a decode step otherwise casts every weight again for one token, which for a large model reads
  and writes more bytes than its matmuls do;
- the model is checked for edits (module tree, hooks, tensors) at the first forward only: nothing between two
  tokens of one call edits it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from dataclasses import dataclass, field

from graphamp.cache_pytree import register_cache_pytree
from graphamp.errors import CaptureError
from graphamp.runtime.weight_cache import WeightCache

__all__ = ["GenerationCall", "generate"]

# AmpModule -> why its generation cannot be captured: later calls go straight to the original.
_uncapturable: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class GenerationCall:
    """What one generate() call keeps from token to token."""

    weights: WeightCache = field(default_factory=WeightCache)
    model_checked: bool = False  # the model fingerprint was compared at this call's first forward


def generate(amp_model, *args, **kwargs):
    """`amp_model.original_module.generate(*args, **kwargs)`, its forward calls running through rewritten graphs.

    Args:
        amp_model: an AmpModule whose original model has HF's `generate()`.
        *args, **kwargs: what `generate()` takes (input_ids, max_new_tokens, do_sample, ...).
    """
    original = amp_model.original_module
    if amp_model in _uncapturable:
        return original.generate(*args, **kwargs)
    register_cache_pytree()
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
    outermost = amp_model._generation is None
    if outermost:
        amp_model._generation = GenerationCall()
    try:
        yield
    finally:
        if outermost:
            amp_model._generation = None
        if own_forward is None:
            del original.forward
        else:
            original.forward = own_forward
