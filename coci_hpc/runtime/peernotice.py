"""A notice from coci-submit's relaunch loop to the ranks of its step: "a rank of this step is gone".

Why: a rank that vanishes (SIGKILL, a crash, ``devcluster fail --hard``) never joins the step
agreement, and nothing in Open MPI under ``srun --mpi=pmix`` tells the survivors, so they used to
notice only when the agreement's deadline (:data:`.stepsync.MIN_DEADLINE_S`, 5 s) ran out: half of
a 10 s in-place restart. srun, on the other hand, learns at once: the dead task's slurmstepd reports
its exit and srun prints ``srun: error: n2: task 1: Killed``. The relaunch loop reads srun's stderr
(:func:`coci_hpc.slurm.srun_step.watch_step`) and, on that line, writes this notice: one small file
whose path the loop gives each rank step in ``COCI_PEER_NOTICE`` (on the job's log folder, shared
like the checkpoints). A survivor waiting for a late peer (:class:`.stepsync.StepSync`) looks for
it every :data:`POLL_S` and, once it is there, counts the peer as lost without waiting out the
deadline.

It is only ever written after srun saw a task END (killed, exited non-zero, its node declared
down), so a slow but live peer never triggers it: that case still has the whole deadline. A node
whose slurmd dies with it reports nothing until slurmctld declares it DOWN (SlurmdTimeout): there
the deadline stays the detector. Without the relaunch loop (no ``--spare-nodes``) there is no
notice and the deadline is the only path, as before.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping

from coci_hpc import settings
from coci_hpc.durable import write_atomic

ENV = settings.PEER_NOTICE.name
POLL_S = 0.05        # how often a waiting survivor looks (a stat per look, only while a peer is late)


def post(path: str | os.PathLike[str], why: str) -> None:
    """Write the notice (atomically: a reader sees all of ``why`` or nothing)."""
    write_atomic(path, why.strip() + "\n")


def training_marker(path: str | os.PathLike[str]) -> str:
    """The file the Session's rank 0 creates once its ranks are past their start (MPI, gloo, the
    restore): from then on the survivors of a lost rank have something newer than the checkpoint to
    save, and the loop gives them its full grace; before, it ends the step after a second."""
    return os.fspath(path) + ".training"


def left_marker(path: str | os.PathLike[str]) -> str:
    """The file the survivors' writer creates once the survivors' save is over (committed or not)
    and they are leaving: the step's outcome is decided. A peer that still has not ended by then is
    silent (a frozen or dead host whose node Slurm has not declared down yet: SlurmdTimeout), and
    the loop ends the step instead of waiting for Slurm (:func:`coci_hpc.slurm.srun_step.silent_nodes`)."""
    return os.fspath(path) + ".left"


def clear(path: str | os.PathLike[str]) -> None:
    """Remove a launch's notice and its markers."""
    for p in (os.fspath(path), training_marker(path), left_marker(path)):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


class PeerNotice:
    """The reading side, for one rank step: :meth:`posted` is rate-limited to one look per ``poll_s``."""

    def __init__(self, path: str | os.PathLike[str], poll_s: float = POLL_S) -> None:
        self.path = os.fspath(path)
        self.poll_s = poll_s
        self._next = 0.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PeerNotice | None:
        path = (os.environ if environ is None else environ).get(ENV, "")
        return cls(path) if path else None

    def mark_training(self) -> None:
        """Rank 0, once every rank restored and the loop is about to run (see :func:`training_marker`)."""
        try:
            with open(training_marker(self.path), "w"):
                pass
        except OSError:        # then a step that loses a rank gets a second, not the grace: the
            pass               # survivors' save may be cut short and the run resumes a bit further back

    def mark_left(self) -> None:
        """The survivors' writer, after its save and its ``peer_lost`` record (see :func:`left_marker`)."""
        try:
            with open(left_marker(self.path), "w"):
                pass
        except OSError:        # then the loop waits for the silent task's end, or its grace, as before
            pass

    def posted(self, now: float | None = None) -> str | None:
        """The notice's text once the loop has posted it, else None (also between looks)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        self._next = now + self.poll_s
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                return f.read().strip() or "a task of the rank step ended"
        except OSError:          # not posted (or unreadable: then the deadline decides, as without it)
            return None
