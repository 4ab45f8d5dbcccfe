"""`torch.compile(model, backend="graphamp")`: graphamp's backend by name, for code that never imports graphamp.

torch finds it through the `torch_dynamo_backends` entry point (pyproject.toml). The lists come from torch.compile's
`options` (GRAPHAMP_OPTIONS), else the environment (GRAPHAMP_DTYPE, GRAPHAMP_LEVEL, GRAPHAMP_LISTS_DIR), else the
shipped lists in bfloat16; docs/backend.md says which keys and why bfloat16.
"""

from __future__ import annotations

import os

from graphamp.errors import ArgumentError
from graphamp.frontends.compile_backend import GRAPHAMP_OPTIONS, LIST_OPTIONS, AmpBackend, configure_dynamo
from graphamp.policy.config import AmpConfig
from graphamp.policy.lists import AutoMixedPrecisionLists

__all__ = ["graphamp_backend"]

# torch resolves the name when torch.compile() is called, before dynamo traces: RNN modules and late hooks must be
# configured by then.
configure_dynamo()


# One backend per graphamp options (and environment): the graphs of one torch.compile, graph breaks included, share
# its lists, read once, and its record of the module paths it has seen.
_BACKENDS: dict = {}


def graphamp_backend(gm, example_inputs, mode: str | None = None, options: dict | None = None):
    """dynamo's compiler_fn: graphamp's lists and passes on `gm`, then inductor with `mode` and the other options."""
    options = dict(options or {})
    graphamp_options = {key: options.pop(key) for key in GRAPHAMP_OPTIONS if key in options}
    key = (
        tuple((name, id(value) if name == "amp_lists" else repr(value)) for name, value in graphamp_options.items()),
        tuple(os.environ.get(name) for name in ("GRAPHAMP_DTYPE", "GRAPHAMP_LEVEL", "GRAPHAMP_LISTS_DIR")),
    )
    backend = _BACKENDS.get(key)
    given_lists = graphamp_options.get("amp_lists")
    if backend is None or (given_lists is not None and backend.amp_lists is not given_lists):  # an id reused
        backend = _BACKENDS[key] = AmpBackend(config_from(graphamp_options))
    return backend(gm, example_inputs, mode=mode, options=options)


def config_from(options: dict) -> AmpConfig:
    """The AmpConfig that torch.compile's options, else the environment, else the defaults give."""
    level = options.get("level", os.environ.get("GRAPHAMP_LEVEL", "O1"))
    lists = options.get("amp_lists")
    overridden = [key for key in ("dtype", *LIST_OPTIONS) if key in options]
    if lists is not None and overridden:
        raise ArgumentError(
            f"torch.compile(options=...) got amp_lists and {', '.join(overridden)}, which amp_lists already holds: "
            f"{overridden[0]} would be ignored. Pass one: amp_lists=graphamp.AutoMixedPrecisionLists(..., "
            f"{overridden[0]}=...), or the keys without amp_lists."
        )
    if lists is None:
        given = {key: options[key] for key in LIST_OPTIONS if key in options}
        if "lists_dir" not in given and os.environ.get("GRAPHAMP_LISTS_DIR"):
            given["lists_dir"] = os.environ["GRAPHAMP_LISTS_DIR"]
        lists = AutoMixedPrecisionLists(dtype=options.get("dtype", os.environ.get("GRAPHAMP_DTYPE", "bfloat16")), **given)
    return AmpConfig(lists, level)
