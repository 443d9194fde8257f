"""coci-plan: JSON keys, summary, exit codes, --plot, --from-cluster with a fake runner."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from coci_hpc.cli import plan as cli
from coci_hpc.planner.policies import daly_interval, young_interval
from coci_hpc.slurm import accounting as acct

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "slurm")


@pytest.fixture
def profile(tmp_path):
    rng = np.random.default_rng(0)
    t = np.arange(0, 1800, 10.0)
    loss = 2.0 * np.exp(-1.2e-3 * t) + 0.15 + 0.01 * rng.standard_normal(t.size)
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"samples": [{"step": int(x / 0.5), "time_s": x, "loss": l}
                                         for x, l in zip(t.tolist(), loss.tolist())],
                             "ckpt_cost_s": 1.6, "restart_cost_s": 140.0, "step_time_s": 0.5}))
    return str(p)


def run_json(capsys, *args):
    rc = cli.main(list(args) + ["--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_json_keys_and_values(capsys, profile):
    d = run_json(capsys, "--mtbf-hours", "8", "--nodes", "2", "--profile", profile,
                 "--horizon", "4h", "--policy", "young")
    for k in ("policy", "mtbf_hours", "interval_s", "checkpoints", "expected_overhead"):
        assert k in d
    assert d["policy"] == "young"
    assert d["mtbf_hours"] == pytest.approx(4.0)
    assert d["interval_s"] == pytest.approx(young_interval(1.6, 4 * 3600))
    assert d["checkpoints"][0].keys() == {"time_s", "step"}
    assert d["checkpoints"][0]["step"] > d["step_now"]
    assert set(d["expected_overhead"]) >= {"coci", "young", "daly", "checkfreq"}
    for v in d["expected_overhead"].values():
        assert v["time_s"] > 0 and v["progress_loss"] > 0
    assert d["fit"]["fit"]["kind"] in ("exp", "exp_floor")


def test_coci_paper_interval_is_null_and_checkpoints_grow_apart(capsys, profile):
    d = run_json(capsys, "--mtbf-hours", "4", "--profile", profile, "--horizon", "2h",
                 "--policy", "coci-paper:capped")
    assert d["policy"] == "coci-paper:capped" and d["interval_s"] is None and d["fallback"] is None
    times = [c["time_s"] for c in d["checkpoints"]]
    assert len(times) > 3 and times == sorted(times)


def test_default_policy_needs_no_profile(capsys):
    d = run_json(capsys, "--mtbf-hours", "4", "--ckpt-cost", "5", "--restart-cost", "60")
    assert d["policy"] == d["effective_policy"] == "coci" and d["fallback"] is None
    daly = daly_interval(5, 4 * 3600)
    assert d["interval_s"] == pytest.approx(daly, rel=0.02)     # equal chunks of the horizon
    k = round(24 * 3600 / d["interval_s"])
    assert d["interval_s"] * k == pytest.approx(24 * 3600)
    assert len(d["checkpoints"]) == k - 1                        # none at the very end


def test_coci_paper_without_profile_states_fallback(capsys):
    d = run_json(capsys, "--mtbf-hours", "4", "--ckpt-cost", "5", "--restart-cost", "60",
                 "--policy", "coci-paper")
    assert d["effective_policy"] == "young"
    assert "profile" in d["fallback"]
    assert d["interval_s"] == pytest.approx(young_interval(5, 4 * 3600))
    assert d["checkpoints"][0]["step"] is None
    assert d["costs"]["assumed"] == []


def test_history_files(capsys):
    d = run_json(capsys, "--sacct-file", os.path.join(FIX, "sacct_edge.txt"),
                 "--events-file", os.path.join(FIX, "events_edge.txt"), "--nodes", "4")
    f = d["failures"]
    assert f["n_failures"] == 3 and f["filtered_maintenance"] == 2
    assert {tuple(e["nodes"]) for e in f["events"]} == {("n2",), ("n1",), ("gpu01-ib1",)}
    lo, hi = d["mtbf_hours_interval"]
    assert lo < d["mtbf_hours"] < hi


def test_sacct_only_uses_job_exposure(capsys):
    d = run_json(capsys, "--sacct-file", os.path.join(FIX, "sacct_edge.txt"))
    assert d["failures"]["exposure_node_s"] == pytest.approx(32.5 * 3600)
    assert d["mtbf_hours"] == pytest.approx(32.5 / 2)


def test_human_summary(capsys, profile):
    assert cli.main(["--mtbf-hours", "4", "--profile", profile, "--horizon", "2h"]) == 0
    out = capsys.readouterr().out
    assert "job MTBF" in out and "curve: loss(t)" in out and "next checkpoints" in out
    for name in ("coci", "young", "daly", "checkfreq"):
        assert name in out


@pytest.mark.parametrize("args,code,needle", [
    ([], 2, "no failure information"),
    (["--mtbf-hours", "4", "--policy", "nope"], 2, "unknown policy"),
    (["--mtbf-hours", "4", "--horizon", "soon"], 2, "--horizon 'soon' is not a duration"),
    (["--mtbf-hours", "4", "--horizon", "3600"], 2, "--horizon '3600' has no unit"),
    (["--mtbf-hours", "-3"], 2, "--mtbf-hours -3"),
    (["--mtbf-hours", "4", "--ckpt-cost", "0"], 2, "--ckpt-cost 0: must be a positive number"),
    (["--mtbf-hours", "4", "--restart-cost", "-1"], 2, "--restart-cost -1"),
    (["--sacct-file", os.path.join(FIX, "sacct_malformed.txt")], 2, "sacct_malformed.txt:3"),
    (["--events-file", "/nonexistent/ev.txt"], 2, "cannot read"),
    (["--from-cluster"], 2, "--since"),
    (["--mtbf-hours", "4", "--bogus"], 2, "unrecognized"),
])
def test_bad_input_exit_codes(capsys, args, code, needle):
    assert cli.main(args) == code
    err = capsys.readouterr().err
    assert needle in err and err.startswith("coci-plan: error:")


def test_bad_profile(capsys, tmp_path):
    p = tmp_path / "p.json"
    p.write_text('{"samples": [{"time_s": 1}]}')
    assert cli.main(["--mtbf-hours", "4", "--profile", str(p)]) == 2
    assert "samples[0]" in capsys.readouterr().err
    p.write_text("{not json")
    assert cli.main(["--mtbf-hours", "4", "--profile", str(p)]) == 2


def test_noisy_profile_falls_back_with_reason(capsys, tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"samples": [{"step": i, "time_s": i, "loss": 1.0 + (i % 2)}
                                         for i in range(30)]}))
    d = run_json(capsys, "--mtbf-hours", "4", "--profile", str(p), "--policy", "coci-paper")
    assert d["effective_policy"] == "young" and "not decreasing" in d["fallback"]


def test_skip_bad_lines(capsys):
    d = run_json(capsys, "--sacct-file", os.path.join(FIX, "sacct_malformed.txt"),
                 "--skip-bad-lines")
    assert d["failures"]["skipped_lines"] == 2 and d["failures"]["n_failures"] == 1


def test_maintenance_pattern_option(capsys):
    d = run_json(capsys, "--events-file", os.path.join(FIX, "events_edge.txt"),
                 "--maintenance-pattern", "ECC", "--cluster-nodes", "10")
    reasons = {e["reason"] for e in d["failures"]["events"]}
    assert "ECC error | bank 3" not in reasons
    assert d["failures"]["cluster_nodes"] == 10


def test_zero_failures_uses_prior(capsys):
    d = run_json(capsys, "--events-file", os.path.join(FIX, "events_nofail.txt"),
                 "--cluster-nodes", "4", "--since", "2026-11-20T00:00:00")
    assert d["failures"]["n_failures"] == 0 and d["failures"]["prior"] == "jeffreys"
    assert math.isfinite(d["mtbf_hours"]) and d["mtbf_hours_interval"][1] is None


def test_plot_writes_png(capsys, tmp_path, profile):
    out = tmp_path / "plan.png"
    assert cli.main(["--mtbf-hours", "4", "--profile", profile, "--horizon", "3h",
                     "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_from_cluster_uses_runner(capsys, monkeypatch):
    sacct = open(os.path.join(FIX, "sacct_edge.txt")).read()
    events = open(os.path.join(FIX, "events_edge.txt")).read()
    seen = []

    def fake(argv, env=None, timeout=60.0):
        seen.append(argv[0])
        return {"sacct": sacct, "sacctmgr": events, "sinfo": "n1\nn2\nn3\nn4\n"}[argv[0]]

    monkeypatch.setattr(acct, "run_command", fake)
    d = run_json(capsys, "--from-cluster", "--since", "2026-11-20T00:00:00", "--nodes", "2")
    assert seen == ["sacct", "sacctmgr", "sinfo"]
    assert d["failures"]["cluster_nodes"] == 4
    assert {tuple(e["nodes"]) for e in d["failures"]["events"]} == {("n1",), ("n2",)}
    assert d["checkpoints"]


def test_module_entry_point(tmp_path):
    cp = subprocess.run([sys.executable, "-m", "coci_hpc.cli.plan", "--mtbf-hours", "70",
                         "--ckpt-cost", "10", "--json"], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["mtbf_hours"] == pytest.approx(70.0)
    cp = subprocess.run([sys.executable, "-m", "coci_hpc.cli.plan"], capture_output=True,
                        text=True, timeout=120)
    assert cp.returncode == 2 and "hint" in cp.stderr


@pytest.mark.skipif(not os.path.exists(os.path.join(FIX, "real_events.txt")),
                    reason="real capture missing")
def test_real_capture_through_cli(capsys):
    d = run_json(capsys, "--sacct-file", os.path.join(FIX, "real_sacct.txt"),
                 "--events-file", os.path.join(FIX, "real_events.txt"), "--nodes", "2",
                 "--cluster-nodes", "4")
    # n2 (GPU Xid) and n1 (slurmd timeout) went down 17 s apart: two records, one incident
    assert d["failures"]["records"] == 2
    assert d["failures"]["n_failures"] == d["failures"]["incidents"] == 1
    assert d["failures"]["by_node"] == {"n2": 1, "n1": 1}
    assert d["failures"]["filtered_maintenance"] >= 1
    assert d["checkpoints"]


@pytest.mark.parametrize("value", ["-3", "0", "nan"])
def test_non_positive_mtbf_is_a_usage_error_naming_the_flag(value, capsys):
    from coci_hpc.cli.plan import main
    rc = main(["--mtbf-hours", value, "--nodes", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--mtbf-hours" in err and "positive number of hours" in err


def test_summary_counts_failures_by_node_and_reason_not_one_line_each(capsys):
    assert cli.main(["--events-file", os.path.join(FIX, "events_edge.txt"), "--cluster-nodes", "10"]) == 0
    out = capsys.readouterr().out
    assert "incident(s) after declustering" in out
    assert "by node:" in out and "by reason:" in out
    assert "'ECC error | bank 3'" not in out            # no per-failure lines


def test_horizon_from_total_steps_and_plateau(capsys, tmp_path):
    p = tmp_path / "p.json"
    samples = [{"step": i * 10, "time_s": i * 5.0, "loss": 2.0 * math.exp(-i * 5.0 / 600) + 0.5}
               for i in range(1, 80)]
    p.write_text(json.dumps({"samples": samples, "ckpt_cost_s": 2.0, "step_time_s": 0.5,
                             "total_steps": 10790}))
    d = run_json(capsys, "--mtbf-hours", "4", "--profile", str(p))
    assert d["horizon_source"] == "profile total_steps"
    assert d["horizon_s"] == pytest.approx((10790 - 790) * 0.5)
    d = run_json(capsys, "--mtbf-hours", "4", "--profile", str(p), "--plateau-loss", "0.6")
    assert d["horizon_source"].startswith("fitted curve reaches")
    assert d["horizon_s"] < (10790 - 790) * 0.5


@pytest.mark.parametrize("text,seconds", [("90m", 5400), ("2d", 172800), ("1-00:00:00", 86400),
                                          ("12:00:00", 43200)])
def test_one_duration_parser(text, seconds):
    assert cli.parse_duration(text) == seconds


# -- issue 26, item 15 ----------------------------------------------------------------------------
def test_table_gives_an_interval_and_a_paired_difference_and_explains_its_columns(capsys):
    assert cli.main(["--mtbf-hours", "4", "--ckpt-cost", "5", "--horizon", "1d"]) == 0
    out = capsys.readouterr().out
    head = next(ln for ln in out.splitlines() if ln.startswith("  policy "))
    assert "± 90%" in head and "vs coci (90%)" in head
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and ln.split()[0] in cli.COMPARED}
    assert "(reference)" in rows["coci"] and "±" in rows["daly"]
    assert "same" in rows["daly"]                  # coci and daly cannot be told apart here
    assert "+" in rows["checkfreq"] and "same" not in rows["checkfreq"]   # checkfreq's 626 saves cost more
    assert "complete: jobs that train the whole horizon" in out and "exploratory: jobs stopped early" in out
    d = run_json(capsys, "--mtbf-hours", "4", "--ckpt-cost", "5", "--horizon", "1d")
    e = d["expected_overhead"]
    lo, hi = e["daly"]["time_s_interval"]
    assert lo < e["daly"]["time_s"] < hi and e["coci"]["vs_reference_s"] is None
    dlo, dhi = e["checkfreq"]["vs_reference_s"]
    assert 0 < dlo < dhi and dlo < e["checkfreq"]["time_s"] - e["coci"]["time_s"] < dhi
    assert d["simulation"]["reference"] == "coci" and d["simulation"]["confidence"] == 0.9


def test_since_applies_to_the_ignored_maintenance_count(capsys):
    args = ["--events-file", os.path.join(FIX, "events_edge.txt"), "--cluster-nodes", "10"]
    assert run_json(capsys, *args)["failures"]["filtered_maintenance"] == 2
    # the 2026-11-20T20:00 maintenance window lies before --since; the 11-21 reboot after it
    assert run_json(capsys, *args, "--since", "2026-11-21T00:00:00")["failures"]["filtered_maintenance"] == 1
    assert cli.main(args + ["--since", "2026-11-21T00:00:00"]) == 0
    assert "ignored 1 maintenance event(s)" in capsys.readouterr().out
