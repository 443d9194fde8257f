"""The whole story on the local cluster: a 2-node data-parallel training job is preempted, checkpoints
at the next step boundary, requeues itself, resumes from the newest committed checkpoint and ends
with exactly the parameters of an uninterrupted run."""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, SlurmCluster, reference_hash, reference_run_later

pytestmark = pytest.mark.slurm

TRAIN = ROOT / "examples" / "train_resumable.py"
STEPS, EVERY = 400, 100


def test_preempted_training_resumes_bit_exactly(slurm_cluster: SlurmCluster) -> None:
    wd = slurm_cluster.workdir / "train"
    wd.mkdir()
    # The uninterrupted run trains in the background while the job waits on Slurm; its hash is compared at the end.
    ref_run = reference_run_later(2, "-m", "mpi4py", str(TRAIN), "--steps", str(STEPS), "--ckpt-every", str(EVERY),
                                  ckpt_dir=wd / "ref", timeout=300)

    log = wd / "job-%j.out"
    # The plain sbatch template people use without a CLI: it sets --requeue, --signal=USR1@60, srun --mpi=pmix.
    job = slurm_cluster.sbatch(
        "--time=10", "-o", str(log), str(ROOT / "slurm" / "templates" / "train_preemptible.sbatch"),
        sys.executable, str(TRAIN), "--steps", str(STEPS), "--ckpt-dir", str(wd / "run"), "--ckpt-every", str(EVERY),
        "--preemptible", "--signal-lead", "60", "--step-sleep", "0.05")
    logfile = Path(str(log).replace("%j", job))
    deadline = time.monotonic() + 120
    # Preempt after the first periodic checkpoint and well before the end (step ~150 of 400).
    while "saved step 100" not in (logfile.read_text() if logfile.exists() else ""):
        assert time.monotonic() < deadline, logfile.read_text() if logfile.exists() else "no log"
        time.sleep(0.5)
    time.sleep(2.5)
    urgent = slurm_cluster.sbatch("-p", "urgent", "-N", "1", "-o", os.devnull, "--wrap", "sleep 1")
    rows = slurm_cluster.wait_gone(job, timeout=240)
    text = logfile.read_text()
    print(text, rows)
    stop = re.search(r"STOP at step (\d+) \((\w[\w ]*)\): saved, requeue", text)
    assert stop, text
    stop_step = int(stop.group(1))
    assert EVERY < stop_step < STEPS
    assert stop.group(2) == "preemption"
    assert f"resumed from step {stop_step}" in text
    assert "attempt 1 on n[1-2]" in text and "attempt 2 on n[1-2]" in text  # the template's own lines
    assert [r["State"] for r in rows][-1] == "COMPLETED" and len(rows) >= 2, rows
    ref_hash = reference_hash(ref_run.result().stdout, steps=STEPS)
    assert reference_hash(text, steps=STEPS) == ref_hash  # bit-exact with the uninterrupted run
    assert slurm_cluster.wait_gone(urgent, timeout=60)[-1]["State"] == "COMPLETED"
