"""Pure attempt logic: how the previous attempt ended, the stop reason at the signal, giving up."""
from __future__ import annotations

import pytest

from coci_hpc.runtime import attempts as att

JOB = "41"
SACCT = """41|PREEMPTED|2026-11-22T10:00:00|2026-11-22T10:00:09|n[1-2]
41|NODE_FAIL|2026-11-22T10:00:30|2026-11-22T10:01:00|n[1-2]
41|CANCELLED by 0|2026-11-22T10:01:40|2026-11-22T10:01:50|n1
41|RUNNING|2026-11-22T10:02:10|Unknown|n[1-2]
41.batch|RUNNING|2026-11-22T10:02:10|Unknown|n1
"""


def _stop(attempt: int, reason: str = "preemption") -> dict:
    return {"event": "stop", "attempt": attempt, "wall": 100.0, "step": 30, "reason": reason, "signal": "SIGUSR2"}


def test_parse_job_attempts_keeps_the_job_rows_in_order() -> None:
    rows = att.parse_job_attempts(SACCT, JOB)
    assert [r.state for r in rows] == ["PREEMPTED", "NODE_FAIL", "CANCELLED", "RUNNING"]
    assert rows[1].end is not None and rows[3].end is None
    assert att.sacct_job_argv("7_1")[-2:] == ["7_1", "--format=JobID,State,Start,End,NodeList"]


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
    prev = att.SlurmAttempt(state, 0.0, 50.0, "n1")
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
    assert [e["wall"] for e in prev] == [2, 3, 4]
    assert att.steps_lost(prev, 100) == 17 and att.steps_lost([], 100) is None


@pytest.mark.parametrize("left,lead,reason", [
    (None, 90, "preemption"),          # no time limit
    (595, 90, "preemption"),           # a preemption a few seconds after the start of a 10-minute job
    (160, 30, "preemption"),           # early in a 3-minute job with a 30 s lead
    (85, 90, "time_limit"),
    (30, 30, "time_limit"),
    (90, 30, "time_limit"),            # the warning may come up to a minute early
])
def test_stop_reason_from_the_time_slurm_says_is_left(left, lead, reason) -> None:
    assert att.stop_reason("SIGUSR2", left, lead)[0] == reason


def test_give_up_reasons() -> None:
    starts = [{"resumed_step": None}, {"resumed_step": 40}, {"resumed_step": 40}]
    kw = dict(max_requeues=None, no_progress_limit=2)
    assert "no-progress" in att.give_up_reason(starts, 40, restart_count=3, **kw)
    assert att.give_up_reason(starts, 80, restart_count=3, **kw) is None          # progress was made
    assert att.give_up_reason(starts[:2], 40, restart_count=2, **kw) is None      # only once before
    assert att.give_up_reason(starts, 40, restart_count=3, max_requeues=None, no_progress_limit=0) is None
    msg = att.give_up_reason([], None, restart_count=3, max_requeues=2, no_progress_limit=3)
    assert msg and "--max-requeues 2" in msg
    assert att.give_up_reason([], None, restart_count=2, max_requeues=2, no_progress_limit=3) is None


def test_latency_split() -> None:
    lat = att.latency_split(100.0, 119.0, 123.5, 125.0, 0.75)
    assert lat == {"total": 25.0, "slurm_requeue_s": 19.0, "process_start_s": 4.5, "restore_s": 0.75}
    assert att.latency_split(None, None, 1.0, 2.0, 0.1)["total"] is None
