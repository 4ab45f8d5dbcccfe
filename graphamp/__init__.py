"""graphamp: static-graph automatic mixed precision for PyTorch."""

from graphamp.errors import CaptureError, ExportError, GraphampError, ListFileError, LossScalingError
from graphamp.auto_lists import auto_mixed_precision
from graphamp.doctor import doctor
from graphamp.lists import AutoMixedPrecisionLists
from graphamp.export import export
from graphamp.module import rewrite
from graphamp.optimizer import decorate

__all__ = [
    "AutoMixedPrecisionLists",
    "CaptureError",
    "ExportError",
    "GraphampError",
    "ListFileError",
    "LossScalingError",
    "auto_mixed_precision",
    "decorate",
    "doctor",
    "export",
    "rewrite",
]
