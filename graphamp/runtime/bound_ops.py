"""An eager graph's Python code with its ops bound as globals, not looked up through `torch.ops` on every call.

fx writes each op of a graph as `torch.ops.aten.linear.default(...)`: four attribute lookups per op, every call. On a
tiny model, whose call is its ops' dispatch, those lookups in a 286-op forward cost about 90 µs, 6% of it (a tiny
Llama on the AMD EPYC). Bound once as globals of the generated code, each op is one global lookup. Only the code
that runs changes: the graph, its printed code (`.code`) and what reads them stay fx's own, and `recompile()`
writes fx's forward back.
"""

from __future__ import annotations

import re

import torch

try:  # fx's own helper for turning generated source into a forward (private, stable since torch 2.0)
    from torch.fx.graph_module import _forward_from_src
except ImportError:  # a torch without it: fx's own code runs, only slower
    _forward_from_src = None

__all__ = ["bind_ops"]

_OP = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\b")


def bind_ops(graph_module: torch.fx.GraphModule) -> None:
    """Regenerate the forward of `graph_module` and of the GraphModules inside it with their ops as globals."""
    if _forward_from_src is None:
        return
    for module in graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            _bind(module)


def _bind(graph_module: torch.fx.GraphModule) -> None:
    python_code = graph_module.graph.python_code(root_module="self")
    names = dict(python_code.globals)

    def global_for(match: re.Match) -> str:
        name = "_op_" + "_".join(match.groups())
        if name not in names:
            namespace, op, overload = match.groups()
            names[name] = getattr(getattr(getattr(torch.ops, namespace), op), overload)
        return name

    source = _OP.sub(global_for, python_code.src)
    type(graph_module).forward = _forward_from_src(source, names)
