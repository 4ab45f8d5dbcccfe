"""Module paths: where each graph dynamo captured sits in the user's model, which black-module patterns name
(docs/backend.md, "Module paths").
"""

from __future__ import annotations

import re
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from graphamp.errors import CaptureError
from graphamp.policy.config import AmpConfig

__all__ = ["GraphPaths", "ModulePaths", "module_fqn"]


_ROOT = re.compile(r"^[LG]\[['\"][^'\"]*['\"]\](\[\d+\])?\.?")
_INDEX = re.compile(r"\[(\d+)\]")
_KEY = re.compile(r"\[['\"]([^'\"]+)['\"]\]")
# Attributes through which a framework's wrapper holds the user's model: not part of the model's own paths.
_WRAPPER_ATTRIBUTES = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module")


def module_fqn(dynamo_path: str) -> str:
    """`L['self'].model.layers[0]._modules['mlp']` -> `model.layers.0.mlp`, the path named_modules() gives
    (`..._parameters['weight']` -> `...weight`, as named_parameters())."""
    path = _ROOT.sub("", dynamo_path)
    path = _KEY.sub(r".\1", _INDEX.sub(r".\1", path))
    # `__dict__['base_model']`: how dynamo reads a submodule of a class with its own __getattr__ (PEFT's PeftModel).
    dropped = ("_modules", "_parameters", "_buffers", "__dict__")
    parts = [part for part in path.split(".") if part and part not in dropped]
    return ".".join(parts)


def state_placeholders(gm: GraphModule, aten_graph: GraphModule) -> dict[str, str]:
    """{ATen placeholder name: parameter or buffer path below the compiled module} for the model state dynamo
    passes as graph inputs (`L['self']._modules['inp']._parameters['weight']` -> `inp.weight`)."""
    names = {}
    aten_inputs = aten_graph.graph.find_nodes(op="placeholder")
    for dynamo_input, aten_input in zip(gm.graph.find_nodes(op="placeholder"), aten_inputs):
        source = getattr(dynamo_input.meta.get("grapharg"), "source", None)
        where = source.name() if callable(getattr(source, "name", None)) else getattr(source, "name", "")
        if "._parameters[" in where or "._buffers[" in where:
            names[aten_input.name] = module_fqn(where)
    return names


@dataclass(frozen=True)
class GraphPaths:
    """One graph's state placeholders with their model paths, the config its ops are decided by, and the check to
    run before each of its runs."""

    state: dict[str, str]  # placeholder name -> the parameter's or buffer's path in the model
    reuse_check: object  # None, or a function of the run's arguments that raises CaptureError
    config: AmpConfig  # with the model's module paths (AmpConfig.for_model) where the model is known


class ModulePaths:
    """Turns the module paths of one compiled graph (below whatever torch.compile got: the model, a wrapper of
    it, one of its blocks) into the paths of the user's model, which black-module patterns are written against.

    With the model known (`rewrite()`), a parameter the graph reads says where the compiled module sits in it:
    `mlp.fc.weight` in the graph is `layers.3.mlp.fc.weight` in the model. Without it, a framework wrapper's
    attribute at the front (DDP's `module.`) is dropped.
    """

    def __init__(self, config: AmpConfig, model: torch.nn.Module | None = None):
        self._config = config
        self._model = weakref.ref(model) if model is not None else None  # the backend must not keep it alive
        self._seen: set[str] = set()  # the model paths of every graph so far
        # rewrite() checks the patterns against the model itself; compiled alone, after a whole call (see below).
        self._patterns_checked = model is not None or not config.lists.black_modules

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model() if self._model is not None else None

    def name_graph(self, gm: GraphModule, aten_graph: GraphModule, example_inputs: list) -> GraphPaths:
        """Write the model's paths into `aten_graph`'s nodes (dynamo's `gm` says which placeholders are state)."""
        state = state_placeholders(gm, aten_graph)
        placeholders = [node.name for node in aten_graph.graph.find_nodes(op="placeholder")]
        to_model_path = self.resolver(state, dict(zip(placeholders, example_inputs)))
        relative_paths = _rename_module_paths(aten_graph, to_model_path)
        self._seen |= {to_model_path(path) for path in relative_paths}
        model = self.model
        config = self._config.for_model(model) if model is not None else self._config
        return GraphPaths(
            {name: to_model_path(path) for name, path in state.items()},
            self._reuse_check(state, placeholders, example_inputs, relative_paths, to_model_path, config),
            config,
        )

    def graph_ran(self, runs: int) -> None:
        """After a graph's run: by its second, a whole call has compiled all its graphs; patterns that matched none
        of them are reported, once."""
        if runs == 2 and not self._patterns_checked:
            self._warn_unmatched_patterns()

    def state_path(self, tensor: torch.Tensor) -> str | None:
        """A parameter's or buffer's path in the model; None where the model is not known or does not hold it."""
        return _state_paths(self._model() if self._model is not None else None).get(id(tensor))

    def resolver(self, state: dict[str, str], inputs_by_placeholder: dict[str, object]):
        """A function from a graph path to a model path, for the graph whose state placeholders are `state`."""
        model_state = _state_paths(self._model()) if self._model is not None else {}
        for placeholder, relative in state.items():
            absolute = model_state.get(id(inputs_by_placeholder.get(placeholder)))
            if absolute is None:
                continue
            if _ends_with_path(absolute, relative):
                prefix = absolute[: len(absolute) - len(relative)]
                return lambda path: prefix + path if path else prefix.rstrip(".")
            if _ends_with_path(relative, absolute):
                wrapper = relative[: len(relative) - len(absolute)]
                return lambda path: path[len(wrapper):] if path.startswith(wrapper) else ""
        return _without_wrappers

    def _reuse_check(self, state: dict[str, str], placeholders: list[str], example_inputs: list,
                     relative_paths: set[str], to_model_path, config: AmpConfig):
        """For a graph whose module paths were resolved against the model: a check, before each run, that dynamo
        does not reuse it for a twin block (blocks compiled one at a time share a graph) that the black-module
        patterns decide otherwise, which would run that block with this one's dtypes."""
        if not config.lists.black_modules or self._model is None or not state:
            return None
        first = placeholders.index(next(iter(state)))
        decided = {path: config.black_module_for(to_model_path(path)) for path in relative_paths}
        seen = {id(example_inputs[first])}

        def check(args):
            if id(args[first]) in seen:
                return
            seen.add(id(args[first]))
            other = self.resolver(state, dict(zip(placeholders, args)))
            for path, pattern in decided.items():
                if (config.black_module_for(other(path)) is None) != (pattern is None):
                    raise CaptureError(
                        f"dynamo reuses the graph it compiled for '{to_model_path(path)}' for '{other(path)}' "
                        f"(identical blocks compiled one at a time share one graph), but the black-module patterns "
                        f"decide the two differently, so '{other(path)}' would run with the other's dtypes. Fix: "
                        f"compile the whole model (graphamp.rewrite(model)), where each block's ops are decided "
                        f"where they are, or write the pattern for every twin alike ('layers.*.mlp')."
                    )

        return check

    def _warn_unmatched_patterns(self) -> None:
        """A black-module pattern that matched no module of any graph keeps nothing in FP32: say so once."""
        self._patterns_checked = True
        paths = sorted(self._seen)
        for pattern, close in self._config.lists.unmatched_black_modules(paths):
            hint = f"closest module paths: {', '.join(close)}" if close else f"paths seen: {', '.join(paths[:5])}"
            warnings.warn(
                f"{pattern.source}: black-module pattern '{pattern.name}' matches no module of the graphs "
                f"torch.compile captured, so it keeps nothing in FP32 ({hint}). Module paths here are those of "
                f"the module torch.compile got; graphamp.rewrite(model) matches them against the whole model "
                f"(a module shared under two names by either).",
                stacklevel=4,
            )


def _state_paths(model: torch.nn.Module | None) -> dict[int, str]:
    """id(parameter or buffer) -> its path in `model`, which a graph's module paths are resolved against."""
    if model is None:
        return {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {id(tensor): name for name, tensor in named}


def _ends_with_path(path: str, tail: str) -> bool:
    return path == tail or path.endswith("." + tail)


def _without_wrappers(path: str) -> str:
    parts = path.split(".")
    while parts and parts[0] in _WRAPPER_ATTRIBUTES:
        parts = parts[1:]
    return ".".join(parts)


def _rename_module_paths(aten_graph: GraphModule, to_model_path) -> set[str]:
    """Write model paths into every node's nn_module_stack (sub-graphs too); returns the graph's own paths."""
    seen = set()
    for graph_module in (m for m in aten_graph.modules() if isinstance(m, GraphModule)):
        for node in graph_module.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if stack:
                paths = {key: module_fqn(path) for key, (path, _) in stack.items()}
                node.meta["nn_module_stack"] = {key: (to_model_path(paths[key]), kind) for key, (_, kind) in stack.items()}
                seen.update(path for path in paths.values() if path)
    return seen
