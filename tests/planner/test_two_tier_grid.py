"""The two-tier grid's whole-job arms (benchmarks/two_tier_grid.py) on a small made-up history."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import two_tier_grid as grid  # noqa: E402


def test_whole_job_failures_are_added_at_the_arm_rates():
    times = np.sort(np.random.default_rng(0).uniform(0, 4 * grid.WORK_S, (2000, 30)), axis=1)
    traces = (times, np.zeros(times.shape, dtype=bool))
    t, f = grid.with_whole_job(traces, 0.3, 0.0, np.random.default_rng(1))
    assert t is times and abs(f.mean() - 0.3) < 0.01
    t2, f2 = grid.with_whole_job(traces, 0.0, 1 / 40, np.random.default_rng(2))
    outages = np.isfinite(t2).sum() - times.size
    assert abs(outages / (2000 * 4 * grid.WORK_S / (40 * 3600)) - 1) < 0.05
    assert f2.sum() == outages                  # every outage goes back to disk, nothing else


def test_arms_keys_and_the_worst_single_loss(tmp_path):
    """A 6-node history of one-node failures: without whole-job failures the best fixed pair
    saves nothing to disk; with them coci's disk interval answers, and no failure rolls back more
    than one of coci's disk intervals of work."""
    rng = np.random.default_rng(3)
    lines = ["NodeName|TimeStart|TimeEnd|State|Reason"]

    def fmt(x: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(x))
    for k, t in enumerate(np.sort(rng.uniform(0, 400 * 86400, 600))):
        start = 1.7e9 + t
        lines.append(f"n{k % 6}|{fmt(start)}|{fmt(start + 3600)}|DOWN|Not responding")
    path = tmp_path / "toy_events.txt"
    path.write_text("\n".join(lines) + "\n")
    rows = grid.grid_two_tier([(str(path), 6)], 20, 7, nodes=(16,), states=(10.0,), disks=(1.0,), mems=(25.0,),
                              arms=((0.0, 0.0), (0.3, 1 / 40)), diagnostics=False)
    assert [r["arm"] for r in rows] == ["f=0 outages=0", "f=0.3 outages=1/40h"]
    quiet, busy = rows
    assert quiet["disk_every"] == busy["disk_every"]          # the planner does not know the arm
    assert busy["to_disk_seen"] > 0.25 and quiet["to_disk_seen"] < 0.05
    for r in rows:
        assert 0 < r["worst_loss_disk_intervals"] <= 1.0 + 1e-9
    k = grid.keys(rows)
    assert set(k["arms"]) == {"f=0 outages=0", "f=0.3 outages=1/40h"}
    assert k["two_tier_vs_best_fixed_geomean"] == max(b["two_tier_vs_best_fixed_geomean"] for b in k["arms"].values())
    assert set(k["goals_met"]) == set(grid.GOALS)
