"""Preemption and time-limit handling: handlers record, the training loop acts at a step boundary.

Slurm sends the job's ``--signal`` (e.g. ``--signal=USR1@60``) before the time limit and, with
``preempt_send_user_signal``, on preemption, then SIGTERM when it ends the job; without that
setting (most sites) a preemption is SIGTERM at the start of the partition's GraceTime. A handler that
checkpoints runs at an arbitrary point inside a step (torn state, a collective half done on one
rank), so :class:`~coci_hpc.runtime.signals.SignalRecorder` (the one record-only signal class)
only records. The loop calls :meth:`PreemptionGuard.stop_requested` once per step on every rank;
it agrees across ranks (a rank that got no signal still stops at the same step), and then the loop
saves and calls :meth:`PreemptionGuard.requeue`.

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

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from coci_hpc.comm import Comm
from coci_hpc.errors import CociError, PeerLost, SlurmError
from coci_hpc.runtime import attempts as att
from coci_hpc.runtime import events as ev
from coci_hpc.runtime.attempts import StopPlan, stop_reason
from coci_hpc.runtime.signals import DEFAULT_SIGNALS, Received, SignalRecorder
from coci_hpc.slurm import commands, scontrol
from coci_hpc.slurm.env import JobEnvironment

if TYPE_CHECKING:
    from coci_hpc.checkpoint import CheckpointManager
    from coci_hpc.runtime.losses import LossBuffer
    from coci_hpc.runtime.schedule import Schedule

REQUEUE_TRIES = 4
REQUEUE_BACKOFF_S = 1.0

# The one record-only signal class lives in runtime/signals.py; its names stay importable from here
# (PreemptionGuard's recorder argument, scripts written before the move).
__all__ = ["DEFAULT_SIGNALS", "PreemptionGuard", "Received", "SignalRecorder", "StopController",
           "requeue_with_retries"]


def own_signal(recorder: SignalRecorder) -> tuple[str, float] | None:
    """``recorder``'s first signal: (its name, its wall-clock time), or None."""
    first = recorder.first
    if first is None:
        return None
    return first.name, time.time() - (time.monotonic() - first.monotonic)


def jobs_first_signal(comm: Comm, recorder: SignalRecorder) -> tuple[str, float] | None:
    """Collective: the earliest first signal of any rank (name, wall time), or None. Slurm
    signals a job's tasks one by one, so when the ranks agree to stop, some may have none yet."""
    seen = [s for s in comm.allgather(own_signal(recorder)) if s is not None]
    return min(seen, key=lambda s: s[1]) if seen else None


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
        self._first: tuple[str, float] | None = None   # the job's first signal, once agreed

    def __enter__(self) -> PreemptionGuard:
        self.recorder.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.recorder.uninstall()

    def stop_requested(self) -> bool:
        """Collective: True on every rank once any rank has received a stop signal."""
        local = 1.0 if self.recorder.received else 0.0
        self._stopping = self.comm.allreduce_max(local) > 0
        if self._stopping and self._first is None:
            # once, on every rank at the same call: what :meth:`plan` decides on (this rank's
            # own signal may not have come yet)
            self._first = jobs_first_signal(self.comm, self.recorder)
        return self._stopping

    def plan(self) -> StopPlan | None:
        """Why this stop, from Slurm's record and the partition's GraceTime or KillWait
        (:class:`StopController`, the Session's one rule), and whether the job should requeue
        itself; None before any signal."""
        if self.recorder.first is None and self._first is None:
            return None
        return StopController(self.job, self.recorder, self.signal_lead_s, self._runner).plan(self._first)

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


class StopController:
    """The one stop rule, shared by :class:`PreemptionGuard` and the Session (same inputs, same
    answer): why this stop (Slurm's record of the job, one ``scontrol show job``, plus the
    partition's GraceTime for a preemption or KillWait for an end from outside), whether a save of
    a given length fits before Slurm's kill, whether the lead lets the loop agree one step late,
    and the collective requeue."""

    def __init__(self, job: JobEnvironment, recorder: SignalRecorder, signal_lead_s: float | None,
                 runner: commands.Runner = commands.run_command,
                 say: Callable[[str], None] | None = None) -> None:
        self.job, self.recorder, self.signal_lead_s = job, recorder, signal_lead_s
        self._runner, self._say = runner, say

    def plan(self, first: tuple[str, float] | None = None) -> StopPlan:
        """Why we stop (call after a signal; without one the signal is "?"). ``first``: the
        signal to decide on, (name, wall time), when it is not this process's own (the job's
        first, which another rank received: :meth:`stop`)."""
        first = first if first is not None else own_signal(self.recorder)
        signame = first[0] if first is not None else "?"
        now = time.time()
        signal_wall = first[1] if first is not None else now
        record, grace, kill_wait = None, None, None
        if self.job.in_slurm_job:
            try:
                record = scontrol.show_job(self.job.requeue_id or "", self._runner)
            except (SlurmError, ValueError, OSError) as exc:
                if self._say is not None:
                    self._say(f"`scontrol show job` failed ({exc}); deciding without Slurm's record")
            try:
                if record is not None and record.preempted and (record.partition or self.job.partition):
                    grace = scontrol.grace_time_s(record.partition or self.job.partition or "", self._runner)
                if signame == "SIGTERM" and (record is None or not record.preempted or grace == 0):
                    kill_wait = scontrol.kill_wait_s(self._runner)
            except (SlurmError, ValueError, OSError):
                kill_wait = kill_wait if kill_wait is not None else scontrol.DEFAULT_KILL_WAIT_S
        return stop_reason(signame, record, now_wall=time.time(), signal_wall=signal_wall,
                           restart_count=self.job.restart_count, in_slurm_job=self.job.in_slurm_job,
                           signal_lead_s=self.signal_lead_s, grace_time_s=grace, kill_wait_s=kill_wait)

    def decide(self, save_s: float | None, first: tuple[str, float] | None = None
               ) -> tuple[ev.StopReason, str, bool, bool]:
        """Rank 0 at the stop: (reason, detail, requeue, whether a save of ``save_s`` fits);
        ``first`` as for :meth:`plan`."""
        plan = self.plan(first)
        return plan.reason, plan.detail, plan.requeue, plan.save_fits(time.time(), save_s)

    @property
    def lead_s(self) -> float:
        return self.signal_lead_s if self.signal_lead_s is not None else att.DEFAULT_SIGNAL_LEAD_S

    def lead_check(self, step_s: float | None, save_s: float | None) -> att.LeadVerdict:
        """Whether to agree on a stop at the boundary itself (the signal lead cannot cover two
        steps, a save and the requeue) and the warning when even one step does not fit. A run by
        hand has no warning signal to fit in."""
        if not self.job.in_slurm_job and self.signal_lead_s is None:
            return att.LeadVerdict(False, None)
        return att.lead_check(self.lead_s, step_s, save_s, att.REQUEUE_ALLOWANCE_S)

    def agree_at_boundary(self, schedule: Schedule, log: ev.EventLog, *, warn: bool) -> bool:
        """Rank 0 (the Session): :meth:`lead_check` with the planner's measured step and save;
        with ``warn``, says so (and logs ``lead_warning``) when even one step does not fit."""
        step_s, save_s = schedule.costs().step_time_s, schedule.save_s()
        verdict = self.lead_check(step_s, save_s)
        if warn and verdict.warning:
            if self._say is not None:
                self._say(verdict.warning)
            log.write(ev.LeadWarning(message=verdict.warning, lead_s=self.lead_s, step_s=step_s, save_s=save_s))
        return verdict.stop_at_boundary

    def stop(self, step: int, *, comm: Comm, mgr: CheckpointManager, schedule: Schedule, log: ev.EventLog,
             losses: LossBuffer, settle: Callable[[], None], save: Callable[[int], None],
             wait_s: float) -> NoReturn:
        """Collective, the Session's stop at a step boundary: rank 0 decides (:meth:`decide`), every
        rank settles the save in flight, saves ``step`` (``save``) when that fits before Slurm's
        kill, records the stop, requeues when the job must requeue itself (the others wait up to
        ``wait_s``), closes the store and raises ``SystemExit(0)``."""
        # The ranks stop together once any of them has a signal, so rank 0 (which decides and
        # records) may not have had its own yet: Slurm signals a job's tasks one by one. It
        # decides on the job's first signal, whichever rank received it (until 2026-11-30 its
        # own, "?" when none: a scancel then read as a signal by hand, and the job requeued).
        first = jobs_first_signal(comm, self.recorder)
        signame = first[0] if first is not None else "?"
        decision = self.decide(schedule.save_s(), first) if comm.rank == 0 else None
        reason, detail, requeue, fits = comm.bcast(decision)
        reason = ev.StopReason(reason)
        requeue = requeue and self.job.in_slurm_job
        settle()
        saved = mgr.latest_step() == step
        if not saved and fits:
            schedule.stopping()
            save(step)
            saved = True
        elif not saved:
            detail += "; no save: it would not end before Slurm's kill"
        losses.flush()
        rc = self.job.restart_count
        log.write(ev.Stop(step=step, reason=reason, signal=signame, requeued=requeue, detail=detail,
                          restart_count=rc, saved=saved))
        if requeue:
            # The others wait for rank 0's `scontrol requeue` (with its retries): not a lost peer.
            self.requeue(comm, wait_s, lambda exc: log.write(ev.End(step=step, status=ev.EndStatus.ERROR,
                                                                             message=str(exc))))
        mgr.close()
        if comm.rank == 0 and self._say is not None:
            self._say(f"stopped at step {step} ({reason}: {detail}): "
                      + ("checkpoint saved" if saved else f"resumes from step {mgr.latest_step() or 0}")
                      + (", job requeued" if requeue else "; Slurm requeues the job" if reason in att.SLURM_REQUEUES
                         else "; not requeued (run again with the same arguments to resume)"))
        raise SystemExit(0)

    def requeue(self, comm: Comm, wait_s: float | None, on_error: Callable[[CociError], object]) -> None:
        """Collective: rank 0 asks Slurm (with retries) while the others wait up to ``wait_s``
        (not a lost peer); a failure other than a lost peer goes to ``on_error``, then raised."""
        def ask() -> None:
            if comm.rank == 0:
                requeue_with_retries(self.job.requeue_id or "", self._runner)
        with comm.deadline(wait_s):
            try:
                comm.run_step(ask, "requeue")
            except PeerLost:
                raise
            except CociError as exc:
                on_error(exc)
                raise


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
