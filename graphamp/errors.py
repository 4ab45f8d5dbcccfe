"""The typed errors graphamp raises: each names the file, line or op at fault and says the fix."""

__all__ = [
    "ArgumentError", "CaptureError", "DoubleAmpError", "ExportError", "GraphampError", "HookError", "ListFileError",
    "LossScalingError", "RewriteError",
]


class GraphampError(Exception):
    """Base class of every error graphamp raises on purpose."""


class ListFileError(GraphampError, ValueError):
    """A list file (or custom list argument) is unreadable, malformed, or names an unknown op."""


class CaptureError(GraphampError, RuntimeError):
    """torch.export could not capture the model; the message names the construct and the fix."""


class LossScalingError(GraphampError, RuntimeError):
    """The loss-scaling optimizer wrapper was used in an order or with inputs it cannot handle."""


class ExportError(GraphampError, RuntimeError):
    """export() could not write one of its files (Graphviz missing or failing); the message says the fix."""


class DoubleAmpError(GraphampError, RuntimeError):
    """An AmpModule was called inside torch.autocast: two mixed-precision systems at once."""


class HookError(GraphampError, RuntimeError):
    """A module hook of a kind the rewritten graph cannot run (a backward hook on a submodule); says the fix."""


class ArgumentError(GraphampError, TypeError, ValueError):
    """An argument of a graphamp function has the wrong type or value; the message names it and the fix."""


class RewriteError(GraphampError, RuntimeError):
    """An op cannot run in the dtype the lists give it (no low-precision kernel); the message names the op's entry."""
