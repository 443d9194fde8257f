"""A deadline for a synchronous save: a hung rank ends the job instead of hanging it.

A rank stuck in its write (a hung filesystem, a stuck process) leaves every other rank inside
the next collective of the save, where MPI offers no timeout: the job would sit there until its
time limit. So each rank arms a watchdog when a synchronous save starts. If the save has not
finished by the deadline, the watchdog prints which rank, which step and where it is stuck, and
aborts the job (``Comm.abort``: ``MPI_Abort``); nothing of that step is committed (the
manifest is written last) and the next save removes its directory.

A rank that finished its own part and only waits for the others gets ``grace_s`` more, so the
stuck rank's own watchdog fires first and the report names it.
"""
from __future__ import annotations

import sys
import threading
import time
from types import TracebackType

from coci_hpc.comm import Comm


class Watchdog:
    def __init__(self, comm: Comm, timeout_s: float | None, what: str) -> None:
        self.comm, self.timeout_s, self.what = comm, timeout_s, what
        self.grace_s = 0.0 if timeout_s is None else max(5.0, 0.25 * timeout_s)
        self.phase = "starting"
        self._deadline = 0.0
        self._t0 = 0.0
        self._cond = threading.Condition()
        self._done = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        if self.timeout_s is None:
            return self
        self._t0 = time.monotonic()
        self._deadline = self._t0 + self.timeout_s
        self._thread = threading.Thread(target=self._watch, name="coci-watchdog", daemon=True)
        self._thread.start()
        return self

    def enter(self, phase: str, waiting_for_others: bool = False) -> None:
        """Name the current phase; a phase that only waits for other ranks gets the grace time."""
        with self._cond:
            self.phase = phase
            if self.timeout_s is not None:
                self._deadline = self._t0 + self.timeout_s + (self.grace_s if waiting_for_others else 0.0)
                self._cond.notify_all()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def _watch(self) -> None:
        with self._cond:
            while not self._done:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._done:
                return
            print(f"coci_hpc: rank {self.comm.rank}: {self.what} did not finish within "
                  f"{time.monotonic() - self._t0:.0f} s (stuck {self.phase}); aborting the job so "
                  f"that it does not hang until its time limit. Nothing of it was committed. "
                  f"(CheckpointManager(timeout_s=...) sets the limit.)", file=sys.stderr, flush=True)
        self.comm.abort(1)
