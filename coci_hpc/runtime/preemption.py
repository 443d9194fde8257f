"""Preemption and time-limit handling: handlers record, the training loop acts at a step boundary.

Slurm sends the job's ``--signal`` (e.g. ``--signal=USR1@60``) before the time limit and, with
``preempt_send_user_signal``, on preemption, then SIGTERM when it ends the job; without that
setting (most sites) a preemption is SIGTERM at the start of the partition's GraceTime. A handler that
checkpoints runs at an arbitrary point inside a step (torn state, a collective half done on one
rank), so :class:`SignalRecorder` only records. The loop calls :meth:`PreemptionGuard.stop_requested`
once per step on every rank; it agrees across ranks (a rank that got no signal still stops at the
same step), and then the loop saves and calls :meth:`PreemptionGuard.requeue`.

Why the job requeues itself: a job that exits during its grace time ends COMPLETED and is NOT
requeued by Slurm (seen on the local cluster), and Slurm never requeues a job that hits its time
limit. ``scontrol requeue`` ends the job and queues it again under the same id with
``SLURM_RESTART_COUNT`` incremented.

Usage::

    with PreemptionGuard() as guard:
        for step in range(start, total):
            train_step()
            if guard.stop_requested():          # every rank, every step: one tiny allreduce
                manager.save(step + 1, state)
                guard.requeue()                 # rank 0 asks Slurm; all ranks then return
                return
"""
from __future__ import annotations

import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from coci_hpc.comm import Comm
from coci_hpc.errors import SlurmError
from coci_hpc.runtime.attempts import StopPlan, stop_reason
from coci_hpc.slurm import commands, scontrol
from coci_hpc.slurm.env import JobEnvironment

# What the runtime owns while a loop runs: submitit and coci-submit ask Slurm for USR2, scripts and
# templates for USR1 or USR2, and SIGTERM comes at the end of the grace time / on scancel.
DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
REQUEUE_TRIES = 4
REQUEUE_BACKOFF_S = 1.0

@dataclass(frozen=True)
class Received:
    signum: int
    monotonic: float

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

class SignalRecorder:
    """Installs handlers that only record which signal came, and when.

    It composes with handlers already installed: a previous Python handler is still called after
    recording (unless ``chain=False``), and :meth:`uninstall` restores exactly what was there.
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS, *, chain: bool = True) -> None:
        self.signals = tuple(signals)
        self.chain = chain
        self.received: list[Received] = []
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(Received(signum, time.monotonic()))
        prev = self._previous.get(signum)
        # chain=False (the Session): the previous handlers are replaced while installed. submitit's
        # USR2 handler checkpoints and requeues inside the handler and exits: it must not run.
        if self.chain and callable(prev):
            prev(signum, frame)

    def install(self) -> SignalRecorder:
        for s in self.signals:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def first(self) -> Received | None:
        return self.received[0] if self.received else None

class PreemptionGuard:
    """Step-boundary agreement on stopping, and the self-requeue that follows a checkpoint.

    ``signal_lead_s`` is the lead time given to ``--signal`` (the ``@60`` in ``USR1@60``).
    :meth:`plan` tells a preemption, a time-limit warning and a cancellation apart from Slurm's own
    record of the job (``PreemptTime``, time left, ``Restarts``), never from elapsed time.
    """

    def __init__(self, comm: Comm | None = None, job: JobEnvironment | None = None,
                 recorder: SignalRecorder | None = None, signal_lead_s: float | None = None,
                 runner: commands.Runner = commands.run_command) -> None:
        self.comm = Comm.wrap(comm)
        self.job = job if job is not None else JobEnvironment.from_env()
        self.recorder = recorder if recorder is not None else SignalRecorder()
        self.signal_lead_s = signal_lead_s
        self._runner = runner
        self._stopping = False

    def __enter__(self) -> PreemptionGuard:
        self.recorder.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.recorder.uninstall()

    def stop_requested(self) -> bool:
        """Collective: True on every rank once any rank has received a stop signal."""
        local = 1.0 if self.recorder.received else 0.0
        self._stopping = self.comm.allreduce_max(local) > 0
        return self._stopping

    def plan(self) -> StopPlan | None:
        """Why this stop, from Slurm's record (:func:`coci_hpc.runtime.attempts.stop_reason`, the
        Session's one rule), and whether the job should requeue itself; None before any signal."""
        first = self.recorder.first
        if first is None:
            return None
        record = None
        if self.job.in_slurm_job:
            try:
                record = scontrol.show_job(self.job.requeue_id or "", self._runner)
            except (SlurmError, ValueError):
                record = None
        now = time.time()
        return stop_reason(first.name, record, now_wall=now, signal_wall=now - (time.monotonic() - first.monotonic),
                           restart_count=self.job.restart_count, in_slurm_job=self.job.in_slurm_job,
                           signal_lead_s=self.signal_lead_s)

    def reason(self) -> str:
        """'time_limit', 'preemption', 'cancelled', 'requeue_by_hand', 'terminated', or 'none'."""
        p = self.plan()
        return "none" if p is None else p.reason

    def requeue(self) -> None:
        """Collective: rank 0 asks Slurm to requeue this job; a failure is raised on every rank."""
        def ask() -> None:
            if self.comm.rank != 0:
                return
            if self.job.requeue_id is None:
                raise SlurmError("cannot requeue: this process is not inside a Slurm job (no SLURM_JOB_ID)",
                                 hint="run the training script with sbatch, or handle stopping yourself")
            requeue_with_retries(self.job.requeue_id, self._runner)
        self.comm.run_step(ask, "requeue")


def requeue_with_retries(job_id: str, runner: commands.Runner = commands.run_command, *,
                         tries: int = REQUEUE_TRIES, backoff_s: float = REQUEUE_BACKOFF_S,
                         sleep: Any = time.sleep) -> int:
    """``scontrol requeue`` with retries: slurmctld can be briefly busy or unreachable (a transient
    failure must not turn a clean stop into a lost attempt). Returns the number of tries used;
    the last failure is raised when every try failed. The waits (1, 2, 4 s) fit in a grace time."""
    for i in range(1, tries + 1):
        try:
            commands.requeue(job_id, runner)
            return i
        except SlurmError as exc:
            if i == tries:
                raise SlurmError(f"scontrol requeue {job_id} failed {tries} times; last: {exc.message}",
                                 hint="is slurmctld up (`scontrol ping`)? the checkpoint is saved: "
                                      "`scontrol requeue` the job or resubmit it to resume") from exc
            sleep(backoff_s * 2 ** (i - 1))
    raise AssertionError("unreachable")
