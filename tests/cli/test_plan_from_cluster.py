"""coci-plan --from-cluster on the local Slurm cluster: a failed node shows up in the plan."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from coci_hpc.slurm.accounting import SACCTMGR_EVENT_ARGS

pytestmark = pytest.mark.slurm


def _down_events_since(env: dict, since: str, node: str) -> list[str]:
    p = subprocess.run(SACCTMGR_EVENT_ARGS + [f"Start={since}", "End=now"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()[1:]          # skip the header
    # TimeStart >= since: sacctmgr also lists an earlier test's event on the same node whose
    # end it recorded after ``since`` (CI, 29 Nov: the recover then ran before this DOWN existed)
    return [ln for ln in lines if ln.split("|")[0] == node and "DOWN" in ln.split("|")[3].upper()
            and ln.split("|")[1] >= since]


def _fail_and_recover(dev: str, env: dict, since: str, node: str) -> None:
    """`devcluster fail NODE`, wait until sacctmgr lists its DOWN event, then recover it."""
    subprocess.run([dev, "fail", node], check=True, env=env, timeout=120,
                   capture_output=True, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _down_events_since(env, since, node):
            if time.monotonic() > deadline:
                pytest.fail(f"sacctmgr show event never listed {node} DOWN after devcluster fail {node}")
            time.sleep(1)
    finally:
        subprocess.run([dev, "recover", node], check=True, env=env, timeout=120,
                       capture_output=True, text=True)


def _plan_from_cluster(env: dict, since: str, *extra: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "coci_hpc.cli.plan", "--from-cluster",
                        "--since", since, "--nodes", "2", *extra],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


def test_failed_node_appears_in_plan(slurm_cluster):
    env = slurm_cluster.env
    dev = str(slurm_cluster.devcluster)
    # one second of slack: Slurm stamps events to the second
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    _fail_and_recover(dev, env, since, "n2")

    p = _plan_from_cluster(env, since, "--json")
    out = json.loads(p.stdout)
    f = out["failures"]
    assert f["source"] == "cluster"
    assert f["n_failures"] >= 1
    n2 = [e for e in f["events"] if "n2" in e["nodes"]]
    assert n2, f"n2's failure missing from {f['events']}"
    assert n2[0]["source"] == "event" and "DOWN" in n2[0]["state"].upper()
    assert out["mtbf_hours"] > 0
    assert out["checkpoints"] and out["checkpoints"][0]["time_s"] > 0
    assert out["interval_s"] is not None          # the default needs no profile
    # One incident is a sparse history: the default plans exactly as Daly and says why (issue 16).
    assert out["effective_policy"] == "daly", out
    assert "fewer than 150" in out["fallback"], out["fallback"]


def test_from_cluster_counts_the_node_failure_not_the_preemption(slurm_cluster):
    """A `gpu` job preempted by an `urgent` one (sacct: PREEMPTED) and a `devcluster fail n2`
    (node DOWN event): coci-plan --from-cluster counts one failure, on n2, and reports the
    preemption as announced, not counted."""
    env = slurm_cluster.env
    dev = str(slurm_cluster.devcluster)
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    victim = slurm_cluster.sbatch("-p", "gpu", "-N", "1", "-w", "n1", "--requeue", "-o", os.devnull,
                                  "--wrap", '[ "${SLURM_RESTART_COUNT:-0}" -ge 1 ] && exit 0; '
                                  'sleep 600')
    slurm_cluster.wait_state(victim, ("RUNNING",), timeout=60)
    urgent = slurm_cluster.sbatch("-p", "urgent", "-N", "1", "-w", "n1", "-o", os.devnull,
                                  "--wrap", "sleep 1")
    rows = slurm_cluster.wait_gone(victim, timeout=180)
    assert rows[0]["State"] == "PREEMPTED", rows
    slurm_cluster.wait_gone(urgent, timeout=60)
    _fail_and_recover(dev, env, since, "n2")
    p = _plan_from_cluster(env, since, "--json")
    f = json.loads(p.stdout)["failures"]
    print(json.dumps({k: f[k] for k in ("records", "incidents", "by_node", "by_reason",
                                        "announced_not_counted")}))
    assert f["n_failures"] == f["incidents"] == 1
    assert f["by_node"] == {"n2": 1}                       # n1 was preempted, never failed
    assert f["announced_not_counted"]["PREEMPTED"] >= 1
    # and the summary (no --json) says so
    p = _plan_from_cluster(env, since)
    assert "n2: 1" in p.stdout and "PREEMPTED" in p.stdout
