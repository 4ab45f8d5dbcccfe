"""Progress lines for slow phases: capture, the cast pass, and inductor's forward and backward compiles.

A compile of a real model takes a minute on a small CPU; a silent minute looks like a hang. Each phase is
timed (the durations land in `Captured.timings`), and by default a phase that is still running after
`SLOW_PHASE_S` seconds prints a line on stderr, then its time when it ends. `progress=True` prints every
phase, `progress=False` none.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

__all__ = ["Progress"]

SLOW_PHASE_S = 2.0


class Progress:
    def __init__(self, mode: bool | None = None, stream=None):
        if mode not in (None, True, False):
            raise ValueError(f"progress must be None (slow phases only), True or False, got {mode!r}.")
        self.mode = mode
        self.stream = stream
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"mode": self.mode, "stream": None}  # a lock cannot be copied or pickled; nor can a stream

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["mode"])

    def start(self, what: str) -> _Phase:
        return _Phase(self, what)

    @contextmanager
    def phase(self, what: str, timings: dict | None = None):
        """Time the body; `timings[what]` gets its seconds."""
        running = self.start(what)
        try:
            yield
        finally:
            seconds = running.end()
            if timings is not None:
                timings[what] = seconds

    def _print(self, line: str) -> None:
        with self._lock:
            stream = self.stream if self.stream is not None else sys.stderr  # read late: pytest swaps it
            print(f"graphamp: {line}", file=stream, flush=True)


class _Phase:
    """A phase in progress; its start line is printed at once, after SLOW_PHASE_S, or never."""

    def __init__(self, progress: Progress, what: str):
        self.progress, self.what = progress, what
        self.started = time.perf_counter()
        self.announced = False
        self._timer = None
        if progress.mode is True:
            self._announce()
        elif progress.mode is None:
            self._timer = threading.Timer(SLOW_PHASE_S, self._announce)
            self._timer.daemon = True
            self._timer.start()

    def _announce(self) -> None:
        self.announced = True
        self.progress._print(f"{self.what} ...")

    def end(self) -> float:
        seconds = time.perf_counter() - self.started
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()  # so `announced` is settled
        if self.announced:
            self.progress._print(f"{self.what}: done in {seconds:.1f} s")
        return seconds
