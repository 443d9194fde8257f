"""sacct / sacctmgr adapters on hand-made edge cases and on captured real output."""
import os
import time
from datetime import datetime

import pytest

from coci_hpc.errors import InputFormatError, SlurmError
from coci_hpc.slurm import accounting as acct

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "slurm")


def fx(name):
    return os.path.join(FIX, name)


def ts(s):
    return time.mktime(datetime.strptime(s, "%Y-%m-%dT%H:%M:%S").timetuple())


@pytest.mark.parametrize("expr,want", [
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("n7", ["n7"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("a[1-2]-b[1-2]", ["a1-b1", "a1-b2", "a2-b1", "a2-b2"]),
    ("login1,n[2-3]", ["login1", "n2", "n3"]),
    ("None assigned", []),
    ("", []),
])
def test_expand_hostlist(expr, want):
    assert acct.expand_hostlist(expr) == want


@pytest.mark.parametrize("bad", ["n[1-3", "n1-3]", "n[a-b]", "n[5-1]"])
def test_expand_hostlist_rejects(bad):
    with pytest.raises(ValueError):
        acct.expand_hostlist(bad)


def test_sacct_edge_cases():
    h = acct.read_file(fx("sacct_edge.txt"), "sacct")
    assert h.n_records == 6
    fails = [(e.job_id, e.nodes, e.time_s) for e in h.events]
    assert fails == [("102", ("n1", "n2", "n3"), ts("2026-11-20T13:00:00")),
                     ("105", ("gpu01-ib1", "gpu01-ib2", "gpu02-ib1", "gpu02-ib2"),
                      ts("2026-11-21T06:00:00"))]
    # exposure: 2*2h + 3*1h + 2*0.5h + 1*0.5h + 4*6h (pending job adds nothing)
    assert h.job_node_seconds == pytest.approx((4 + 3 + 1 + 0.5 + 24) * 3600)
    assert {"n5", "n4"} <= h.nodes_seen


def test_events_edge_cases_and_maintenance_filter():
    h = acct.read_file(fx("events_edge.txt"), "events")
    got = [(e.nodes[0], e.state, e.reason) for e in h.events]
    assert ("n1", "DOWN", "ECC error | bank 3") in got          # '|' inside a reason survives
    assert ("gpu01-ib1", "DOWN", "node unexpectedly rebooted") in got
    assert not any(r.startswith("scheduled maint") or "reboot requested" in r for _, _, r in got)
    assert h.filtered_maintenance == 2
    assert all(e.end_s is None for e in h.events if e.nodes == ("n1",))   # still down: Unknown
    # DOWN + DOWN*+DRAIN of n2 half a minute apart merge into one failure
    assert len(h.failures()) == 3


def test_custom_maintenance_patterns():
    h = acct.read_file(fx("events_edge.txt"), "events", maintenance_patterns=[r"(?i)ECC"])
    reasons = [e.reason for e in h.events]
    assert "ECC error | bank 3" not in reasons
    assert "scheduled maintenance window" in reasons
    assert h.filtered_maintenance == 1


def test_malformed_line_reports_line_number():
    with pytest.raises(InputFormatError) as ei:
        acct.read_file(fx("sacct_malformed.txt"), "sacct")
    assert ei.value.line == 3
    assert "sacct_malformed.txt:3" in str(ei.value)
    assert ei.value.hint and "--skip-bad-lines" in ei.value.hint


def test_skip_bad_lines_counts():
    h = acct.read_file(fx("sacct_malformed.txt"), "sacct", skip_bad_lines=True)
    assert h.skipped == 2              # wrong field count (line 3) and bad time (line 4)
    assert [e.job_id for e in h.events] == ["104"]


def test_missing_column_is_a_header_error():
    with pytest.raises(InputFormatError) as ei:
        acct.read_file(fx("events_badheader.txt"), "events")
    assert ei.value.line == 1 and "TimeStart" in str(ei.value)


def test_empty_input_is_empty_history():
    h = acct.parse_events("")
    assert h.events == [] and h.n_records == 0


def test_commands_are_parsable2_with_header():
    for argv in (acct.SACCT_ARGS, acct.SACCTMGR_EVENT_ARGS):
        assert "--parsable2" in argv
        assert not {"-n", "--noheader"} & set(argv)
    assert acct.sacct_argv("2026-11-20T00:00:00", "gpu")[-3:] == [
        "--starttime=2026-11-20T00:00:00", "--endtime=now", "--partition=gpu"]


def test_from_cluster_with_fake_runner():
    sacct = open(fx("sacct_edge.txt")).read()
    events = open(fx("events_edge.txt")).read()
    calls = []

    def runner(argv):
        calls.append(list(argv))
        return {"sacct": sacct, "sacctmgr": events, "sinfo": "n1\nn2\nn3\nn4\n"}[argv[0]]

    ch = acct.from_cluster("2026-11-20T12:00:00", runner=runner, now_s=ts("2026-11-21T12:00:00"))
    assert [c[0] for c in calls] == ["sacct", "sacctmgr", "sinfo"]
    assert "Start=2026-11-20T12:00:00" in calls[1]
    assert ch.cluster_nodes == ["n1", "n2", "n3", "n4"]
    nodes = {n for e in ch.history.failures() for n in e.nodes}
    # job 102's NODE_FAIL on n[1-3] is n2's DOWN event; gpu nodes are not in sinfo's list
    assert nodes == {"n1", "n2"}
    assert len(ch.history.failures()) == 2
    assert ch.window_end_s - ch.window_start_s == pytest.approx(24 * 3600)


def test_from_cluster_command_failure_is_slurm_error():
    def runner(argv):
        raise SlurmError("sacct exited 1")
    with pytest.raises(SlurmError):
        acct.from_cluster("2026-11-20T12:00:00", runner=runner)


def test_run_command_missing_binary():
    with pytest.raises(SlurmError):
        acct.run_command(["/nonexistent/sacct"])


# ---- real output captured by the lead from slurm/devcluster with SACCT_ARGS/SACCTMGR_EVENT_ARGS
# (tests/fixtures/slurm/capture.sh: two jobs hit by node failures - n2 "GPU Xid 79", n1 "Not
# responding" - and one planned-maintenance DOWN of n2).
REAL_SACCT, REAL_EVENTS = fx("real_sacct.txt"), fx("real_events.txt")
needs_real = pytest.mark.skipif(not (os.path.exists(REAL_SACCT) and os.path.exists(REAL_EVENTS)),
                                reason="real_sacct.txt/real_events.txt not captured yet")


def _raw_rows(path):
    lines = [ln for ln in open(path).read().splitlines() if ln.strip()]
    head = lines[0].split("|")
    return [dict(zip(head, ln.split("|", len(head) - 1))) for ln in lines[1:]]


@needs_real
def test_real_sacct_parses():
    h = acct.read_file(REAL_SACCT, "sacct")
    rows = _raw_rows(REAL_SACCT)
    assert h.n_records == len(rows) > 0 and h.skipped == 0
    want = sorted(r["JobID"] for r in rows if r["State"] == "NODE_FAIL")
    assert len(want) >= 2
    assert sorted(e.job_id for e in h.events) == want
    for e in h.events:
        row = next(r for r in rows if r["JobID"] == e.job_id and r["State"] == "NODE_FAIL")
        assert e.nodes == tuple(acct.expand_hostlist(row["NodeList"]))
        assert e.time_s == ts(row["End"])
    assert h.job_node_seconds >= 0


@needs_real
def test_real_events_parse_and_filter_maintenance():
    h = acct.read_file(REAL_EVENTS, "events")
    reasons = {(e.nodes[0], e.reason) for e in h.events}
    assert any(n == "n2" and "Xid" in r for n, r in reasons)
    assert any(n == "n1" and "Not responding" in r for n, r in reasons)
    assert not any("maintenance" in r for _, r in reasons)
    assert h.filtered_maintenance >= 1
    assert all(e.end_s is not None and e.end_s >= e.time_s for e in h.events)   # recovered


@needs_real
def test_real_sacct_and_events_merge_to_the_two_failures():
    h = acct.read_file(REAL_SACCT, "sacct").merge(acct.read_file(REAL_EVENTS, "events"))
    fails = h.failures()
    # each NODE_FAIL job and its node's DOWN event are one failure
    assert len(fails) == 2
    assert sorted(e.nodes for e in fails) == [("n1",), ("n2",)]
    assert all(e.source == "event" for e in fails)
