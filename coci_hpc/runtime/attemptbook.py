"""Rank 0's bookkeeping of one attempt in the event log: what the previous attempts and Slurm's
accounting say (:func:`AttemptBook.read_history`), the ``attempt_start`` / ``resumed`` records and
the give-up verdict (:func:`AttemptBook.record_start`), and whether a newer attempt of the run has
started since (:func:`AttemptBook.newer_attempt`). The rules themselves are pure functions in
:mod:`coci_hpc.runtime.attempts`; this module gathers their inputs and writes their outcome."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from coci_hpc.errors import GaveUpError, SlurmError, UsageError
from coci_hpc.runtime import attempts as att
from coci_hpc.runtime import survivors as sv
from coci_hpc.runtime.config import SessionConfig
from coci_hpc.runtime.events import (
    AttemptStart,
    End,
    EndStatus,
    EventLog,
    PeerLost,
    PrevEndReason,
    Resumed,
    last_attempt,
    read_records,
    records,
)
from coci_hpc.runtime.progress import ProgressRecord
from coci_hpc.runtime.schedule import Schedule
from coci_hpc.slurm import commands, sacct
from coci_hpc.slurm.env import JobEnvironment
from coci_hpc.slurm.hostlist import expand_hostlist


def _say(msg: str) -> None:
    print(f"coci: {msg}", file=sys.stderr, flush=True)


class AttemptBook:
    """One attempt's records, for the Session. ``in_place``: the relaunch loop's restart number
    (None outside that loop); ``process_wall`` / ``init_wall``: when the process and the Session
    started (the restart latency's split); ``progress``: the ranks' progress records (the previous
    attempt's last finished step: steps lost and the restart latency from it)."""

    def __init__(self, log: EventLog, job: JobEnvironment, runner: commands.Runner, ckpt_dir: Path, *,
                 in_place: int | None, process_wall: float | None, init_wall: float,
                 progress: ProgressRecord | None = None) -> None:
        self.log, self.job, self._runner, self.ckpt_dir = log, job, runner, ckpt_dir
        self.progress = progress
        self.events_path = log.path
        self._in_place, self._process_wall, self._init_wall = in_place, process_wall, init_wall
        self.catalog: Any = ckpt_dir        # the manager's catalog once read_history has it

    def read_history(self, events: list[dict[str, Any]], catalog: Any) -> dict[str, Any]:
        """Rank 0, at the start: ``events`` as parsed once at ``Session()``; ``catalog``: the
        manager's step catalog (the restart's one listing of the root)."""
        self.catalog = catalog
        recs = records(events)          # typed, once: the attempt rules read these
        self.log.attempt = last_attempt(recs) + 1
        rows: list[sacct.SlurmAttempt] = []
        sacct_error = None
        jid = self.job.requeue_id
        # An in-place restart is the same Slurm attempt: sacct says nothing about the previous
        # one (the relaunch record does), and the query would sit on the restart's critical path.
        if jid is not None and not self._in_place:
            try:
                rows = sacct.job_attempts(jid, self._runner)
            except (SlurmError, OSError) as exc:
                sacct_error = str(exc)
        # A survivors' save killed before its manifest (SIGKILL at KillWait, a second failure):
        # its staging goes once this attempt is recorded, its data file at the next save (an
        # uncommitted leftover).
        recorded = {e.step for e in att.previous_records(recs) if isinstance(e, PeerLost)}
        torn = [s for s in sv.torn_steps(catalog) if s not in recorded]   # recorded: a fallback
        if torn:
            _say(f"the survivors' save of step(s) {torn} never committed (killed before its manifest); "
                 f"resuming from the latest committed checkpoint instead")
        return {"events": events, "records": recs, "rows": rows, "sacct_error": sacct_error, "torn": torn}

    def record_start(self, info: dict[str, Any], resumed: int | None, restore_s: float, *, schedule: Schedule,
                     ranks: int, run_record: Any, config: SessionConfig, survival: sv.Survival,
                     parts: Any) -> str | None:
        """Write ``attempt_start`` (and ``resumed``), feed the planner what the previous attempt
        measured; returns why to give up (``end`` written), or None. ``survival``: whether the
        survivors save, and the memory tier's interval (state held in parts is covered by it)."""
        survivors_enabled, memory_every = survival.enabled, survival.memory_every
        recs, rows = info["records"], info["rows"]
        prev = att.previous_records(recs)
        rc = self.job.restart_count
        prev_slurm = rows[-2] if rc > 0 and len(rows) >= 2 else None
        if rc > 0 and len(rows) < 2 and info["sacct_error"] is None:
            info["sacct_error"] = f"sacct lists {len(rows)} attempt(s) of job {self.job.requeue_id}"
        prev_end = att.classify_previous(prev, prev_slurm, restart_count=rc, sacct_error=info["sacct_error"])
        ended = prev_end.reason != PrevEndReason.NONE
        # The previous attempt's last finished step, from its ranks' progress records (exact, with
        # when it finished); None when none survived (a power loss, an older version): the log's.
        mark = self.progress.last_finished(self.log.attempt - 1) if ended and self.progress else None
        led = att.ledger(prev, resumed, None if mark is None else mark.step) if ended else None
        lost, last_step, exact = (led.lost, led.last_step, led.exact) if led else (None, None, False)
        if info.get("torn"):        # the torn save's step was finished by every rank (no record says so)
            lost = max(lost or 0, max(info["torn"]) - (resumed or 0))
        last_wall = mark.wall if mark is not None and mark.step == last_step else None   # when it finished
        failed_wall = max((w for w in (prev_end.end_wall, last_wall) if w), default=None)
        if prev_end.reason in (PrevEndReason.NODE_FAILURE, PrevEndReason.CRASH, PrevEndReason.RANK_FAILURE) \
                and failed_wall:
            schedule.after_failure(time.time() - failed_wall)
        # The share of failures the planner may count as ~one step lost (survivors' saves).
        covered = not parts or memory_every is not None     # state held in parts: by the memory tier
        coverage = sv.coverage_estimate(recs, survivors_enabled and covered)
        schedule.use_survivor_coverage(coverage)
        verdict = att.give_up_reason(recs, resumed, prev_end.reason, job_id=self.job.job_id, restart_count=rc,
                                     max_requeues=config.max_requeues,
                                     no_progress_limit=config.no_progress_limit,
                                     in_place_restart=self._in_place or 0)
        nodes = expand_hostlist(self.job.step_nodelist or self.job.nodelist or "") \
            if (self.job.step_nodelist or self.job.nodelist) else []
        self.log.write(AttemptStart(
            nodes=nodes, ranks=ranks, run=run_record, policy=config.policy,
            restart_count=rc, prev_end=prev_end.to_dict(), resumed_step=resumed, steps_lost=lost,
            steps_lost_exact=exact if lost is not None else None, prev_last_step=last_step,
            torn_survivors_saves=info.get("torn") or [],
            config_sources=dict(config.sources), slurm_id=self.job.requeue_id,
            survivor_coverage=coverage,
            survivors_off=None if covered else sv.parts_reason(parts),
            memory_tier_every=memory_every,
            in_place_restart=self._in_place, process_wall=self._process_wall,
            session_wall=self._init_wall))
        sv.sweep_torn(self.catalog)      # only now that attempt_start is written: see sweep_torn (the
                                         # memory tier's staging too: catalog.TierStaging)
        _say(att.describe_start(self.log.attempt, self.job.job_id, rc, nodes, ranks, prev_end.reason,
                                prev_end.detail, resumed, lost, last_step, exact))
        if not covered and survivors_enabled:
            _say(f"on a lost rank: no survivors' save, back to the last checkpoint: {sv.parts_reason(parts)}")
        if verdict is not None:
            self.log.write(End(step=resumed, status=EndStatus.GAVE_UP, message=verdict))
            _say(f"giving up: {verdict}")
            return verdict
        if resumed is not None:
            cur = rows[-1] if rows and rows[-1].state == "RUNNING" else None
            # In place, the "requeue" part is the relaunch loop's (failure -> these processes
            # exist): Slurm's row started with the allocation, long before.
            began = self._process_wall if self._in_place else (cur.start if cur else None)
            lat = att.latency_split(prev_end.end_wall, began, self._init_wall, time.time(), restore_s,
                                    last_step_wall=last_wall if ended else None)
            if self._in_place and prev_end.reason != PrevEndReason.NONE and lat["total"] is not None:
                schedule.restarted_in_place(float(lat["total"]))
            self.log.write(Resumed(step=resumed, restart_latency_s=lat))
            _say(f"resumed from step {resumed}: {att.describe_latency(lat)}")
        return None

    @staticmethod
    def give_up(verdict: str) -> GaveUpError:
        return GaveUpError(verdict, hint="fix the cause shown in the previous attempts' logs, then resubmit "
                                         "(raise --max-requeues / COCI_NO_PROGRESS_LIMIT if the restarts "
                                         "were expected)")

    def refuse_total(self, step: int, total: int) -> None:
        """``total_steps`` below the latest checkpoint's step: record the refusal, raise ``UsageError``."""
        # A refusal, not the run's end: coci-status keeps showing how the run ended.
        self.log.write(End(step=step, status=EndStatus.REFUSED, message="total_steps lower than the "
                           f"latest checkpoint's step ({total} < {step}); nothing was changed"))
        raise UsageError(f"total_steps={total} is lower than the step of the latest checkpoint in "
                         f"{self.ckpt_dir} ({step}): this run already went further, there "
                         f"is nothing to train and nothing was changed",
                         hint=f"pass total_steps >= {step} to continue that run, or a new "
                              f"checkpoint directory to start a new one")

    def newer_attempt(self) -> int | None:
        """The attempt of this run that started after this one, if any (from the event log: every
        attempt, requeued or restarted in place, writes ``attempt_start`` before its first step)."""
        try:
            newest = last_attempt(read_records(self.events_path))
        except OSError:
            return None
        return newest if newest > self.log.attempt else None
