"""What a captured graph depends on in the module, as one cheap comparable value.

A capture is a snapshot of the module tree: which submodule objects are where (and any in another mode than the root),
which parameter and buffer objects they hold (with requires_grad and dtype), and which forward
and backward hooks were registered (on each submodule, and globally). `AmpModule` compares this fingerprint
on every call and recaptures when it changed, so an edit to the model is never run through an old graph.
Python attributes read in forward (`self.use_relu`) are not in it: `AmpModule.recapture()` is for those.
"""

from __future__ import annotations

import weakref

from torch import nn
from torch.nn.modules import module as _module_globals

__all__ = ["DeathWatch", "module_fingerprint"]


class DeathWatch:
    """Says when a module or tensor a capture read has died since: a new object may then get its id(), which
    the fingerprint alone would take for the old one (a submodule swapped for a fresh one of the same layout).
    The weak references' callbacks fire when the object dies, so no call pays for the watch."""

    def __init__(self) -> None:
        self.changed = False
        self._refs: list[weakref.ref] = []

    def watch(self, model: nn.Module, parameters: bool = True) -> None:
        """Watch the modules of `model` and the tensors they hold (not the parameters: FSDP2 swaps them)."""
        def died(_, watch=weakref.ref(self)):
            if watch() is not None:
                watch().changed = True

        modules = list(model.modules())
        tensors = [t for m in modules for t in m._buffers.values() if t is not None]
        if parameters:
            tensors += [t for m in modules for t in m._parameters.values() if t is not None]
        self._refs = [weakref.ref(o, died) for o in [*modules, *tensors]]
        self.changed = False


def module_fingerprint(model: nn.Module, parameter_identity: bool = True) -> tuple | None:
    """A tuple that changes whenever the module tree, a tensor it holds, or a hook registered on it changes;
    None while torch.func.functional_call has swapped plain tensors in for the parameters (no edit).

    Args:
        model: the module whose captured graphs are checked.
        parameter_identity: whether a parameter replaced by another object counts as a change. Off under FSDP2,
            which swaps its sharded and unsharded parameter objects around every forward by design.
    """
    parts: list = [_global_hook_keys()]
    append = parts.append  # the walk runs on every call: locals, and no loop over an empty table
    root_training = model.training
    stack = [model]
    pop, extend = stack.pop, stack.extend
    while stack:  # model.modules() builds a memo set and names: several times slower on a 12-layer model
        module = pop()
        if module is None:  # a child slot set to None
            continue
        extend(module._modules.values())
        # Hook dicts are keyed by a handle id that is never reused: their keys change on every add or remove.
        # Against the root's mode: train()/eval() of the whole tree is the capture key's, not an edit.
        same_mode = module.training is root_training
        forward_pre, forward, backward_pre, backward = (
            module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks
        )
        if forward_pre or forward or backward_pre or backward:
            append((id(module), same_mode, tuple(forward_pre), tuple(forward), tuple(backward_pre), tuple(backward)))
        else:  # most modules have no hook: a shorter entry, never equal to one with hooks
            append((id(module), same_mode))
        parameters = module._parameters
        if parameters:
            for tensor in parameters.values():
                if tensor is None:
                    append(None)
                    continue
                if type(tensor) is not _Parameter and not isinstance(tensor, _Parameter):
                    return None  # torch.func.functional_call's tensors, for this call only: the graph reads them as given
                # A device move is in the capture key already; a wrong shape fails loudly in the graph.
                append((id(tensor) if parameter_identity else None, tensor.requires_grad, tensor.dtype))
        buffers = module._buffers
        if buffers:
            for tensor in buffers.values():
                append(None if tensor is None else (id(tensor), tensor.requires_grad, tensor.dtype))
    return tuple(parts)


_Parameter = nn.Parameter


def _global_hook_keys() -> tuple:
    return (
        tuple(_module_globals._global_forward_pre_hooks), tuple(_module_globals._global_forward_hooks),
        tuple(_module_globals._global_backward_pre_hooks), tuple(_module_globals._global_backward_hooks),
    )
