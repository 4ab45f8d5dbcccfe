"""Activation checkpointing kept through capture: the checkpointed code is recomputed in backward, as in eager.

torch.export traces through `torch.utils.checkpoint.checkpoint` and inlines the function: with
`use_reentrant=False` the activations are saved as if there were no checkpoint, and with `use_reentrant=True`
the function runs under no_grad, so every gradient is lost. During capture graphamp therefore replaces the
two entry points of torch's checkpoint (both variants, and HF's `gradient_checkpointing_enable()`, which calls
the same function) by a plain call that tags the nodes it produces with a region number
(`node.meta["custom"]`, via torch.fx.traceback.annotate). Modules matched by `rewrite(..., checkpoint=...)` are
tagged the same way. After the cast pass, `checkpointed()` splits the graph at the regions and runs each one
under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`.
"""

from __future__ import annotations

import fnmatch
import itertools
from contextlib import ExitStack, contextmanager

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.fx.passes.split_module import split_module

from graphamp.errors import CaptureError

__all__ = ["REGION_KEY", "checkpointed", "marking_checkpoints", "matching_modules"]

REGION_KEY = "graphamp_checkpoint"
_region_numbers = itertools.count()


@contextmanager
def marking_checkpoints(model: nn.Module, pattern: str | None = None):
    """While capturing `model`: tag the nodes of every checkpointed call and of every module matching `pattern`.

    Args:
        model: the module about to be captured.
        pattern: an fnmatch pattern over module paths (`"transformer.h.*"`), or None.
    """
    with ExitStack() as stack:
        stack.enter_context(fx_traceback.preserve_node_meta())  # export keeps node.meta["custom"] only under it
        if hasattr(fx_traceback, "annotate"):
            # Every captured node says "no region": nodes the cast pass adds later are told apart by its absence.
            stack.enter_context(fx_traceback.annotate({REGION_KEY: None}))
        stack.callback(setattr, torch_checkpoint, "CheckpointFunction", torch_checkpoint.CheckpointFunction)
        stack.callback(
            setattr, torch_checkpoint, "_checkpoint_without_reentrant_generator",
            torch_checkpoint._checkpoint_without_reentrant_generator,
        )
        torch_checkpoint.CheckpointFunction = _MarkedReentrantCheckpoint
        torch_checkpoint._checkpoint_without_reentrant_generator = _marked_checkpoint_generator
        for module in matching_modules(model, pattern):
            stack.callback(_restore_forward, module, module.__dict__.get("forward"))  # accelerate sets one too
            module.forward = _marked_forward(module.forward)
        yield


def matching_modules(model: nn.Module, pattern: str | None) -> list[nn.Module]:
    """The submodules whose path matches `pattern`; ValueError naming some paths when none does."""
    if pattern is None:
        return []
    matched = [module for path, module in model.named_modules() if path and fnmatch.fnmatchcase(path, pattern)]
    if not matched:
        paths = [path for path, _ in model.named_modules() if path][:6]
        raise ValueError(
            f"checkpoint={pattern!r} matches no submodule of {type(model).__name__} (its paths start "
            f"{', '.join(paths)}); pass an fnmatch pattern over those paths, such as 'transformer.h.*'."
        )
    return matched


def checkpointed(graph_module: torch.fx.GraphModule) -> torch.nn.Module:
    """`graph_module` with each tagged region run under torch.utils.checkpoint; itself when it has none.

    Args:
        graph_module: a rewritten graph whose nodes may carry `node.meta["custom"][REGION_KEY]`.
    """
    graph = graph_module.graph
    if not any(_region(node) is not None for node in graph.nodes):
        return graph_module
    _move_casts_into_regions(graph)
    partition_of = _contiguous_partitions(graph)
    regions = {partition for node, partition in partition_of.items() if _region(node) is not None}
    split = split_module(
        graph_module, graph_module, lambda node: partition_of[node], keep_original_order=True
    )
    for partition in regions:
        name = f"submod_{partition}"
        setattr(split, name, _Checkpointed(getattr(split, name)))
    return split


class _Checkpointed(nn.Module):
    """Runs a region's graph under non-reentrant checkpoint: its inputs are saved, the rest recomputed."""

    def __init__(self, region: torch.fx.GraphModule):
        super().__init__()
        self.region = region

    def forward(self, *args):
        return torch_checkpoint.checkpoint(self.region, *args, use_reentrant=False)


def _region(node: torch.fx.Node):
    return node.meta.get("custom", {}).get(REGION_KEY)


def _move_casts_into_regions(graph: torch.fx.Graph) -> None:
    """A node the cast pass made (no capture meta) whose users are all in one region joins it, so that the
    low-precision copy it makes is recomputed in backward, not saved, as autocast's casts in a checkpoint are."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or REGION_KEY in node.meta.get("custom", {}) or not node.users:
            continue
        regions = {_region(user) for user in node.users}
        if len(regions) == 1 and None not in regions:
            first_user = min(node.users, key=position.__getitem__)
            first_user.prepend(node)
            position[node] = position[first_user] - 0.5
            node.meta["custom"] = {**node.meta.get("custom", {}), REGION_KEY: regions.pop()}


def _contiguous_partitions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """A new partition wherever the region changes along the node order, so partitions never form a cycle."""
    partition_of, partition, current = {}, 0, object()
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        region = _region(node)
        if region != current:
            partition, current = partition + 1, region
        partition_of[node] = partition
    return partition_of


def _next_region() -> dict | None:
    """The annotation for a new region, or None inside one already (a nested checkpoint is part of the outer)."""
    if fx_traceback.current_meta.get("custom", {}).get(REGION_KEY) is not None:
        return None
    return {REGION_KEY: next(_region_numbers)}


@contextmanager
def _marking_region():
    annotation = _next_region()
    if annotation is None:
        yield
        return
    annotate = getattr(fx_traceback, "annotate", None)
    if annotate is None:
        raise CaptureError(
            f"the model uses activation checkpointing, which graphamp keeps only with torch.fx.traceback.annotate "
            f"(torch >= 2.9; this is torch {torch.__version__}). Upgrade torch, or disable checkpointing."
        )
    with annotate(annotation):
        yield


class _MarkedReentrantCheckpoint:
    """Stands in for torch's CheckpointFunction during capture: the function runs with grad, its nodes tagged."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        with _marking_region():
            return function(*args)


def _marked_checkpoint_generator(function, preserve_rng_state, *rest, **kwargs):
    """Stands in for torch's non-reentrant checkpoint generator: yields once, with the body's nodes tagged."""
    with _marking_region():
        yield


def _marked_forward(forward):
    def marked(*args, **kwargs):
        with _marking_region():
            return forward(*args, **kwargs)
    return marked


def _restore_forward(module: nn.Module, instance_forward) -> None:
    if instance_forward is None:
        del module.forward  # the class's forward shows through again
    else:
        module.forward = instance_forward
