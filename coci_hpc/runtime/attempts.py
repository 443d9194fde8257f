"""Pure decisions about attempts: how the previous one ended, why we are stopping, when to give up.

Inputs are Slurm's own record of the job (``sacct -X -D`` rows, one per attempt, read by
:mod:`coci_hpc.slurm.sacct`) and the session's event log, as the typed records of
:mod:`coci_hpc.runtime.events` (lines as read, dicts, are parsed first); nothing here guesses from elapsed time. The callers (the Session, on rank 0) run the
commands once per attempt; these functions only decide, so they are tested without Slurm.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from coci_hpc import settings
from coci_hpc.runtime.events import (
    AttemptStart,
    Checkpoint,
    End,
    EndStatus,
    Lines,
    Losses,
    PeerLost,
    PrevEndReason,
    PrevEndSource,
    Record,
    Relaunch,
    RelaunchAction,
    Resumed,
    Stop,
    StopReason,
    last_attempt,
    records,
    relaunch_cause,
)
from coci_hpc.slurm import states
from coci_hpc.slurm.sacct import SlurmAttempt
from coci_hpc.slurm.scontrol import JobState

R = TypeVar("R", bound=Record)

# Slurm's end state of an attempt -> the contract's reason (when the session wrote no stop record).
_STATE_REASON = {
    "PREEMPTED": PrevEndReason.PREEMPTION,
    "TIMEOUT": PrevEndReason.TIME_LIMIT,
    "DEADLINE": PrevEndReason.TIME_LIMIT,
    "NODE_FAIL": PrevEndReason.NODE_FAILURE,
    "BOOT_FAIL": PrevEndReason.NODE_FAILURE,
    "REQUEUED": PrevEndReason.REQUEUE_BY_HAND,   # requeued, and the session did not ask for it
}

# The time-limit warning arrives at most ``lead`` seconds before the limit, but Slurm checks
# limits periodically and may send it up to a minute early; more time left than this margin past
# the lead cannot be the time limit's warning.
TIME_LIMIT_MARGIN_S = 65.0


@dataclass(frozen=True)
class PrevEnd:
    reason: PrevEndReason
    source: PrevEndSource
    detail: str
    end_wall: float | None  # when the previous attempt stopped (stop record) or ended (Slurm)

    def to_dict(self) -> dict[str, Any]:
        return {"reason": str(self.reason), "source": str(self.source), "detail": self.detail}


def previous_records(events: Lines) -> list[Record]:
    """The records of the newest attempt in the log (the one before the attempt now starting)."""
    recs = records(events)
    last = last_attempt(recs)
    return [e for e in recs if int(e.attempt or 0) == last] if last else []


def _newest(recs: Sequence[Record], kind: type[R]) -> R | None:
    return next((e for e in reversed(recs) if isinstance(e, kind)), None)


def classify_previous(prev_records: Lines, prev_slurm: SlurmAttempt | None,
                      *, restart_count: int, sacct_error: str | None = None) -> PrevEnd:
    """How the previous attempt ended.

    ``prev_records``: the session's records of the previous attempt (may be from another job when
    the run was resubmitted). ``prev_slurm``: Slurm's row of this job's previous attempt (None when
    this is the job's first attempt or sacct was unavailable). A ``stop`` record means the session
    stopped on a signal (its reason is the session's); a requeue without one was done by hand; no
    record and a FAILED/CANCELLED/unknown end is a crash.
    """
    recs = records(prev_records)
    stop, end = _newest(recs, Stop), _newest(recs, End)
    in_same_job = restart_count > 0
    lost, relaunch = _newest(recs, PeerLost), _newest(recs, Relaunch)
    if relaunch is not None and relaunch.action in (RelaunchAction.RELAUNCH, RelaunchAction.REQUEUE) and end is None:
        # coci-submit's relaunch loop (--spare-nodes) saw the step fail and asked Slurm about the
        # nodes, then restarted the ranks inside the allocation (Slurm's attempt row is still this
        # one) or requeued the job (Slurm's row then says REQUEUED, not why).
        when = (lost.failure_wall or lost.wall) if lost is not None else relaunch.step_ended_wall
        return PrevEnd(PrevEndReason(relaunch_cause(relaunch)), PrevEndSource.RELAUNCH,
                       f"{relaunch.reason}" + ("" if lost is None else f"; rank(s) {lost.ranks_lost or '?'} "
                                               f"lost after step {lost.step}"),
                       None if when is None else float(when))
    if lost is not None and end is None:
        # A rank vanished and a survivor recorded it: a node failure when Slurm says so, else a
        # crashed rank on a healthy node (the survivors requeued the job themselves).
        state = prev_slurm.state if in_same_job and prev_slurm is not None else ""
        saved = (f"survivors' checkpoint of step {lost.step}" if lost.committed
                 else f"no survivors' checkpoint ({lost.reason})")
        return PrevEnd(PrevEndReason.NODE_FAILURE if state == "NODE_FAIL" else PrevEndReason.RANK_FAILURE,
                       PrevEndSource.SESSION,
                       f"rank(s) {lost.ranks_lost or '?'} lost after step {lost.step}; {saved}"
                       + (f"; Slurm: {state}" if state else ""), _wall(lost.failure_wall or lost.wall))
    if in_same_job and prev_slurm is not None:
        state = prev_slurm.state
        if stop is not None and state in states.AFTER_A_STOP:
            return PrevEnd(_stop_reason(stop), PrevEndSource.SESSION,
                           f"stopped at step {stop.step} on {stop.signal}; Slurm: {state}", _wall(stop.wall))
        reason = _STATE_REASON.get(state, PrevEndReason.CRASH)
        return PrevEnd(reason, PrevEndSource.SACCT, f"Slurm recorded the previous attempt as {state or 'unknown'}"
                       + ("" if stop is None else " (after a stop record)"), prev_slurm.end)
    if stop is not None:
        return PrevEnd(_stop_reason(stop), PrevEndSource.SESSION,
                       f"stopped at step {stop.step} on {stop.signal}"
                       + (f"; sacct unavailable: {sacct_error}" if in_same_job and sacct_error else ""),
                       _wall(stop.wall))
    if end is not None or not recs:
        return PrevEnd(PrevEndReason.NONE, PrevEndSource.NONE, "first attempt" if not recs else
                       f"previous run ended {end.status}", None)   # type: ignore[union-attr]
    last_wall = max(_wall(e.wall) for e in recs)
    why = "no stop or end record"
    if in_same_job:
        why += f"; sacct unavailable: {sacct_error}" if sacct_error else "; Slurm has no previous attempt"
    return PrevEnd(PrevEndReason.CRASH, PrevEndSource.SESSION, why, last_wall)


def _stop_reason(stop: Stop) -> PrevEndReason:
    # Every stop reason is an end reason; a value this version does not know reads as a crash's.
    return PrevEndReason(stop.reason) if stop.reason in tuple(PrevEndReason) else PrevEndReason.CRASH


def _wall(w: float | None) -> float:
    # Every writer stamps ``wall``; a record without one is not whole (read_events skips those).
    if w is None:
        raise KeyError("wall")
    return float(w)


def last_step_seen(prev_records: Lines) -> int | None:
    """The newest step the previous attempt is known to have reached (losses, checkpoints, stop)."""
    best = None
    for e in records(prev_records):
        cand = None
        if isinstance(e, Losses) and e.steps:
            cand = max(int(s) for s in e.steps)
        elif isinstance(e, (Checkpoint, Stop, End, Resumed, PeerLost)) and e.step is not None:
            cand = int(e.step)
        elif isinstance(e, AttemptStart) and e.resumed_step is not None:
            cand = int(e.resumed_step)
        if cand is not None and (best is None or cand > best):
            best = cand
    return best


def steps_lost(prev_records: Lines, resumed_step: int | None, last_finished: int | None = None) -> int | None:
    """Steps done by the previous attempt past the checkpoint we resume from. ``last_finished``:
    the newest step its ranks' progress records say they finished (:mod:`.progress`), exact after
    any end; without it, the records' newest step, a lower bound after a crash (losses are flushed
    every few seconds, not every step)."""
    recs = records(prev_records)
    if not recs:
        return None
    seen = last_step_seen(recs)
    if last_finished is not None:
        seen = max(seen if seen is not None else last_finished, last_finished)
    if seen is None:
        return None
    return max(0, seen - (resumed_step or 0))


@dataclass(frozen=True)
class Ledger:
    """What the previous attempt did that this one repeats: ``lost`` steps (None: nothing to
    compare), up to ``last_step``; ``exact`` unless only a lower bound is known."""

    lost: int | None
    last_step: int | None
    exact: bool


def ledger(prev_records: Lines, resumed_step: int | None, last_finished: int | None) -> Ledger:
    """The steps the previous attempt finished past ``resumed_step``: from its ranks' progress
    records (``last_finished``, :mod:`.progress`), else from its records in the log. Exact with a
    record at least as new as the log's newest step, or after a stop (the loop stopped at its
    step); a lower bound otherwise (no record survived, or an older one did: a power loss)."""
    recs = records(prev_records)
    seen = last_step_seen(recs)
    last = max((s for s in (seen, last_finished) if s is not None), default=None)
    exact = (last_finished is not None and (seen is None or last_finished >= seen)) \
        or any(isinstance(e, Stop) for e in recs)
    return Ledger(steps_lost(recs, resumed_step, last_finished), last, exact)


# Restarts that follow the session's own announced stop (the --signal warning of a time limit, a
# preemption) are the job working as intended; these are the ones --max-requeues counts.
UNANNOUNCED = (PrevEndReason.NODE_FAILURE, PrevEndReason.CRASH, PrevEndReason.REQUEUE_BY_HAND)
# Stops that Slurm itself follows with a requeue (of a --requeue job): the session must not add one.
SLURM_REQUEUES = (StopReason.REQUEUE_BY_HAND, StopReason.NODE_FAILURE)
# Time a stop keeps back for `scontrol requeue` (with its retries' first wait) and the exit.
REQUEUE_ALLOWANCE_S = 3.0
# The lead of coci-submit's and the templates' --signal (USR2@90) when the session is not told one.
DEFAULT_SIGNAL_LEAD_S = float(settings.SIGNAL_LEAD_S)
LEAD_SPARE_S = 30.0          # what a suggested lead adds for slow steps and a slow filesystem


@dataclass(frozen=True)
class LeadVerdict:
    stop_at_boundary: bool     # agree on the stop at the signal's own boundary (not one step later)
    warning: str | None        # even that cannot fit: the run would reach its time limit


def suggested_lead_s(step_s: float, save_s: float | None, requeue_s: float = REQUEUE_ALLOWANCE_S) -> int:
    """A --signal lead that covers two steps (the pipelined agreement), a save and the requeue,
    plus :data:`LEAD_SPARE_S`, rounded up to 10 s."""
    need = 2 * step_s + (save_s or 0.0) + requeue_s + LEAD_SPARE_S
    return int(math.ceil(need / 10.0) * 10)


def lead_check(lead_s: float, step_s: float | None, save_s: float | None,
               requeue_s: float = REQUEUE_ALLOWANCE_S) -> LeadVerdict:
    """Compare the --signal lead with the measured step, save and requeue times.

    The session's stop agreement is pipelined: a signal during step k stops the loop after step
    k+1, so the lead must cover up to two steps, the stop-save and the requeue. When it covers one
    step but not two, the session agrees at the boundary itself (a blocking allreduce per step:
    cheap next to steps this long). When it does not cover one, the time limit wins: Slurm ends
    the job TIMEOUT and never requeues it, hence the warning with a lead that fits.
    """
    if step_s is None:
        return LeadVerdict(False, None)
    save = save_s or 0.0
    if lead_s >= 2 * step_s + save + requeue_s:
        return LeadVerdict(False, None)
    one = step_s + save + requeue_s
    if lead_s >= one:
        return LeadVerdict(True, None)
    return LeadVerdict(True, (
        f"the signal lead ({lead_s:.0f}s) is shorter than a step ({step_s:.1f}s) + a save "
        f"({'not measured yet' if save_s is None else f'{save_s:.1f}s'}) + the requeue ({requeue_s:.0f}s) = "
        f"{one:.0f}s: the time limit's warning comes too late to save, and Slurm never requeues a job that "
        f"reaches its time limit. Submit with --signal=USR2@{suggested_lead_s(step_s, save_s, requeue_s)} "
        f"(coci-submit --signal-lead {suggested_lead_s(step_s, save_s, requeue_s)}) and set COCI_SIGNAL_LEAD_S "
        f"to the same number"))


@dataclass(frozen=True)
class StopPlan:
    """Why the loop is stopping, from Slurm's record, and what to do: save if it fits, requeue or not."""

    reason: StopReason
    detail: str
    requeue: bool
    deadline_wall: float | None  # when Slurm kills the job (unix seconds); None: not known

    def save_fits(self, now_wall: float, save_s: float | None) -> bool:
        """Whether a save of ``save_s`` seconds (None: never measured) ends before the kill,
        with the requeue's allowance when the job requeues itself. Unknown either way: try; an
        interrupted save is never committed (the previous checkpoint stays the latest)."""
        if self.deadline_wall is None or save_s is None:
            return True
        spare = self.deadline_wall - now_wall - save_s - (REQUEUE_ALLOWANCE_S if self.requeue else 0.0)
        return spare >= 0


def stop_reason(signal_name: str, job: JobState | None, *, now_wall: float, signal_wall: float,
                restart_count: int, in_slurm_job: bool, signal_lead_s: float | None,
                grace_time_s: float | None = None, kill_wait_s: float | None = None) -> StopPlan:
    """The one rule for why a run is stopping, from Slurm's own record of the job (``scontrol show
    job`` when the loop acts on the signal; None when it could not be read or there is no job).

    - ``PreemptTime`` set: a preemption, with or without ``preempt_send_user_signal``; the job must
      requeue itself (a job that exits in its grace time ends COMPLETED or FAILED and is not
      requeued); the window ends at PreemptTime + the partition's GraceTime.
    - USR1/USR2 without it: the --signal warning of the time limit when the time left is within
      the lead (Slurm may send it up to a minute early), else a signal by hand, treated as a
      preemption (no time limit left to run into either way); the job requeues itself.
    - SIGTERM without it: the job is being ended from outside (``scancel``, or a requeue by hand
      when Slurm's ``Restarts`` is already past this attempt's); Slurm requeues it if it should,
      so the session never does; the window is KillWait from the signal.
    """
    lead = DEFAULT_SIGNAL_LEAD_S if signal_lead_s is None else float(signal_lead_s)
    is_term = signal_name == "SIGTERM"
    if not in_slurm_job:
        return StopPlan(StopReason.TERMINATED if is_term else StopReason.PREEMPTION, f"{signal_name} outside a Slurm job",
                        False, None)
    if job is None:
        if is_term:
            return StopPlan(StopReason.TERMINATED, f"{signal_name}; Slurm's record unavailable: not requeued", False,
                            None if kill_wait_s is None else signal_wall + kill_wait_s)
        return StopPlan(StopReason.PREEMPTION, f"{signal_name}; Slurm's record unavailable: assumed preemption", True, None)
    if job.preempted:
        assert job.preempt_time is not None
        end = job.preempt_time + grace_time_s if grace_time_s is not None else job.end_time
        if is_term and grace_time_s == 0 and kill_wait_s is not None:
            end = signal_wall + kill_wait_s      # no grace time: SIGTERM, then SIGKILL after KillWait
        return StopPlan(StopReason.PREEMPTION, f"{signal_name}; Slurm: PreemptTime set, JobState={job.state}"
                        + ("" if grace_time_s is None else f", GraceTime {grace_time_s:.0f}s"), True, end)
    if not is_term:
        left = None if job.end_time is None else job.end_time - now_wall
        if left is None:
            return StopPlan(StopReason.PREEMPTION, f"{signal_name} with no time limit and no PreemptTime: sent by hand",
                            True, None)
        if left > lead + TIME_LIMIT_MARGIN_S:
            return StopPlan(StopReason.PREEMPTION, f"{signal_name} with {left:.0f}s left (> lead {lead:.0f}s + "
                            f"{TIME_LIMIT_MARGIN_S:.0f}s) and no PreemptTime: sent by hand", True, job.end_time)
        return StopPlan(StopReason.TIME_LIMIT, f"{signal_name} with {left:.0f}s left (lead {lead:.0f}s)", True, job.end_time)
    end = None if kill_wait_s is None else signal_wall + kill_wait_s
    if job.state == "NODE_FAIL" or job.reason in ("NodeDown", "NodeFail"):
        return StopPlan(StopReason.NODE_FAILURE, f"SIGTERM; Slurm: JobState={job.state}, Reason={job.reason} (a node of "
                        f"the job is down; Slurm requeues a --requeue job)", False, end)
    if job.restarts > restart_count:
        return StopPlan(StopReason.REQUEUE_BY_HAND, f"SIGTERM; Slurm: Restarts={job.restarts} > this attempt's "
                        f"{restart_count} (requeued from outside: scontrol requeue, or a node failure Slurm requeues)",
                        False, end)
    return StopPlan(StopReason.CANCELLED, f"SIGTERM; Slurm: JobState={job.state}, PreemptTime=None (scancel or "
                    f"ended by Slurm): not requeued", False, end)


def _this_jobs_starts(events: Sequence[Record], job_id: str | None) -> list[AttemptStart]:
    """``attempt_start`` records of this job's earlier attempts since the last ``gave_up`` (runs by
    hand and other jobs on the same directory are not this job's restarts)."""
    out: list[AttemptStart] = []
    for e in events:
        if isinstance(e, End) and e.status == EndStatus.GAVE_UP:
            out = []
        elif isinstance(e, AttemptStart) and job_id is not None and e.job_id == job_id:
            out.append(e)
    return out


def give_up_reason(events: Lines, resumed_step: int | None, prev_end_reason: str, *,
                   job_id: str | None, restart_count: int, max_requeues: int | None,
                   no_progress_limit: int, in_place_restart: int = 0) -> str | None:
    """Why this attempt must not train (None: go on).

    Only restarts of this one job count (a new job, a run by hand and a restart count of 0 start
    afresh, and so does everything after a ``gave_up``). ``--max-requeues``: restarts after an
    unannounced end (:data:`UNANNOUNCED`: node failures, crashes, requeues by hand), never the
    session's own stops for a time limit or a preemption, as submitit's ``max_num_timeout`` keeps
    timeouts apart. No progress: this attempt and the ``no_progress_limit`` attempts of this job
    before it all resumed from the same step, whether they came back through the queue or were
    restarted in place by coci-submit's relaunch loop (``in_place_restart``: this attempt's number
    of in-place restarts in its allocation, ``COCI_INPLACE_RESTARTS``). In-place restarts are not
    requeues: ``--max-restarts`` bounds them, ``--max-requeues`` does not count them.
    """
    if restart_count <= 0 and in_place_restart <= 0:
        return None
    starts = _this_jobs_starts(records(events), job_id)
    if max_requeues is not None:
        n = sum(1 for a in starts if int(a.restart_count or 0) > 0 and not a.in_place_restart
                and a.prev_end.get("reason") in UNANNOUNCED)
        n += prev_end_reason in UNANNOUNCED and in_place_restart <= 0
        if n > max_requeues:
            return (f"the job was requeued {n} times after unannounced ends (node failures, crashes, "
                    f"requeues by hand), more than --max-requeues {max_requeues}; not training and not "
                    f"requeueing again")
    if no_progress_limit > 0 and len(starts) >= no_progress_limit:
        here = resumed_step or 0
        recent = starts[-no_progress_limit:]
        if all((a.resumed_step or 0) == here for a in recent):
            return (f"{no_progress_limit + 1} attempts in a row started from step {here} and none got a "
                    f"newer checkpoint (no-progress limit {no_progress_limit}); the run cannot get past "
                    f"this point: see the previous attempts' errors")
    return None


def latency_split(prev_end_wall: float | None, attempt_start_wall: float | None, process_wall: float,
                  restored_wall: float, restore_s: float, last_step_wall: float | None = None
                  ) -> dict[str, float | None]:
    """Restart latency: the previous attempt's last finished step (``last_step_wall``, from the
    ranks' progress records; else its stop or failure) -> this attempt's first resumed step, split
    into the previous attempt's end after its last step (a stop's save, Slurm noticing a failure),
    Slurm's requeue delay (-> this attempt's start), process start (-> session created) and restore."""
    end = prev_end_wall
    if last_step_wall is not None and (end is None or end < last_step_wall):
        end = last_step_wall       # a crash's newest record lags its last step: it ended after that step
    begin = last_step_wall if last_step_wall is not None else end
    total = None if begin is None else max(0.0, restored_wall - begin)
    after = None if last_step_wall is None or end is None else end - last_step_wall
    slurm = None
    if end is not None and attempt_start_wall is not None:
        slurm = max(0.0, attempt_start_wall - end)
    proc = None if attempt_start_wall is None else max(0.0, process_wall - attempt_start_wall)
    return {"total": total, "after_last_step_s": after, "slurm_requeue_s": slurm, "process_start_s": proc,
            "restore_s": restore_s}


def describe_start(attempt: int, job_id: str | None, restart_count: int, nodes: Sequence[str], ranks: int,
                   prev_reason: str, prev_detail: str, resumed: int | None, lost: int | None,
                   last_step: int | None = None, exact: bool = True) -> str:
    """The log line of an attempt's start: what is unknown (no job, nothing to resume) is left out,
    not printed as None. ``last_step``: the previous attempt's last finished step; ``exact``:
    whether ``lost`` is (else a lower bound: no progress record of that attempt survived)."""
    where = ",".join(nodes) if nodes else "this host"
    head = f"attempt {attempt}" + (f" (job {job_id}, restart {restart_count})" if job_id else "")
    text = f"{head} on {where}, {ranks} rank(s)"
    if prev_reason != PrevEndReason.NONE:
        text += f"; previous attempt ended: {prev_reason} ({prev_detail})"
    elif attempt > 1 and prev_detail:
        text += f"; {prev_detail}"
    text += f"; resuming from step {resumed}" if resumed is not None else "; starting from step 0"
    if lost:
        text += f"; {'' if exact else 'at least '}{lost} step(s) to repeat"
        if last_step is not None:
            text += f" (the previous attempt finished step {last_step}" + (
                ")" if exact else "; its progress record is lost: counted from the event log)")
    return text


def describe_latency(lat: Mapping[str, float | None]) -> str:
    """``restart latency 37.3 s (requeue 30.1 s + start 5.2 s + restore 2.0 s)``, ``... from the last
    finished step (end 0.0 s + ...)`` when the progress records dated that step; parts not known left out."""
    parts = [f"{name} {lat[key]:.1f} s" for key, name in (
        ("after_last_step_s", "end"), ("slurm_requeue_s", "requeue"), ("process_start_s", "start"),
        ("restore_s", "restore")) if lat.get(key) is not None]
    total = lat.get("total")
    if total is None:
        return "restart latency unknown (no record of the previous end)" + (f": {', '.join(parts)}" if parts else "")
    since = " from the last finished step" if lat.get("after_last_step_s") is not None else ""
    return f"restart latency {total:.1f} s{since}" + (f" ({' + '.join(parts)})" if parts else "")
