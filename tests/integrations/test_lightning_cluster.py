"""Acceptance on the local Slurm cluster: examples/lightning_train.py (Lightning DDP on gloo, 2 nodes)
through coci-submit is preempted once, then runs into its time limit, and ends with the parameters of
an uninterrupted `mpiexec -n 2` run; each stop repeats no step."""
from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("lightning.pytorch")

from coci_hpc.runtime.events import read_events  # noqa: E402
from tests.conftest import ROOT, SlurmCluster, reference_hash, run_ranks, wait_for  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.skip(
    reason="open: a 2-rank DDP resume is not yet bit-identical (seen 2026-11-28: after the resume, params, optimizer "
           "and RNG match the uninterrupted run but the batches differ; suspected: Lightning creates the resumed "
           "StatefulDataLoader's iterator in setup_data before it sets the DistributedSampler's epoch). "
           "The preemption and time-limit stops, saves and requeues themselves passed here.")]

TRAIN = ROOT / "examples" / "lightning_train.py"
# 600 steps of ~0.1 s: the first attempt is preempted after its first checkpoint, the second gets
# Slurm's warning 60 s after it started (--time 2, --signal-lead 60), the third finishes.
STEPS, EVERY, SEED, STEP_TIME = 600, 50, 4, 0.1


def test_lightning_ddp_preempted_then_time_limit_ends_bit_exact(slurm_cluster: SlurmCluster) -> None:
    wd = slurm_cluster.workdir / "lightning"
    wd.mkdir()
    train_args = ["--steps", str(STEPS), "--seed", str(SEED)]
    ref = reference_hash(run_ranks(2, "-m", "mpi4py", str(TRAIN), *train_args, "--policy", f"fixed:{EVERY}",
                                   "--ckpt-dir", str(wd / "ref"), timeout=300).stdout)
    ckpt = wd / "ckpt"
    p = slurm_cluster.cli("coci_hpc.cli.submit", "--partition", "gpu", "--nodes", "2", "--time", "2",
                          "--signal-lead", "60", "--job-name", "lightning", "--output-dir", str(wd / "run"),
                          "--ckpt-dir", str(ckpt), "--policy", f"fixed:{EVERY}", str(TRAIN), *train_args,
                          "--step-time", str(STEP_TIME), cwd=wd)
    assert p.returncode == 0, p.stdout + p.stderr
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)
    log0 = wd / "run" / "logs" / f"{job}_0_log.out"

    wait_for(lambda: any(e["event"] == "checkpoint" for e in read_events(ckpt)), "the first checkpoint", 240)
    urgent = slurm_cluster.sbatch("-p", "urgent", "-N", "1", "-o", os.devnull, "--wrap", "sleep 1")
    rows = slurm_cluster.wait_gone(job, timeout=420)
    out = log0.read_text() if log0.exists() else ""
    err = (wd / "run" / "logs" / f"{job}_0_log.err").read_text()
    events = read_events(ckpt)
    print(out[-2000:], err[-4000:], rows, *[e for e in events if e["event"] != "losses"], sep="\n")

    assert reference_hash(out) == ref                       # bit-exact with the uninterrupted run
    states = [r["State"] for r in rows]
    assert states[0] in ("REQUEUED", "PREEMPTED") and states[-1] == "COMPLETED" and len(states) >= 3, rows
    starts = [e for e in events if e["event"] == "attempt_start"]
    reasons = [s["prev_end"]["reason"] for s in starts]
    assert reasons[:3] == ["none", "preemption", "time_limit"], reasons
    assert all(r == "time_limit" for r in reasons[3:]), reasons     # a slow machine may need another
    stops = {e["attempt"]: e for e in events if e["event"] == "stop"}
    assert stops[1]["reason"] == "preemption" and stops[2]["reason"] == "time_limit", stops
    for a in (1, 2):                       # a stop saves its step: the next attempt repeats nothing
        assert stops[a]["saved"], stops[a]
        assert starts[a]["resumed_step"] == stops[a]["step"] and starts[a]["steps_lost"] == 0, starts[a]
        k = stops[a]["step"]
        assert [len(re.findall(rf"^step={n} ", out, re.M)) for n in (k, k + 1)] == [1, 1], k
    assert [e for e in events if e["event"] == "end"][-1]["status"] == "completed"
    # coci, not Lightning, handled the signals: no SIGTERM bypass, no hpc_ckpt, no scontrol of Lightning's
    assert "Handling auto-requeue signal" not in err and "auto-requeue switched off" in err
    assert not list(wd.rglob("hpc_ckpt_*.ckpt"))
    assert slurm_cluster.wait_gone(urgent, timeout=60)[-1]["State"] == "COMPLETED"
