"""The seam between graphamp's graphs and the code dynamo runs itself, looked at once after each new compile.

Under torch.compile, mixed precision exists only inside the graphs dynamo hands to graphamp. Dynamo runs other
code eagerly: a module or frame it skips, a function under torch.compiler.disable, what a graph break leaves
between two graphs. A white-list op (a GEMM, a convolution) called there runs in the model's own dtype, float32,
with no word from anyone. So the call after each new compile is watched with a Python profile function: a
white-list torch function called while no graph of graphamp's runs is reported once, with the model's line that
called it and the fix. Other calls pay nothing; docs/backend.md has the measured cost of a watched call.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch._guards import TracingContext

from graphamp.policy.lists import WHITE, AutoMixedPrecisionLists

__all__ = ["EagerAudit", "SHARED_RECOMPILE_LIMIT_HINT", "TORCH_ISOLATES_RECOMPILES"]

# torch >= 2.13 can give each model its own cache for the frames after a graph break (its class's forward code).
TORCH_ISOLATES_RECOMPILES = "isolate_recompiles" in inspect.signature(torch.compile).parameters
SHARED_RECOMPILE_LIMIT_HINT = "" if TORCH_ISOLATES_RECOMPILES else (
    " On this torch (before 2.13) the recompile limit of the frames after a graph break also counts every earlier "
    "model of the same class compiled in this process: torch._dynamo.reset() between models frees it."
)

_TORCH_DIRS = (str(Path(torch.__file__).parent), str(Path(torch.__file__).resolve().parent))


class EagerAudit:
    """Whether the next call is watched (`due`), and the ops already reported (each is reported once)."""

    def __init__(self, amp_lists: AutoMixedPrecisionLists):
        # torch's Python functions carry the ATen packet's name: torch._C._nn.linear, torch.conv2d, Tensor.mm.
        self.white = {entry.name.partition(".")[0] for entry in amp_lists.entries(WHITE) if "::" not in entry.name}
        self.due = False
        self.reported: set[str] = set()

    @contextlib.contextmanager
    def watching(self, backend, model_name: str):
        """Run the call inside with a profile function that notes white-list calls made outside the graphs."""
        self.due = False
        if sys.getprofile() is not None:  # cProfile or torch's profiler: never replace the user's own
            yield
            return
        found: list[tuple[str, str]] = []

        def profile(frame, event, function):
            if event == "c_call" and not backend.graphs_running and getattr(function, "__name__", "") in self.white:
                if TracingContext.try_get() is None:  # not dynamo tracing on fake tensors: a real eager call
                    found.append((function.__name__, _caller(frame)))

        backend.counting_depth = True
        runs = backend.graph_runs
        sys.setprofile(profile)
        try:
            yield
        finally:
            sys.setprofile(None)
            backend.counting_depth = False
        if backend.graph_runs != runs:  # a call that ran no graph at all gets rewrite()'s own, plainer warning
            self._report(found, model_name)

    def _report(self, found: list[tuple[str, str]], model_name: str) -> None:
        new = [(op, where) for op, where in found if op not in self.reported]
        if not new:
            return
        self.reported.update(op for op, _ in new)
        counts = Counter(op for op, _ in new)
        places = sorted({where for _, where in new if where})
        warnings.warn(
            f"graphamp: {sum(counts.values())} white-list op call(s) of {model_name} ran outside graphamp's graphs, "
            f"eagerly in the model's own dtype (float32 for an FP32 model), not in low precision: "
            f"{', '.join(f'{op} x{n}' for op, n in counts.most_common())}"
            + (f", called from {'; '.join(places[:3])}" if places else "")
            + ". Dynamo ran that code itself: a module or frame it skips, a function under torch.compiler.disable, "
            "code between two graphs at a graph break, or a frame past dynamo's recompile limit. Fix: let dynamo "
            "trace it (drop the disable; TORCH_LOGS=graph_breaks,recompiles shows the breaks and the recompiles), or "
            f"run that part under torch.autocast yourself.{SHARED_RECOMPILE_LIMIT_HINT}",
            stacklevel=5,
        )


def _caller(frame) -> str:
    """'file:line (function)' of the innermost frame outside torch's own code: the model's line."""
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIRS):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
