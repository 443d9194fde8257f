"""Rank 0's buffer of step losses: one float stored per step into preallocated arrays, written to
the event log as one ``losses`` record with checkpoints, stops, and at most every ``FLUSH_S``."""
from __future__ import annotations

import time

import numpy as np

from coci_hpc.runtime.events import EventLog, Losses

CAPACITY = 4096          # losses kept between flushes, preallocated
FLUSH_S = 5.0            # at most one losses record per this many seconds between checkpoints


class LossBuffer:
    """Losses of the steps since the last flush; a disabled buffer (ranks other than 0) writes nothing."""

    def __init__(self, log: EventLog, *, enabled: bool, capacity: int = CAPACITY, flush_s: float = FLUSH_S) -> None:
        self.log, self.enabled, self.flush_s = log, enabled, flush_s
        self._steps = np.zeros(capacity, dtype=np.int64)
        self._values = np.zeros(capacity, dtype=np.float64)
        self._n = 0
        self._last_flush = time.monotonic()

    def record(self, step: int, loss: float) -> None:
        n = self._n
        self._steps[n], self._values[n] = step, loss
        self._n = n + 1
        if self._n == len(self._steps) or time.monotonic() - self._last_flush > self.flush_s:
            self.flush()

    def flush(self) -> None:
        n = self._n
        if self.enabled and n:
            self.log.write(Losses(steps=self._steps[:n].tolist(), values=self._values[:n].tolist()))
        self._n = 0
        self._last_flush = time.monotonic()
