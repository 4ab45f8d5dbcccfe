"""The typed errors graphamp raises: each names the file, line or op at fault and says the fix."""


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


class RewriteError(GraphampError, RuntimeError):
    """An op cannot run in the dtype the lists give it (no low-precision kernel); the message names the op's entry."""
