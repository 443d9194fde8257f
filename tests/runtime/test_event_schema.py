"""The event log's schema (runtime/events.py): the typed records, the doc table generated from them,
old logs read the same, one attempt counter, and one rule for why the relaunch loop restarted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from coci_hpc import history
from coci_hpc.runtime import events, relaunch
from coci_hpc.runtime.attempts import classify_previous, previous_records

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "event-log.md"


def test_doc_table_is_the_schema() -> None:
    text = DOC.read_text()
    begin = text.index("-->\n", text.index("<!-- event-table")) + 4
    table = text[begin:text.index("\n<!-- /event-table -->")]
    assert table == events.markdown_table(), "regenerate the table with events.markdown_table()"
    for t in events.RECORD_TYPES:
        assert f"| `{t.EVENT}` |" in table


def test_write_checks_fields_against_the_record_type(tmp_path: Path) -> None:
    log = events.EventLog(tmp_path / "events.jsonl", attempt=1, job_id="5")
    with pytest.raises(ValueError, match="has no field"):
        log.write("checkpoint", step=1, knd="planned")
    with pytest.raises(ValueError, match="unknown event"):
        log.write("checkpointed", step=1)
    rec = log.write(events.Relaunch(action="relaunch", cause="crash", lost={}, nodes=["n1"]))
    [back] = events.read_events(tmp_path)
    assert back == rec and back["attempt"] == 1 and back["job_id"] == "5" and back["cause"] == "crash"
    typed = events.parse(back)
    assert isinstance(typed, events.Relaunch) and typed.nodes == ["n1"] and typed.extra == {}


# Lines exactly as the code before the schema wrote them (main 741cfd3): no `cause` in relaunch
# records, a crash's reason saying "lost a task", a field the schema does not declare.
OLD_LOG = [
    {"v": 1, "event": "attempt_start", "wall": 100.0, "attempt": 1, "job_id": "7", "nodes": ["n1", "n2"],
     "ranks": 2, "prev_end": {"reason": "none", "source": "none", "detail": "first attempt"},
     "resumed_step": None, "steps_lost": None, "some_old_field": 3},
    {"v": 1, "event": "checkpoint", "wall": 110.0, "attempt": 1, "job_id": "7", "step": 10, "kind": "planned",
     "blocking_s": 0.1, "persist_s": None},
    {"v": 1, "event": "relaunch", "wall": 120.0, "attempt": 1, "job_id": "7", "restart": 1, "rc": 1,
     "action": "relaunch", "reason": "the ranks exited with status 1 (no node down); restart 1 of 3 in place "
     "on n1,n3 (not n2: lost a task)", "lost": {}, "nodes": ["n1", "n3"], "step_ended_wall": 119.0,
     "decided_wall": 119.5, "lost_task_on": ["n2"]},
    {"v": 1, "event": "attempt_start", "wall": 125.0, "attempt": 2, "job_id": "7", "nodes": ["n1", "n3"],
     "ranks": 2, "prev_end": {"reason": "crash", "source": "relaunch", "detail": "..."}, "resumed_step": 10,
     "steps_lost": 0, "in_place_restart": 1},
    {"v": 1, "event": "relaunch", "wall": 140.0, "attempt": 2, "job_id": "7", "restart": 2, "rc": 1,
     "action": "relaunch", "reason": "node(s) n3 (down*) lost; restart 2 of 3 in place on n1,n4",
     "lost": {"n3": "down*"}, "nodes": ["n1", "n4"], "step_ended_wall": 139.0, "decided_wall": 139.5,
     "lost_task_on": ["n3"]},
]


def _write_lines(path: Path, recs: list[dict], torn_at: int | None = None) -> None:
    lines = [json.dumps(r) for r in recs]
    if torn_at is not None:
        lines[torn_at] = lines[torn_at][:-15]          # the writer died inside this record
    path.write_text("\n".join(lines) + "\n")


def test_an_old_log_reads_the_same(tmp_path: Path) -> None:
    _write_lines(tmp_path / "events.jsonl", OLD_LOG)
    recs = events.read_events(tmp_path)
    assert recs == OLD_LOG
    typed = [events.parse(r) for r in recs]
    assert [type(t).__name__ for t in typed] == ["AttemptStart", "Checkpoint", "Relaunch", "AttemptStart", "Relaunch"]
    assert typed[0].extra == {"some_old_field": 3}                                # type: ignore[union-attr]
    assert isinstance(typed[2], events.Relaunch) and typed[2].cause is None and typed[2].lost == {}
    # The crash whose prose says "lost a task" is a crash, the node loss a node failure, for both readers.
    assert [events.relaunch_cause(r) for r in events.read_records(tmp_path) if isinstance(r, events.Relaunch)] \
        == ["crash", "node_failure"]
    h = history.build(recs, str(tmp_path))
    assert [a.ended for a in h.attempts] == ["crash (restarted in place)", "running"]
    prev = classify_previous(previous_records(recs), None, restart_count=0)
    assert (prev.reason, prev.source) == ("node_failure", "relaunch")


def test_the_relaunch_decision_writes_a_typed_cause() -> None:
    base = dict(rc=1, signaled=False, held=["n1", "n2", "n3"], needed=2, restarts_done=0, max_restarts=3)
    assert relaunch.decide(unhealthy={}, suspect={"n2"}, **base).cause == "crash"   # type: ignore[arg-type]
    assert relaunch.decide(unhealthy={"n2": "down*"}, **base).cause == "node_failure"  # type: ignore[arg-type]
    assert relaunch.decide(unhealthy={}, **{**base, "rc": 0}).cause is None          # type: ignore[arg-type]


def test_a_torn_attempt_start_does_not_shift_the_relaunch_record(tmp_path: Path) -> None:
    """Attempt 2's attempt_start is torn but its checkpoint record is whole. The Session numbers
    attempts by the newest number in the log; the relaunch loop used to count attempt_start lines
    and filed its record of attempt 2's failure under attempt 1, so coci-status called attempt 1 a
    node failure while attempt 3's prev_end (which did not see the record) said crash."""
    log = [OLD_LOG[0], OLD_LOG[1],
           {**OLD_LOG[3], "wall": 125.0},
           {"v": 1, "event": "checkpoint", "wall": 130.0, "attempt": 2, "job_id": "7", "step": 20,
            "kind": "planned", "blocking_s": 0.1, "persist_s": None}]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _write_lines(ckpt / events.FILENAME, log, torn_at=2)
    relaunch._record(ckpt, "7", events.Relaunch(action="relaunch", cause="node_failure", lost={"n3": "down*"},
                                                 nodes=["n1", "n4"], reason="node(s) n3 (down*) lost", restart=2))
    recs = events.read_events(ckpt)
    assert recs[-1]["event"] == "relaunch" and recs[-1]["attempt"] == 2 == events.current_attempt(events.records(recs))
    prev = classify_previous(previous_records(recs), None, restart_count=0)
    assert (prev.reason, prev.source) == ("node_failure", "relaunch")
    h = history.build(recs, str(ckpt))
    # attempt 2's start is torn: history knows attempts 1 only; the relaunch is not pinned on it.
    assert [a.ended for a in h.attempts] == ["running"]


def test_the_readers_get_typed_records_and_an_old_log_reads_the_same_through_them(tmp_path: Path) -> None:
    """history and the attempt rules read the log as typed records (read_records); the dicts of
    read_events stay the raw view, and both give the same history and the same previous end."""
    _write_lines(tmp_path / "events.jsonl", OLD_LOG + [{"v": 1, "event": "some_future_event", "wall": 150.0,
                                                         "attempt": 2, "job_id": "7"}])
    typed = events.read_records(tmp_path)
    assert all(isinstance(r, events.Record) for r in typed)
    assert [r.EVENT for r in typed] == [r["event"] for r in OLD_LOG]     # the unknown event is left out
    assert typed == events.records(events.read_events(tmp_path)) == events.records(typed)
    assert events.read_records_counted(tmp_path)[1] == 0
    assert history.build(typed, "ck").to_dict() == history.build(OLD_LOG, "ck").to_dict()
    assert classify_previous(previous_records(typed), None, restart_count=0) == \
        classify_previous(previous_records(OLD_LOG), None, restart_count=0)
    assert events.current_attempt(typed) == 2 and events.session_gave_up(typed) is None


READERS = ["coci_hpc/history.py", "coci_hpc/runtime/attempts.py"]


@pytest.mark.parametrize("module", READERS)
def test_the_readers_do_not_read_raw_dicts(module: str) -> None:
    """No ``e["event"]`` / ``e.get("event")`` and no dict reader: what a record is comes from its
    type, so a renamed or retyped field fails in mypy, not in coci-status."""
    import ast
    tree = ast.parse((DOC.parents[2] / module).read_text())
    raw = [n.lineno for n in ast.walk(tree)
           if (isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "event")
           or (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args
               and isinstance(n.args[0], ast.Constant) and n.args[0].value == "event")]
    dict_readers = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
                    if a.name in ("read_events", "read_events_counted")]
    assert raw == [] and dict_readers == [], f"{module}: raw reads at lines {raw}, imports {dict_readers}"


def test_the_package_writes_typed_records_only() -> None:
    """Every writer in coci_hpc/ builds its record (``log.write(events.Checkpoint(...))``), so mypy
    checks each field and value; ``write("checkpoint", **fields)`` is left to tests and tools."""
    import ast
    pkg = DOC.parents[2] / "coci_hpc"
    by_name = []
    for path in sorted(pkg.rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "write" \
                    and n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str) \
                    and n.args[0].value in events.BY_EVENT:
                by_name.append(f"{path.relative_to(pkg.parent)}:{n.lineno}")
    assert by_name == [], f"records written by name: {by_name}"


def test_values_are_enums_that_write_the_same_bytes_and_read_back_typed(tmp_path: Path) -> None:
    """An enum value is written as the plain string older code wrote (byte for byte), reads back as
    the enum, and a value this version does not know reads back as the string it was."""
    log = events.EventLog(tmp_path / "events.jsonl", attempt=1, job_id=None)
    log.write(events.Checkpoint(step=3, kind=events.CheckpointKind.STOP, blocking_s=0.5, persist_s=None))
    line = json.loads((tmp_path / "events.jsonl").read_text())
    assert '"kind":"stop"' in (tmp_path / "events.jsonl").read_text() and type(line["kind"]) is str
    [rec] = events.read_records(tmp_path)
    assert isinstance(rec, events.Checkpoint) and rec.kind is events.CheckpointKind.STOP
    future = events.parse({"v": 1, "event": "end", "wall": 1.0, "attempt": 1, "job_id": None, "step": 1,
                           "status": "paused", "message": ""})
    assert isinstance(future, events.End) and future.status == "paused" \
        and not isinstance(future.status, events.EndStatus)
    # A log written before the `refused` status: the refusal was an error whose message said so;
    # read, it is typed refused (the one place a message is looked at).
    old = events.parse({"v": 1, "event": "end", "wall": 1.0, "attempt": 2, "job_id": None, "step": 5,
                        "status": "error", "message": "UsageError: ... nothing was changed"})
    assert isinstance(old, events.End) and old.status is events.EndStatus.REFUSED
    other = events.parse({"v": 1, "event": "end", "wall": 1.0, "attempt": 2, "job_id": None, "step": 5,
                          "status": "error", "message": "RuntimeError: boom"})
    assert isinstance(other, events.End) and other.status is events.EndStatus.ERROR
