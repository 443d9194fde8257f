"""Pure decisions about attempts: how the previous one ended, why we are stopping, when to give up.

Inputs are Slurm's own record of the job (``sacct -X -D`` rows: one per attempt) and the session's
event log; nothing here guesses from elapsed time. The callers (the Session, on rank 0) run the
commands once per attempt; these functions only decide, so they are tested without Slurm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from coci_hpc.slurm.accounting import parse_time

SACCT_FIELDS = ("JobID", "State", "Start", "End", "NodeList")

# Slurm's end state of an attempt -> the contract's reason (when the session wrote no stop record).
_STATE_REASON = {
    "PREEMPTED": "preemption",
    "TIMEOUT": "time_limit",
    "DEADLINE": "time_limit",
    "NODE_FAIL": "node_failure",
    "BOOT_FAIL": "node_failure",
    "REQUEUED": "requeue_by_hand",   # requeued, and the session did not ask for it
}

# The time-limit warning arrives at most ``lead`` seconds before the limit, but Slurm checks
# limits periodically and may send it up to a minute early; more time left than this margin past
# the lead cannot be the time limit's warning.
TIME_LIMIT_MARGIN_S = 65.0


@dataclass(frozen=True)
class SlurmAttempt:
    state: str
    start: float | None
    end: float | None
    nodes: str


@dataclass(frozen=True)
class PrevEnd:
    reason: str            # time_limit|preemption|node_failure|rank_failure|requeue_by_hand|crash|none
    source: str            # session|sacct|scontrol|none
    detail: str
    end_wall: float | None  # when the previous attempt stopped (stop record) or ended (Slurm)

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "source": self.source, "detail": self.detail}


def sacct_job_argv(job_id: str) -> list[str]:
    return ["sacct", "-X", "-D", "-P", "-n", "-j", job_id, "--format=" + ",".join(SACCT_FIELDS)]


def parse_job_attempts(text: str, job_id: str) -> list[SlurmAttempt]:
    """``sacct -X -D -P -n`` rows of one job, oldest attempt first (array tasks: ``A_T`` ids)."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < len(SACCT_FIELDS) or parts[0] != job_id:
            continue
        state = parts[1].split()[0] if parts[1] else ""   # "CANCELLED by 0" -> CANCELLED
        try:
            start, end = parse_time(parts[2]), parse_time(parts[3])
        except ValueError:
            start, end = None, None
        rows.append(SlurmAttempt(state, start, end, parts[4]))
    rows.sort(key=lambda r: (r.start is None, r.start or 0.0))
    return rows


def previous_records(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the newest attempt in the log (the one before the attempt now starting)."""
    last = max((int(e.get("attempt") or 0) for e in events), default=0)
    return [e for e in events if int(e.get("attempt") or 0) == last] if last else []


def classify_previous(prev_records: Sequence[dict[str, Any]], prev_slurm: SlurmAttempt | None,
                      *, restart_count: int, sacct_error: str | None = None) -> PrevEnd:
    """How the previous attempt ended.

    ``prev_records``: the session's records of the previous attempt (may be from another job when
    the run was resubmitted). ``prev_slurm``: Slurm's row of this job's previous attempt (None when
    this is the job's first attempt or sacct was unavailable). A ``stop`` record means the session
    stopped on a signal (its reason is the session's); a requeue without one was done by hand; no
    record and a FAILED/CANCELLED/unknown end is a crash.
    """
    stop = next((e for e in reversed(prev_records) if e.get("event") == "stop"), None)
    end = next((e for e in reversed(prev_records) if e.get("event") == "end"), None)
    in_same_job = restart_count > 0
    lost = next((e for e in reversed(prev_records) if e.get("event") == "peer_lost"), None)
    if lost is not None and end is None:
        # A rank vanished and a survivor recorded it: a node failure when Slurm says so, else a
        # crashed rank on a healthy node (the survivors requeued the job themselves).
        state = prev_slurm.state if in_same_job and prev_slurm is not None else ""
        saved = (f"survivors' checkpoint of step {lost.get('step')}" if lost.get("committed")
                 else f"no survivors' checkpoint ({lost.get('reason')})")
        return PrevEnd("node_failure" if state == "NODE_FAIL" else "rank_failure", "session",
                       f"rank(s) {lost.get('lost_ranks') or '?'} lost after step {lost.get('step')}; {saved}"
                       + (f"; Slurm: {state}" if state else ""), float(lost.get("failure_wall") or lost["wall"]))
    if in_same_job and prev_slurm is not None:
        state = prev_slurm.state
        if stop is not None and state in ("REQUEUED", "PREEMPTED", "TIMEOUT", "COMPLETED", "CANCELLED"):
            return PrevEnd(str(stop.get("reason")), "session",
                           f"stopped at step {stop.get('step')} on {stop.get('signal')}; Slurm: {state}",
                           float(stop["wall"]))
        reason = _STATE_REASON.get(state, "crash")
        return PrevEnd(reason, "sacct", f"Slurm recorded the previous attempt as {state or 'unknown'}"
                       + ("" if stop is None else " (after a stop record)"), prev_slurm.end)
    if stop is not None:
        return PrevEnd(str(stop.get("reason")), "session",
                       f"stopped at step {stop.get('step')} on {stop.get('signal')}"
                       + (f"; sacct unavailable: {sacct_error}" if in_same_job and sacct_error else ""),
                       float(stop["wall"]))
    if end is not None or not prev_records:
        return PrevEnd("none", "none", "first attempt" if not prev_records else
                       f"previous run ended {end.get('status')}", None)   # type: ignore[union-attr]
    last_wall = max(float(e["wall"]) for e in prev_records)
    why = "no stop or end record"
    if in_same_job:
        why += f"; sacct unavailable: {sacct_error}" if sacct_error else "; Slurm has no previous attempt"
    return PrevEnd("crash", "session", why, last_wall)


def last_step_seen(prev_records: Sequence[dict[str, Any]]) -> int | None:
    """The newest step the previous attempt is known to have reached (losses, checkpoints, stop)."""
    best = None
    for e in prev_records:
        ev = e.get("event")
        cand = None
        if ev == "losses" and e.get("steps"):
            cand = max(int(s) for s in e["steps"])
        elif ev in ("checkpoint", "stop", "end", "resumed", "peer_lost") and e.get("step") is not None:
            cand = int(e["step"])
        elif ev == "attempt_start" and e.get("resumed_step") is not None:
            cand = int(e["resumed_step"])
        if cand is not None and (best is None or cand > best):
            best = cand
    return best


def steps_lost(prev_records: Sequence[dict[str, Any]], resumed_step: int | None) -> int | None:
    """Steps done by the previous attempt past the checkpoint we resume from (a lower bound for a
    crash: losses are flushed every few seconds, not every step)."""
    if not prev_records:
        return None
    seen = last_step_seen(prev_records)
    if seen is None:
        return None
    return max(0, seen - (resumed_step or 0))


def stop_reason(signal_name: str, time_left_s: float | None, signal_lead_s: float | None) -> tuple[str, str]:
    """Preemption or time limit, from the time Slurm says the job has left when the signal came.

    With ``--signal=USR2@lead``, the time-limit warning comes with about ``lead`` seconds left (up to a
    minute more); preemption sends the same signal at any time, typically long before the limit.
    """
    lead = 90.0 if signal_lead_s is None else float(signal_lead_s)
    if time_left_s is None:
        return "preemption", f"{signal_name} with no time limit: not the time limit's warning"
    if time_left_s > lead + TIME_LIMIT_MARGIN_S:
        return "preemption", f"{signal_name} with {time_left_s:.0f}s left (> lead {lead:.0f}s + {TIME_LIMIT_MARGIN_S:.0f}s)"
    return "time_limit", f"{signal_name} with {time_left_s:.0f}s left (lead {lead:.0f}s)"


def give_up_reason(attempt_starts: Sequence[dict[str, Any]], resumed_step: int | None, *,
                   restart_count: int, max_requeues: int | None, no_progress_limit: int) -> str | None:
    """Why this attempt must not train (None: go on).

    ``attempt_starts``: the earlier ``attempt_start`` records, oldest first. No progress: this
    attempt and the ``no_progress_limit`` attempts before it all resumed from the same step, i.e.
    that many restarts in a row never got past the same checkpoint.
    """
    if max_requeues is not None and restart_count > max_requeues:
        return (f"the job was requeued {restart_count} times, more than --max-requeues {max_requeues}; "
                f"not training and not requeueing again")
    if no_progress_limit > 0 and len(attempt_starts) >= no_progress_limit:
        here = resumed_step or 0
        recent = attempt_starts[-no_progress_limit:]
        if all((a.get("resumed_step") or 0) == here for a in recent):
            return (f"{no_progress_limit + 1} attempts in a row started from step {here} and none got a "
                    f"newer checkpoint (no-progress limit {no_progress_limit}); the run cannot get past "
                    f"this point: see the previous attempts' errors")
    return None


def latency_split(prev_end_wall: float | None, attempt_start_wall: float | None, process_wall: float,
                  restored_wall: float, restore_s: float) -> dict[str, float | None]:
    """Restart latency: previous stop (or failure) -> first resumed step, split into Slurm's requeue
    delay (-> this attempt's start), process start (-> session created) and restore."""
    total = None if prev_end_wall is None else max(0.0, restored_wall - prev_end_wall)
    slurm = None
    if prev_end_wall is not None and attempt_start_wall is not None:
        slurm = max(0.0, attempt_start_wall - prev_end_wall)
    proc = None if attempt_start_wall is None else max(0.0, process_wall - attempt_start_wall)
    return {"total": total, "slurm_requeue_s": slurm, "process_start_s": proc, "restore_s": restore_s}
