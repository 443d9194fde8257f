"""coci-plan --two-tier: both intervals and every alternative's expected waste."""
import json
import os

import pytest

from coci_hpc.cli import plan as cli

EVENTS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "slurm", "events_edge.txt")
BASE = ["--ckpt-cost", "40", "--restart-cost", "230", "--step-time", "5", "--horizon", "72h",
        "--two-tier", "--memory-copy-s", "1", "--memory-restart-cost", "90"]


def test_json_has_both_intervals_and_alternatives(capsys):
    assert cli.main(["--mtbf-hours", "500", "--nodes", "64", *BASE, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["two_tier"]
    assert d["tier"] == "two-tier" and d["mem_every_steps"] >= 1
    assert d["disk_every_steps"] > d["mem_every_steps"]
    assert d["mem_interval_s"] == pytest.approx(5 * d["mem_every_steps"])
    alts = d["alternatives"]
    assert {"daly", "two-tier-first-order"} <= set(alts)
    chosen = alts[d["params"]["chosen"]]["simulated_waste"]
    assert chosen <= alts["daly"]["simulated_waste"]


def test_one_node_drops_the_memory_tier_and_says_why(capsys):
    assert cli.main(["--events-file", EVENTS, "--nodes", "1", *BASE]) == 0
    out = capsys.readouterr().out
    assert "memory tier dropped" in out and "one node" in out
    assert "daly" in out and "simulated" in out


@pytest.mark.parametrize("args,needle", [
    (["--two-tier", "--step-time", "5"], "--memory-copy-s"),
    (["--two-tier", "--memory-copy-s", "1"], "step time"),
    (["--two-tier", "--step-time", "5", "--memory-copy-s", "-2"], "--memory-copy-s"),
])
def test_two_tier_usage_errors(capsys, args, needle):
    assert cli.main(["--mtbf-hours", "100", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("coci-plan: error:")


def test_both_intervals_and_why(capsys):
    """A given MTBF: no partner loss is known, and the disk interval still answers the whole-job
    failures (the defaults, said so)."""
    assert cli.main(["--mtbf-hours", "500", "--nodes", "64", *BASE]) == 0
    out = capsys.readouterr().out
    assert "memory interval:" in out and "disk interval: Daly's interval for the failures the memory tier" in out
    assert "prior, SCR" in out and "1 per 160 h (prior, Blue Waters)" in out


def test_options_override_the_settings(capsys, monkeypatch):
    monkeypatch.setenv("COCI_WHOLE_JOB_SHARE", "0.05")
    assert cli.main(["--mtbf-hours", "500", "--nodes", "64", *BASE, "--json", "--outage-rate", "0.1"]) == 0
    p = json.loads(capsys.readouterr().out)["two_tier"]["params"]
    assert p["whole_job_share"] == 0.05 and p["outage_rate_per_s"] == pytest.approx(0.1 / 3600)
    assert cli.main(["--mtbf-hours", "500", "--nodes", "64", *BASE, "--json", "--whole-job-share", "0.3"]) == 0
    assert json.loads(capsys.readouterr().out)["two_tier"]["params"]["whole_job_share"] == 0.3


@pytest.mark.parametrize("args,env,needle", [
    (["--whole-job-share", "1.5"], {}, "--whole-job-share"),
    (["--whole-job-share", "0"], {}, "--whole-job-share"),
    (["--outage-rate", "-1"], {}, "--outage-rate"),
    ([], {"COCI_WHOLE_JOB_SHARE": "1"}, "COCI_WHOLE_JOB_SHARE"),
    ([], {"COCI_OUTAGE_RATE": "-0.01"}, "COCI_OUTAGE_RATE"),
    ([], {"COCI_OUTAGE_RATE": "often"}, "COCI_OUTAGE_RATE"),
])
def test_bad_whole_job_inputs_name_the_setting(capsys, monkeypatch, args, env, needle):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["--mtbf-hours", "500", "--nodes", "64", *BASE, *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("coci-plan: error:") and "Traceback" not in err


def test_event_logs_teach_the_share_and_an_empty_one_is_refused(tmp_path, capsys):
    from coci_hpc.runtime.events import EventLog
    log = tmp_path / "events.jsonl"
    for n in (1, 2, 3):
        EventLog(log, attempt=n, job_id="1").write("attempt_start", nodes=["a", "b"], ranks=2)
    assert cli.main(["--mtbf-hours", "500", "--nodes", "64", *BASE, "--json", "--event-log", str(tmp_path)]) == 0
    p = json.loads(capsys.readouterr().out)["two_tier"]["params"]
    assert p["whole_job_share"] == pytest.approx((2 + 0.3) / (2 + 2))      # 2 whole ends, the prior's 2
    empty = tmp_path / "other.jsonl"
    EventLog(empty, attempt=1, job_id="1").write("checkpoint", step=1, kind="planned")
    assert cli.main(["--mtbf-hours", "500", "--nodes", "64", *BASE, "--event-log", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "--event-log" in err and "no attempt records" in err
