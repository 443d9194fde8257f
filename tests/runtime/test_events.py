"""The event log: one whole JSON record per line, a torn last line skipped and never glued to the next."""
from __future__ import annotations

import json
import math
from pathlib import Path

from coci_hpc.runtime.events import EventLog, last_attempt, read_events, records


def test_records_carry_the_common_fields(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    log = EventLog(p, attempt=2, job_id="77")
    log.write("checkpoint", step=10, kind="planned", blocking_s=0.1, persist_s=math.nan)
    EventLog(p, attempt=2, job_id="77", enabled=False).write("end", step=1, status="completed", message="")
    [rec] = read_events(p)
    assert {k: rec[k] for k in ("v", "event", "attempt", "job_id", "step")} == \
        {"v": 1, "event": "checkpoint", "attempt": 2, "job_id": "77", "step": 10}
    assert rec["persist_s"] is None and rec["wall"] > 0     # NaN is not JSON: written as null
    assert read_events(tmp_path) == [rec] and read_events(tmp_path / "nope.jsonl") == []
    assert last_attempt(records([rec])) == 2


def test_torn_last_line_is_skipped_and_the_next_writer_starts_a_fresh_line(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    EventLog(p, attempt=1, job_id=None).write("stop", step=5, reason="preemption", signal="SIGUSR2",
                                              requeued=True, detail="")
    whole = p.read_text()
    torn = json.dumps({"v": 1, "event": "losses", "steps": [6, 7]})[:-9]
    p.write_text(whole + torn)                    # the writer died inside its write
    assert [e["event"] for e in read_events(p)] == ["stop"]
    EventLog(p, attempt=2, job_id=None).write("attempt_start", nodes=[], ranks=1)
    events = read_events(p)
    assert [e["event"] for e in events] == ["stop", "attempt_start"]
    assert p.read_text().count("\n") == 3         # stop, torn, new record: each on its own line


def test_whole_job_ends_are_attempts_that_left_no_trace(tmp_path: Path) -> None:
    """Attempts a later one followed: a stop is announced, a peer_lost or a relaunch after a lost
    node had a survivor, nothing at all (or a relaunch after a crash) ended the whole job; the
    newest attempt may still run."""
    from coci_hpc.runtime.events import read_records, whole_job_ends
    p = tmp_path / "events.jsonl"

    def att(n: int, *recs: tuple) -> None:
        log = EventLog(p, attempt=n, job_id="9")
        log.write("attempt_start", nodes=["n1", "n2"], ranks=2)
        for name, fields in recs:
            log.write(name, **fields)

    att(1, ("checkpoint", {"step": 10, "kind": "planned"}))                     # crashed whole
    att(2, ("stop", {"step": 20, "reason": "preemption"}))                      # announced
    att(3, ("peer_lost", {"step": 30, "tier": "memory", "committed": True}))    # a survivor saved
    att(4, ("relaunch", {"action": "relaunch", "cause": "node_failure"}))       # in place after a lost node
    att(5, ("relaunch", {"action": "relaunch", "cause": "crash"}))              # the rank step crashed
    att(6)                                                                      # crashed whole
    att(7)                                                                      # the newest: still running
    assert whole_job_ends(read_records(p)) == (3, 2)
