"""The casts a train step executes as kernels of their own, counted with graphamp's DtypeRecorder, a rewritten
model's graphs included.

Dynamo runs a frame eagerly (in float32, for a rewritten model) under a plain dispatch mode; under one that says
`ignore_compile_internals()` it compiles and runs the frame as usual and the mode sees what the compiled code runs:
with rewrite(compile=False), every ATen op of graphamp's graphs, forward and backward (as tests/conftest.py
records). Inductor's fused kernels do not dispatch: count casts in the eager modes only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from graphamp.inspection.recording import DtypeRecorder


class CompiledCodeRecorder(DtypeRecorder):
    """A DtypeRecorder that torch.compile compiles and runs under."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


@contextlib.contextmanager
def recording(model: torch.nn.Module) -> Iterator[DtypeRecorder]:
    """`with recording(model) as recorder:` one step, then `recorder.casts`; for a model graphamp.rewrite converted,
    an error if its graphs did not run inside (a torch whose dynamo ignores `ignore_compile_internals`)."""
    state = getattr(model, "_graphamp", None)
    runs = state.backend.graph_runs if state is not None else 0
    with CompiledCodeRecorder() as recorder:
        yield recorder
    if state is not None and state.backend.graph_runs == runs:
        raise RuntimeError(
            f"torch {torch.__version__} ran the rewritten model eagerly under the recorder (its dynamo does not "
            "compile under a dispatch mode with ignore_compile_internals): no cast of graphamp's graphs was counted."
        )
