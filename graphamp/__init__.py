"""graphamp: static-graph automatic mixed precision for PyTorch."""

from graphamp.errors import CaptureError, GraphampError, ListFileError, LossScalingError
from graphamp.lists import AutoMixedPrecisionLists
from graphamp.module import rewrite
from graphamp.optimizer import decorate

__all__ = [
    "AutoMixedPrecisionLists",
    "CaptureError",
    "GraphampError",
    "ListFileError",
    "LossScalingError",
    "decorate",
    "rewrite",
]
