"""Pure attempt logic: how the previous attempt ended, the stop reason at the signal, giving up."""
from __future__ import annotations

from pathlib import Path

import pytest

from coci_hpc.runtime import attempts as att
from coci_hpc.slurm import scontrol
from coci_hpc.slurm.sacct import SlurmAttempt
from coci_hpc.slurm.scontrol import JobState

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "slurm"

def _stop(attempt: int, reason: str = "preemption") -> dict:
    return {"event": "stop", "attempt": attempt, "wall": 100.0, "step": 30, "reason": reason, "signal": "SIGUSR2"}


@pytest.mark.parametrize("records,state,expected", [
    ([_stop(1)], "REQUEUED", ("preemption", "session")),               # our own stop, then our requeue
    ([_stop(1, "time_limit")], "REQUEUED", ("time_limit", "session")),
    ([{"event": "attempt_start", "attempt": 1, "wall": 1.0}], "REQUEUED", ("requeue_by_hand", "sacct")),
    ([{"event": "attempt_start", "attempt": 1, "wall": 1.0}], "NODE_FAIL", ("node_failure", "sacct")),
    ([], "PREEMPTED", ("preemption", "sacct")),                          # killed before the session ran
    ([], "TIMEOUT", ("time_limit", "sacct")),
    ([{"event": "attempt_start", "attempt": 1, "wall": 1.0}], "FAILED", ("crash", "sacct")),
    ([], "CANCELLED", ("crash", "sacct")),
    ([], "", ("crash", "sacct")),
    ([_stop(1)], "NODE_FAIL", ("node_failure", "sacct")),               # the node died during the stop
])
def test_previous_attempt_in_the_same_job(records: list, state: str, expected: tuple) -> None:
    prev = SlurmAttempt(state, 0.0, 50.0, "n1")
    got = att.classify_previous(records, prev, restart_count=1)
    assert (got.reason, got.source) == expected
    assert got.end_wall == (100.0 if got.source == "session" else 50.0)


def test_previous_attempt_without_slurm() -> None:
    assert att.classify_previous([], None, restart_count=0).reason == "none"
    done = [{"event": "end", "attempt": 1, "wall": 5.0, "status": "completed"}]
    assert att.classify_previous(done, None, restart_count=0).reason == "none"
    killed = [{"event": "attempt_start", "attempt": 3, "wall": 5.0}, {"event": "losses", "attempt": 3, "wall": 9.0}]
    got = att.classify_previous(killed, None, restart_count=0)
    assert (got.reason, got.source, got.end_wall) == ("crash", "session", 9.0)
    # sacct down in a requeued job: our own stop record still classifies it, and says sacct failed
    got = att.classify_previous([_stop(2)], None, restart_count=2, sacct_error="sacct: timeout")
    assert (got.reason, got.source) == ("preemption", "session") and "sacct: timeout" in got.detail


def test_previous_records_and_steps_lost() -> None:
    events = [{"event": "attempt_start", "attempt": 1, "wall": 1, "resumed_step": None},
              {"event": "attempt_start", "attempt": 2, "wall": 2, "resumed_step": 50},
              {"event": "checkpoint", "attempt": 2, "wall": 3, "step": 100},
              {"event": "losses", "attempt": 2, "wall": 4, "steps": [101, 102, 117]}]
    prev = att.previous_records(events)
    assert [e.wall for e in prev] == [2, 3, 4]                    # typed records (runtime/events.py)
    assert att.steps_lost(prev, 100) == 17 and att.steps_lost([], 100) is None


def _job(state: str = "RUNNING", *, preempt: float | None = None, end: float | None = 1000.0,
         restarts: int = 0) -> JobState:
    return JobState(state=state, reason="None", restarts=restarts, preempt_time=preempt, end_time=end,
                    partition="gpu")


@pytest.mark.parametrize("left,lead,reason", [
    (None, 90, "preemption"),          # no time limit
    (595, 90, "preemption"),           # a signal by hand a few seconds after the start of a 10-minute job
    (160, 30, "preemption"),           # early in a 3-minute job with a 30 s lead
    (85, 90, "time_limit"),
    (30, 30, "time_limit"),
    (90, 30, "time_limit"),            # the warning may come up to a minute early
])
def test_usr_signal_without_preempt_time_reads_the_time_left(left, lead, reason) -> None:
    job = _job(end=None if left is None else 1000.0 + left)
    plan = att.stop_reason("SIGUSR2", job, now_wall=1000.0, signal_wall=999.0, restart_count=0,
                           in_slurm_job=True, signal_lead_s=lead)
    assert plan.reason == reason and plan.requeue


def test_one_stop_rule_from_slurms_record_for_every_signal() -> None:
    kw = dict(now_wall=1000.0, signal_wall=998.0, restart_count=0, in_slurm_job=True, signal_lead_s=90)
    # Preempted, with or without preempt_send_user_signal: PreemptTime decides, even 60 s before the limit.
    for sig in ("SIGTERM", "SIGUSR2"):
        plan = att.stop_reason(sig, _job("SIGNALING", preempt=995.0, end=1050.0), grace_time_s=20, kill_wait_s=5, **kw)
        assert (plan.reason, plan.requeue, plan.deadline_wall) == ("preemption", True, 1015.0)
    # scancel: COMPLETING, PreemptTime=None -> save within KillWait, never requeue
    plan = att.stop_reason("SIGTERM", _job("COMPLETING"), kill_wait_s=5, **kw)
    assert (plan.reason, plan.requeue, plan.deadline_wall) == ("cancelled", False, 1003.0)
    # scontrol requeue by hand: Slurm's Restarts is already past this attempt's
    plan = att.stop_reason("SIGTERM", _job("COMPLETING", restarts=1), kill_wait_s=5, **kw)
    assert (plan.reason, plan.requeue) == ("requeue_by_hand", False)
    plan = att.stop_reason("SIGTERM", _job("NODE_FAIL", restarts=1), kill_wait_s=5, **kw)
    assert (plan.reason, plan.requeue) == ("node_failure", False)          # Slurm requeues it itself
    # Slurm's record unreadable: SIGTERM is never requeued, USR still is; outside Slurm nothing is
    assert att.stop_reason("SIGTERM", None, kill_wait_s=30, **kw).requeue is False
    assert att.stop_reason("SIGUSR2", None, **kw).requeue is True
    assert att.stop_reason("SIGTERM", None, **{**kw, "in_slurm_job": False}).reason == "terminated"


def test_a_save_is_tried_when_it_fits_before_the_kill() -> None:
    pre = att.StopPlan("preemption", "", True, 1020.0)
    assert pre.save_fits(1000.0, 16.0)                       # 16 s save + 3 s requeue < 20 s left
    assert not pre.save_fits(1000.0, 18.0)
    assert pre.save_fits(1000.0, None)                       # never measured: try (an interrupted save never commits)
    assert att.StopPlan("cancelled", "", False, 1005.0).save_fits(1000.0, 4.5)   # no requeue to leave time for
    assert att.StopPlan("cancelled", "", False, None).save_fits(1000.0, 1e6)


def test_stop_plans_from_recorded_scontrol_output() -> None:
    kw = dict(signal_wall=0.0, restart_count=0, in_slurm_job=True, signal_lead_s=60, kill_wait_s=5)
    pre = scontrol.parse_job((FIX / "scontrol_show_job_preempted.txt").read_text())
    plan = att.stop_reason("SIGTERM", pre, now_wall=pre.preempt_time + 1, grace_time_s=20, **kw)
    assert plan.reason == "preemption" and plan.requeue and plan.deadline_wall == pre.end_time  # PreemptTime + GraceTime
    can = scontrol.parse_job((FIX / "scontrol_show_job_cancelled.txt").read_text())
    assert att.stop_reason("SIGTERM", can, now_wall=0.0, **kw).reason == "cancelled"
    req = scontrol.parse_job((FIX / "scontrol_show_job_requeued_by_hand.txt").read_text())
    assert att.stop_reason("SIGTERM", req, now_wall=0.0, **kw).reason == "requeue_by_hand"


def _start(job: str | None, rc: int, resumed: int | None, prev: str = "crash") -> dict:
    return {"event": "attempt_start", "job_id": job, "restart_count": rc, "resumed_step": resumed,
            "prev_end": {"reason": prev}}


def test_no_progress_counts_restarts_of_this_job_only() -> None:
    kw = dict(job_id="7", max_requeues=None, no_progress_limit=2)
    starts = [_start("7", 0, None), _start("7", 1, 40), _start("7", 2, 40)]
    assert "no-progress" in att.give_up_reason(starts, 40, "crash", restart_count=3, **kw)
    assert att.give_up_reason(starts, 80, "crash", restart_count=3, **kw) is None          # progress was made
    assert att.give_up_reason(starts[:2], 40, "crash", restart_count=2, **kw) is None      # only once before
    assert att.give_up_reason(starts, 40, "crash", restart_count=3, **{**kw, "no_progress_limit": 0}) is None
    # Runs by hand and earlier jobs on the same directory never brick it (the old rule counted them all)
    by_hand = [_start(None, 0, 40) for _ in range(5)]
    assert att.give_up_reason(by_hand, 40, "crash", restart_count=0, **{**kw, "job_id": None}) is None
    other_jobs = [_start(j, 1, 40) for j in ("3", "4", "5")]
    assert att.give_up_reason(other_jobs + [_start("7", 0, 40)], 40, "crash", restart_count=1, **kw) is None
    # A restart count of 0 (a new submission) and a gave_up end start afresh
    assert att.give_up_reason(starts, 40, "crash", restart_count=0, **kw) is None
    gave_up = {"event": "end", "status": "gave_up"}
    assert att.give_up_reason(starts + [gave_up, _start("7", 3, 40)], 40, "crash", restart_count=4, **kw) is None


def test_max_requeues_counts_only_unannounced_ends() -> None:
    kw = dict(job_id="7", no_progress_limit=0, max_requeues=2)
    # 40 time-limit continuations and preemptions of a long run: never counted
    healthy = [_start("7", 0, None, "none")] + [_start("7", i, 10 * i, "time_limit" if i % 2 else "preemption")
                                                for i in range(1, 41)]
    assert att.give_up_reason(healthy, 410, "time_limit", restart_count=41, **kw) is None
    crashes = healthy + [_start("7", 41, 410, "node_failure"), _start("7", 42, 420, "crash")]
    assert att.give_up_reason(crashes, 430, "time_limit", restart_count=43, **kw) is None   # 2 <= 2
    msg = att.give_up_reason(crashes, 430, "requeue_by_hand", restart_count=43, **kw)
    assert msg and "requeued 3 times after unannounced ends" in msg and "--max-requeues 2" in msg


def test_lead_check_compares_the_lead_with_step_save_and_requeue() -> None:
    assert att.lead_check(90, None, None) == att.LeadVerdict(False, None)        # nothing measured yet
    assert att.lead_check(90, 1.0, 5.0) == att.LeadVerdict(False, None)          # pipelined stop fits
    v = att.lead_check(90, 45.0, 5.0)                                            # 2 steps do not fit, 1 does
    assert v.stop_at_boundary and v.warning is None
    v = att.lead_check(90, 60.0, 40.0)                 # the 60 s steps: 60 + 40 + 3 > 90
    assert v.stop_at_boundary and v.warning and "--signal=USR2@200" in v.warning
    assert att.suggested_lead_s(60.0, 40.0) == 200


def test_latency_split() -> None:
    lat = att.latency_split(100.0, 119.0, 123.5, 125.0, 0.75)
    assert lat == {"total": 25.0, "after_last_step_s": None, "slurm_requeue_s": 19.0, "process_start_s": 4.5,
                   "restore_s": 0.75}
    assert att.latency_split(None, None, 1.0, 2.0, 0.1)["total"] is None


def test_latency_runs_from_the_last_finished_step() -> None:
    # A stop saved for 3 s after its last step (97): the latency counts that save.
    lat = att.latency_split(100.0, 119.0, 123.5, 125.0, 0.75, last_step_wall=97.0)
    assert (lat["total"], lat["after_last_step_s"], lat["slurm_requeue_s"]) == (28.0, 3.0, 19.0)
    # A crash whose newest record (96, a losses flush) lags its last step (99.5): it ended at that step.
    lat = att.latency_split(96.0, None, 110.0, 112.0, 0.5, last_step_wall=99.5)
    assert (lat["total"], lat["after_last_step_s"], lat["slurm_requeue_s"]) == (12.5, 0.0, None)
    assert att.describe_latency(lat) == ("restart latency 12.5 s from the last finished step "
                                         "(end 0.0 s + restore 0.5 s)")


def test_steps_lost_is_exact_with_the_last_finished_step() -> None:
    """The issue's case: killed after step 63, checkpoint 50, losses flushed up to step 52."""
    prev = [{"event": "attempt_start", "attempt": 1, "wall": 1, "resumed_step": None},
            {"event": "checkpoint", "attempt": 1, "wall": 3, "step": 50},
            {"event": "losses", "attempt": 1, "wall": 4, "steps": [49, 50, 51, 52]}]
    assert att.steps_lost(prev, 50) == 2                      # the event log alone: a lower bound
    assert att.steps_lost(prev, 50, last_finished=63) == 13   # the progress records
    assert att.steps_lost(prev, 50, last_finished=40) == 2    # a stale record never lowers the log's count
    assert att.steps_lost([], 50, last_finished=63) is None   # no previous attempt
    assert att.ledger(prev, 50, 63) == att.Ledger(13, 63, True)
    assert att.ledger(prev, 50, None) == att.Ledger(2, 52, False)     # no record survived: a lower bound
    assert att.ledger(prev, 50, 51) == att.Ledger(2, 52, False)       # an older one did (a power loss)
    stopped = [*prev, {"event": "stop", "attempt": 1, "wall": 5, "step": 52, "reason": "preemption"}]
    assert att.ledger(stopped, 52, None) == att.Ledger(0, 52, True)   # a stop's step is exact by itself
    line = att.describe_start(2, None, 0, [], 1, "crash", "no stop or end record", 50, 13, 63)
    assert line.endswith("; 13 step(s) to repeat (the previous attempt finished step 63)")
    low = att.describe_start(2, None, 0, [], 1, "crash", "no stop or end record", 50, 2, 52, exact=False)
    assert "at least 2 step(s) to repeat" in low and "progress record is lost" in low


def _in_place(job: str, rc: int, k: int, resumed: int | None, prev: str = "crash") -> dict:
    return {**_start(job, rc, resumed, prev), "in_place_restart": k}


def test_no_progress_counts_in_place_restarts_and_requeues_together() -> None:
    """coci-submit --spare-nodes restarts the ranks inside the allocation: Slurm's restart count
    stays 0, so a guard that looked at it alone never saw them (only --max-restarts bounded them)."""
    kw = dict(job_id="7", max_requeues=None, no_progress_limit=2)
    # First Slurm attempt: launch, then in-place restarts 1 and 2 that both resumed from step 40.
    starts = [_in_place("7", 0, 0, None), _in_place("7", 0, 1, 40), _in_place("7", 0, 2, 40)]
    msg = att.give_up_reason(starts, 40, "crash", restart_count=0, in_place_restart=3, **kw)
    assert msg and "no-progress limit 2" in msg and "from step 40" in msg
    assert att.give_up_reason(starts, 50, "crash", restart_count=0, in_place_restart=3, **kw) is None
    assert att.give_up_reason(starts[:2], 40, "crash", restart_count=0, in_place_restart=2, **kw) is None
    # Mixed: a requeue (Slurm restart 1), then an in-place restart, all from step 40.
    mixed = [_in_place("7", 0, 0, None), _in_place("7", 0, 1, 40), _in_place("7", 1, 0, 40, "requeue_by_hand")]
    assert att.give_up_reason(mixed, 40, "crash", restart_count=1, in_place_restart=1, **kw)
    # The relaunch loop's first launch (in_place_restart 0) of a new submission starts afresh.
    assert att.give_up_reason(starts, 40, "none", restart_count=0, in_place_restart=0, **kw) is None


def test_in_place_restarts_are_not_requeues() -> None:
    kw = dict(job_id="7", no_progress_limit=0, max_requeues=1)
    starts = [_in_place("7", 0, 0, None)] + [_in_place("7", 0, k, 10 * k, "node_failure") for k in (1, 2, 3)]
    assert att.give_up_reason(starts, 40, "node_failure", restart_count=0, in_place_restart=4, **kw) is None
    requeued = starts + [_in_place("7", 1, 0, 40, "node_failure")]
    assert att.give_up_reason(requeued, 40, "node_failure", restart_count=1, in_place_restart=1, **kw) is None
    assert "requeued 2 times" in att.give_up_reason(requeued, 40, "node_failure", restart_count=1, **kw)


def test_previous_attempt_restarted_in_place_is_the_relaunch_loops_record() -> None:
    relaunch = {"event": "relaunch", "attempt": 2, "wall": 60.0, "action": "relaunch", "step_ended_wall": 57.0,
                "reason": "node(s) n2 (down) lost; restart 1 of 3 in place on n1,n3", "lost": {"n2": "down"}}
    lost = {"event": "peer_lost", "attempt": 2, "wall": 56.0, "failure_wall": 51.0, "step": 80, "lost_ranks": [1]}
    # In the second Slurm attempt: sacct's previous row is the requeue before, not this failure.
    got = att.classify_previous([lost, relaunch], SlurmAttempt("REQUEUED", 0.0, 10.0, "n1"), restart_count=1)
    assert (got.reason, got.source, got.end_wall) == ("node_failure", "relaunch", 51.0)
    assert "n2 (down) lost" in got.detail and "rank(s) [1] lost after step 80" in got.detail
    # A rank and its partner both lost: nothing came from a partner's copy, the lost ranks are known.
    both = {**lost, "lost_ranks": [], "lost": [1, 3], "committed": False, "reason": "no memory-tier copy"}
    got = att.classify_previous([both], SlurmAttempt("NODE_FAIL", 0.0, 58.0, "n1"), restart_count=1)
    assert "rank(s) [1, 3] lost after step 80" in got.detail and "?" not in got.detail, got.detail
    crash = {**relaunch, "lost": {}, "reason": "the ranks exited with status 137 (no node down)"}
    got = att.classify_previous([crash], None, restart_count=0)
    assert (got.reason, got.end_wall) == ("crash", 57.0)
    # The loop went back to the queue (too few healthy nodes): sacct says REQUEUED, the loop says why.
    requeue = {**relaunch, "action": "requeue", "reason": "node(s) n3 (down) lost; 1 healthy node(s) left"}
    got = att.classify_previous([lost, requeue], SlurmAttempt("REQUEUED", 0.0, 58.0, "n1"), restart_count=1)
    assert (got.reason, got.source, got.end_wall) == ("node_failure", "relaunch", 51.0)


# -- issue 26, item 11: the log lines say what is known, readably ----------------------------------
def test_start_and_latency_lines_leave_unknowns_out_and_round_seconds() -> None:
    first = att.describe_start(1, None, 0, [], 1, "none", "first attempt", None, None)
    assert first == "attempt 1 on this host, 1 rank(s); starting from step 0"
    again = att.describe_start(2, "4711", 1, ["n1", "n2"], 2, "preemption", "stopped at step 120", 120, 3)
    assert again == ("attempt 2 (job 4711, restart 1) on n1,n2, 2 rank(s); previous attempt ended: preemption "
                     "(stopped at step 120); resuming from step 120; 3 step(s) to repeat")
    for line in (first, again):
        assert "None" not in line
    lat = {"total": 37.26912, "slurm_requeue_s": 30.1234, "process_start_s": 5.2, "restore_s": 1.94}
    assert att.describe_latency(lat) == "restart latency 37.3 s (requeue 30.1 s + start 5.2 s + restore 1.9 s)"
    unknown = att.describe_latency({"total": None, "slurm_requeue_s": None, "process_start_s": None,
                                    "restore_s": 0.512})
    assert unknown == "restart latency unknown (no record of the previous end): restore 0.5 s"
    assert "{" not in unknown and "None" not in unknown
