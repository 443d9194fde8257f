"""The planner choosing checkpoint steps in a real training run, across a restart in a new process."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, run_ranks

TRAIN = [str(ROOT / "examples" / "train_resumable.py")]
# A short MTBF (3.6 s) keeps Young's interval (sqrt(2*Ts*M), Ts ~ 20-60 ms of fsync here) well inside
# the 120-step runs, so the test does not depend on how noisy the disk is.
PLAN = ["--plan", "young", "--mtbf-hours", "0.001", "--plan-warmup", "10", "--step-sleep", "0.005"]


def _train(*args: str) -> str:
    return run_ranks(0, *TRAIN, *args, timeout=300).stdout


def test_planned_checkpoints_resume_bit_exactly_and_feed_coci_plan(tmp_path: Path) -> None:
    ref = _train("--steps", "240", "--ckpt-dir", str(tmp_path / "ref"), "--ckpt-every", "1000")
    first = _train("--steps", "120", "--ckpt-dir", str(tmp_path / "run"), *PLAN)
    second = _train("--steps", "240", "--ckpt-dir", str(tmp_path / "run"), *PLAN,
                    "--profile-out", str(tmp_path / "prof.json"))
    found = lambda out: [int(s) for s in re.findall(r"saved step (\d+) \(plan young", out)]  # noqa: E731
    saves = found(first) + found(second)
    assert saves[0] == 10                       # the early, Ts-measuring checkpoint
    assert len(saves) >= 3 and any(s % 10 for s in saves)  # later ones where the plan put them
    resumed = int(re.search(r"resumed from step (\d+)", second).group(1))
    assert resumed == max(found(first))
    h = lambda out: re.findall(r"PARAM_HASH (\w+) step 240", out)  # noqa: E731
    assert h(second) == h(ref) and h(ref)      # checkpoint timing never changes the training
    out = subprocess.run([sys.executable, "-m", "coci_hpc.cli.plan", "--profile", str(tmp_path / "prof.json"),
                          "--mtbf-hours", "4", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["costs"]["ckpt_s"] > 0 and "ckpt_cost_s" not in plan["costs"].get("assumed", [])
    assert plan["checkpoints"]
