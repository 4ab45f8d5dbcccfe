"""What many test files share: the lists in each dtype, a seed, a lists folder writer, the loss of an output, and
the two front ends (`rewritten`: torch.compile through rewrite(), and export_program()) as one fixture.

Models live in models.py, the training loop and relative error in training.py.
"""

from __future__ import annotations

import os

# Inductor compiles in this process, not in a pool of its own: the xdist workers already keep both cores busy, so a
# pool only adds its start-up (a torch import per pool process) to each worker (cold-cache suite: 5:56 -> 5:39).
# The environment carries it to the processes tests start (torchrun, the distributed jobs).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# One intra-op thread per worker: two xdist workers with two OpenMP threads each oversubscribe 2 cores, and OpenMP's
# waiting threads spin (cold-cache suite: 5:34 -> 4:56). Set before torch loads; the processes tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch
from torch import nn
from torch._higher_order_ops.cond import cond_op

import graphamp
from graphamp.inspection.recording import DtypeRecorder
from training import loss_of


@pytest.fixture(scope="module", autouse=True)
def dynamo_caches_of_this_file_only():
    """Each file starts with dynamo as a fresh process has it, whichever files ran before it on the same worker: its
    caches, its recompile counts (before torch 2.13, with no `isolate_recompiles`, counted over every model compiled in
    the process, so earlier files' models pushed this file's past the limit) and the input sizes it remembers per
    code location (automatic dynamic shapes), so that a file's graphs do not depend on the files before it."""
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def bf16() -> graphamp.AutoMixedPrecisionLists:
    """The shipped lists for bfloat16 (what the CPU tests run in: float16 matmuls are ~100x slower on CPU)."""
    return graphamp.AutoMixedPrecisionLists(dtype="bfloat16")


@pytest.fixture(scope="session")
def fp16() -> graphamp.AutoMixedPrecisionLists:
    return graphamp.AutoMixedPrecisionLists(dtype="float16")


@pytest.fixture
def seeded():
    """The same weights, inputs and dropout masks on every run."""
    torch.manual_seed(0)


def write_list_folder(folder: Path, **files: str) -> Path:
    """A lists folder: write_list_folder(path, white="mm\\n", black_modules="lm_head\\n") writes white.txt and
    black_modules.txt; white/black/gray not given are written empty. A name with a dot is a file name as it is."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for color in ("white", "black", "gray"):
        files.setdefault(color, "")
    for name, text in files.items():
        (folder / (name if "." in name else f"{name}.txt")).write_text(text)
    return folder


@pytest.fixture
def write_lists():
    """write_list_folder, as a fixture."""
    return write_list_folder


@pytest.fixture
def hf_loss():
    """training.loss_of: the HF loss when the model computes one, else a scalar of the output."""
    return loss_of


# -- the two front ends ----------------------------------------------------------------------------------------

FRONT_ENDS = ("compile", "export")


class CompiledCodeRecorder(DtypeRecorder):
    """A DtypeRecorder that torch.compile compiles under (a plain dispatch mode makes dynamo run the call eagerly):
    it records what the compiled code runs, which with rewrite(compile=False) is every ATen op of graphamp's
    rewritten graphs, forward and backward, graphs compiled inside the block included."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


@cond_op.py_impl(CompiledCodeRecorder)
def _cond_under_recorder(mode, pred, true_fn, false_fn, operands):
    """torch.cond under the recorder: the taken branch runs eagerly, so its kernels are recorded too."""
    with mode:
        return (true_fn if bool(pred) else false_fn)(*operands)


class Converted(NamedTuple):
    """A model converted by one front end: `run` calls it (the model itself after rewrite(), the program's module
    after export_program()); `graph_module` and `report` are the rewritten graph and the cast pass's report;
    `state` maps the graph's placeholders that are parameters or buffers to their paths in the model;
    `program` is the ExportedProgram (None on the compile side)."""

    front_end: str
    model: nn.Module
    run: Callable
    graph_module: torch.fx.GraphModule
    report: graphamp.RewriteReport
    state: dict
    program: torch.export.ExportedProgram | None = None

    def recording(self) -> CompiledCodeRecorder:
        """`with converted.recording() as rec:` records the kernels `run` and the backward of its outputs run."""
        return CompiledCodeRecorder()


class FrontEnd:
    """One of graphamp's front ends, as the tests drive it.

    `front_end(model, example_args, example_kwargs, amp_lists=..., level=...)` -> (graph_module, report) of the
    rewritten graph; `front_end.convert(...)` -> Converted, which also runs the model and records its kernels.
    "compile": graphamp.rewrite(..., fullgraph=True, dynamic=False) compiles ahead on the examples: one graph, run
    as fx code, with static shapes as export_program's (every rewritten model's call is one function to dynamo, so
    with dynamic=None sizes another model was called with would make this one's dynamic);
    "export": graphamp.export_program(...)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"FrontEnd({self.name!r})"

    def __call__(self, model, example_args=(), example_kwargs=None, amp_lists=None, level="O1"):
        converted = self.convert(model, example_args, example_kwargs, amp_lists, level)
        return converted.graph_module, converted.report

    def convert(self, model, example_args=(), example_kwargs=None, amp_lists=None, level="O1") -> Converted:
        if self.name == "compile":
            graphamp.rewrite(
                model, example_args, example_kwargs, amp_lists=amp_lists, level=level, fullgraph=True, dynamic=False
            )
            (graph,) = graphamp.rewritten_graphs(model)
            return Converted(
                self.name, model, model, graph.graph_module, graph.report,
                dict(graph.parameter_placeholders),
            )
        program = graphamp.export_program(model, example_args, example_kwargs, amp_lists=amp_lists, level=level)
        graph_module, signature = program.graph_module, program.graph_signature
        return Converted(
            self.name, model, program.module(), graph_module, graph_module.meta["graphamp_report"],
            {**signature.inputs_to_parameters, **signature.inputs_to_buffers}, program,
        )


@pytest.fixture(scope="session", params=FRONT_ENDS)
def rewritten(request) -> FrontEnd:
    """Each test that takes it runs on both front ends (ids "compile" and "export"): the same lists must give the
    same decisions on either. `rewritten(model, args, kwargs, amp_lists=..., level=...)` -> (graph_module, report);
    `rewritten.convert(...)` -> Converted (run, graph_module, report, recording()); `rewritten.name`."""
    return FrontEnd(request.param)
