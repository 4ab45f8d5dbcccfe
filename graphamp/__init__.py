"""graphamp: static-graph automatic mixed precision for PyTorch, in the style of Paddle's AMP.

The public API, in the pipeline's order (policy → passes → front ends → training, the tools beside them):
docs/how_it_works.md and docs/api.md.
"""

__version__ = "0.3.0"

from graphamp.diagnosis.auto_lists import AutoListsResult, auto_mixed_precision
from graphamp.diagnosis.diagnose import DoctorReport, doctor
from graphamp.errors import (
    ArgumentError, CaptureError, DoubleAmpError, ExportError, GraphampError, ListFileError,
    LossScalingError, RewriteError,
)
from graphamp.frontends.compile_backend import AmpBackend, backend
from graphamp.frontends.eager_policy import auto_cast
from graphamp.frontends.export_program import export_program
from graphamp.frontends.low_storage import LowStorageTensor, stored_values
from graphamp.frontends.rewrite import is_rewritten, rewrite, rewritten_graphs
from graphamp.inspection.export_files import export
from graphamp.passes.cast_pass import RewriteReport
from graphamp.policy.lists import AutoMixedPrecisionLists, Decision
from graphamp.training.loss_scaler import LossScaler
from graphamp.training.optimizer import OptimizerWithMixedPrecision, decorate
from graphamp.training.scheduler import AppliedStepsScheduler

__all__ = [
    "AmpBackend",
    "AppliedStepsScheduler",
    "ArgumentError",
    "AutoListsResult",
    "AutoMixedPrecisionLists",
    "CaptureError",
    "Decision",
    "DoubleAmpError",
    "DoctorReport",
    "ExportError",
    "GraphampError",
    "ListFileError",
    "LossScaler",
    "LowStorageTensor",
    "LossScalingError",
    "OptimizerWithMixedPrecision",
    "RewriteError",
    "RewriteReport",
    "__version__",
    "auto_cast",
    "auto_mixed_precision",
    "backend",
    "decorate",
    "doctor",
    "export",
    "export_program",
    "is_rewritten",
    "rewrite",
    "rewritten_graphs",
    "stored_values",
]
