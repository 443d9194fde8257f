"""Accounting defects found in review, each with the case that failed before the fix; announced
interruptions (PREEMPTED, TIMEOUT) kept out of the failure rate; declustering records into
incidents."""
import json
import time
from datetime import datetime

import pytest

from coci_hpc.cli import plan as cli
from coci_hpc.planner.failures import FailureEvent, decluster
from coci_hpc.slurm import accounting as acct

HDR = "JobIDRaw|JobID|Partition|State|Start|End|NNodes|NodeList\n"


def ts(s):
    fmt = "%Y-%m-%dT%H:%M:%S" if "T" in s else "%Y-%m-%d"
    return time.mktime(datetime.strptime(s, fmt).timetuple())


def run_json(capsys, *argv):
    assert cli.main(list(argv) + ["--json", "--ckpt-cost", "10"]) == 0
    return json.loads(capsys.readouterr().out)


def test_running_job_counts_up_to_until_not_now(tmp_path):
    f = tmp_path / "sacct.txt"
    f.write_text(HDR + "1|1|gpu|RUNNING|2026-11-20T10:00:00|Unknown|2|n[1-2]\n"
                 "2|2|gpu|COMPLETED|2026-11-20T09:00:00|2026-11-20T11:00:00|1|n3\n")
    h = acct.read_file(str(f), "sacct")
    model, info = acct.build_model(h, ts("2026-11-20T09:00:00"), ts("2026-11-20T12:00:00"),
                                   cluster_nodes=3, have_events=False)
    # 2 nodes x 2 h (running, up to --until) + 1 node x 2 h; before the fix: up to now (years)
    assert model.exposure_node_s == pytest.approx(6 * 3600)


def test_window_starts_at_since_and_exposure_is_clipped_to_it(tmp_path, capsys):
    f = tmp_path / "sacct.txt"
    f.write_text(HDR + "1|1|gpu|COMPLETED|2026-11-19T00:00:00|2026-11-20T06:00:00|1|n1\n"
                 "2|2|gpu|NODE_FAIL|2026-11-19T00:00:00|2026-11-19T12:00:00|1|n2\n"
                 "3|3|gpu|COMPLETED|2026-11-20T00:00:00|2026-11-21T00:00:00|1|n3\n")
    d = run_json(capsys, "--sacct-file", str(f), "--since", "2026-11-20T00:00:00",
                 "--until", "2026-11-20T12:00:00")
    fl = d["failures"]
    assert fl["window_start"] == "2026-11-20T00:00:00"          # not the earliest job start
    assert fl["window_end"] == "2026-11-20T12:00:00"
    # job 1: 6 h inside; job 2 ended (failed) before the window; job 3: 12 h inside
    assert fl["exposure_node_s"] == pytest.approx(18 * 3600)
    assert fl["n_failures"] == 0                                # the failure is outside, too


def test_pipe_in_job_name_parses(tmp_path):
    f = tmp_path / "sacct.txt"
    f.write_text("JobIDRaw|JobID|JobName|Partition|State|Start|End|NNodes|NodeList\n"
                 "7|7|a|b|c|gpu|NODE_FAIL|2026-11-20T10:00:00|2026-11-20T11:00:00|1|n4\n")
    h = acct.read_file(str(f), "sacct")
    assert h.skipped == 0 and [e.nodes for e in h.events] == [("n4",)]
    assert "JobName" not in acct.SACCT_FORMAT


def test_date_only_since_is_accepted(tmp_path, capsys):
    f = tmp_path / "sacct.txt"
    f.write_text(HDR + "1|1|gpu|COMPLETED|2026-11-19T00:00:00|2026-11-21T00:00:00|1|n1\n")
    d = run_json(capsys, "--sacct-file", str(f), "--since", "2026-11-20", "--until", "2026-11-20T12:00")
    assert d["failures"]["window_start"] == "2026-11-20T00:00:00"
    assert d["failures"]["exposure_node_s"] == pytest.approx(12 * 3600)
    assert acct.parse_since("2026-11-20") == ts("2026-11-20")


def test_preempted_and_timeout_are_not_failures(tmp_path, capsys):
    base = HDR + ("1|1|gpu|COMPLETED|2026-11-20T00:00:00|2026-11-21T00:00:00|4|n[1-4]\n"
                  "2|2|gpu|NODE_FAIL|2026-11-20T00:00:00|2026-11-20T05:00:00|1|n5\n")
    announced = ("3|3|gpu|PREEMPTED|2026-11-20T01:00:00|2026-11-20T02:00:00|2|n[6-7]\n"
                 "4|4|gpu|TIMEOUT|2026-11-20T03:00:00|2026-11-20T04:00:00|1|n8\n"
                 "5|5|gpu|PREEMPTED|2026-11-20T06:00:00|2026-11-20T07:00:00|1|n6\n")
    plain, both = tmp_path / "plain.txt", tmp_path / "both.txt"
    plain.write_text(base)
    both.write_text(base + announced)
    common = ["--since", "2026-11-20", "--until", "2026-11-21", "--policy", "daly"]
    a = run_json(capsys, "--sacct-file", str(plain), *common)
    b = run_json(capsys, "--sacct-file", str(both), *common)
    assert b["failures"]["n_failures"] == 1 == a["failures"]["n_failures"]
    assert b["failures"]["announced_not_counted"] == {"PREEMPTED": 2, "TIMEOUT": 1, "DEADLINE": 0}
    # they add exposure (the nodes ran) but no failure: the interval does not shorten
    assert b["interval_s"] >= a["interval_s"]


def ev(node, t, end=None, reason="r"):
    return FailureEvent((node,), float(t), reason=reason, source="event", state="DOWN",
                        end_s=None if end is None else float(end))


def test_decluster_hand_made_history():
    h = 3600.0
    records = [
        ev("n1", 0), ev("n2", 20), ev("n3", 59),          # one switch: 3 nodes in one minute
        ev("n4", 5 * h, end=5 * h + 600),                 # n4 down, repaired 10 min later
        ev("n4", 5 * h + 600 + 1800),                     # ... and down again 30 min after: same
        ev("n5", 10 * h, end=10 * h + 60),
        ev("n5", 12 * h),                                 # 2 h after repair: a new incident
        ev("n6", 20 * h), ev("n6", 20 * h + 61),          # same node, unknown end, 61 s: same
    ]
    inc = decluster(records)
    assert [(sorted(i.nodes), i.time_s) for i in inc] == [
        (["n1", "n2", "n3"], 0.0), (["n4"], 5 * h), (["n5"], 10 * h), (["n5"], 12 * h),
        (["n6"], 20 * h)]
    assert len(inc) / len(records) == pytest.approx(5 / 9)


def test_from_cluster_function_for_the_runtime():
    sacct = HDR + ("1|1|gpu|PREEMPTED|2026-11-20T13:00:00|2026-11-20T14:00:00|1|n1\n"
                   "2|2|gpu|NODE_FAIL|2026-11-20T13:00:00|2026-11-20T15:00:00|1|n2\n")
    events = ("NodeName|TimeStart|TimeEnd|State|Reason\n"
              "n2|2026-11-20T14:58:00|2026-11-20T15:30:00|DOWN|Not responding\n")

    def runner(argv):
        return {"sacct": sacct, "sacctmgr": events, "sinfo": "n[1-4]\n"}[argv[0]]

    model, info = acct.failure_model_from_cluster("gpu", since="2026-11-20T12:00:00",
                                                  runner=runner, now_s=ts("2026-11-21T12:00:00"))
    assert model.n_failures == 1 and info["incidents"] == 1
    assert info["by_node"] == {"n2": 1}
    assert info["announced_not_counted"]["PREEMPTED"] == 1
    assert model.exposure_node_s == pytest.approx(4 * 24 * 3600)
    assert info["partition"] == "gpu" and info["source"] == "cluster"
    json.dumps(info)
