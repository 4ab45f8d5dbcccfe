"""The typed errors graphamp raises: each names the file, line or op at fault and says the fix."""

__all__ = [
    "ArgumentError", "CaptureError", "DoubleAmpError", "ExportError", "GraphampError", "ListFileError",
    "LossScalingError", "RewriteError",
]


class GraphampError(Exception):
    """Base class of every error graphamp raises on purpose."""


class ListFileError(GraphampError, ValueError):
    """A list file (or custom list argument) is unreadable, malformed, or names an unknown op."""


class CaptureError(GraphampError, RuntimeError):
    """torch.export or dynamo's graph could not be captured or lowered; the message names the construct and the fix."""


class LossScalingError(GraphampError, RuntimeError):
    """The loss-scaling optimizer wrapper was used in an order or with inputs it cannot handle."""


class ExportError(GraphampError, RuntimeError):
    """export() could not write one of its files (Graphviz missing or failing); the message says the fix."""


class DoubleAmpError(GraphampError, RuntimeError):
    """A rewritten model (or graphamp's backend) ran inside torch.autocast: two mixed-precision systems at once."""


class ArgumentError(GraphampError, TypeError, ValueError):
    """An argument of a graphamp function has the wrong type or value; the message names it and the fix."""


class RewriteError(GraphampError, RuntimeError):
    """An op cannot run in the dtype the lists give it (no low-precision kernel); the message names the op's entry."""
