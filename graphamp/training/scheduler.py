"""An LR scheduler that steps only after the decorated optimizers applied their step.

accelerate's `AcceleratedScheduler` and HF Trainer hold the schedule back on a step GradScaler skipped, but they ask
only their own GradScaler (`AcceleratedOptimizer.step_was_skipped`); a decorated optimizer skips inside its own
`step()`, which they cannot see. Wrapped so, the scheduler asks the decorated optimizers: docs/training_loops.md.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from graphamp.errors import ArgumentError

__all__ = ["AppliedStepsScheduler"]


class AppliedStepsScheduler:
    """``scheduler``, whose ``step()`` does nothing after a step that any of ``optimizers`` (decorated) skipped for
    inf/NaN gradients, as accelerate's and HF Trainer's own float16 path do. Everything else is ``scheduler``'s:
    ``get_last_lr()``, ``state_dict()``, ``load_state_dict()`` and other attributes.

    Args:
        scheduler: a torch LR scheduler stepped once per optimizer step (not ``ReduceLROnPlateau``, stepped on a
            metric).
        optimizers: what ``graphamp.decorate`` returned (one wrapper or a list); asking each whether its last step
            was skipped reads its ``found_inf`` back from the device (one host sync per ``step()``).
    """

    def __init__(self, scheduler: Any, optimizers: Any | Sequence[Any]) -> None:
        optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or not hasattr(scheduler, "step"):
            raise ArgumentError(f"AppliedStepsScheduler takes an LR scheduler stepped once per optimizer step, got a "
                                f"{type(scheduler).__name__}: step a ReduceLROnPlateau on its metric yourself.")
        if not optimizers or not all(hasattr(opt, "step_was_skipped") for opt in optimizers):
            raise ArgumentError("AppliedStepsScheduler(scheduler, optimizers): pass what graphamp.decorate() returned.")
        self.scheduler = scheduler
        self.optimizers = optimizers

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not any(opt.step_was_skipped for opt in self.optimizers):
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "optimizers"):  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)
