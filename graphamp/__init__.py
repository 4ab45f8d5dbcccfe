"""graphamp: static-graph automatic mixed precision for PyTorch.

The pipeline: lists (`AutoMixedPrecisionLists`) → capture (torch.export) → cast pass → `AmpModule`
(`rewrite`) → loss scaling (`decorate`); or, as a torch.compile backend, dynamo → cast pass → inductor
(`backend`). Beside it, the tools: `export` (graphamp.inspection) and
`doctor`/`auto_mixed_precision` (graphamp.diagnosis).
"""

__version__ = "0.2.0"

from graphamp import _renamed
from graphamp.amp_module import AmpModule, rewrite
from graphamp.cast_pass import RewriteReport
from graphamp.compile_backend import backend
from graphamp.diagnosis.auto_lists import AutoListsResult, auto_mixed_precision
from graphamp.diagnosis.diagnose import DoctorReport, doctor
from graphamp.errors import (
    ArgumentError, CaptureError, DoubleAmpError, ExportError, GraphampError, HookError, ListFileError,
    LossScalingError, RewriteError,
)
from graphamp.inspection.export_files import export
from graphamp.lists import AutoMixedPrecisionLists, Decision
from graphamp.loss_scaler import LossScaler
from graphamp.optimizer import OptimizerWithMixedPrecision, decorate
from graphamp.runtime.weight_cache import WeightCache

_renamed.install()

__all__ = [
    "AmpModule",
    "ArgumentError",
    "AutoListsResult",
    "AutoMixedPrecisionLists",
    "CaptureError",
    "Decision",
    "DoubleAmpError",
    "DoctorReport",
    "ExportError",
    "GraphampError",
    "HookError",
    "ListFileError",
    "LossScaler",
    "LossScalingError",
    "OptimizerWithMixedPrecision",
    "RewriteError",
    "RewriteReport",
    "WeightCache",
    "__version__",
    "auto_mixed_precision",
    "backend",
    "decorate",
    "doctor",
    "export",
    "rewrite",
]
