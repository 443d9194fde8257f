"""Acceptance on the local Slurm cluster: examples/lightning_train.py (Lightning DDP on gloo, 2 nodes)
through coci-submit is preempted once, then runs into its time limit, and ends with the parameters of
an uninterrupted `mpiexec -n 2` run; each stop repeats no step. The same with FSDP2
(``--strategy fsdp2``, CociModelParallelStrategy), preempted once; a job array of two DDP runs."""
from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("lightning.pytorch")

from coci_hpc.runtime.events import read_events  # noqa: E402
from tests.conftest import ROOT, SlurmCluster, reference_hash, reference_run_later, run_ranks, wait_for  # noqa: E402

pytestmark = pytest.mark.slurm

TRAIN = ROOT / "examples" / "lightning_train.py"
# 450 steps of 0.15 s (70 s of steps, more on a loaded machine). With --time 2 and --signal-lead 60
# Slurm's warning comes 35-60 s after an attempt's start, and Lightning's start takes 10-40 s: the
# first attempt is preempted as soon as its session started (before that warning), the second runs
# into the warning (it cannot do the steps left in the at most 50 s it has: 300 steps were too few
# once, CI 2026-11-28, a quiet machine did 297 in 47 s), the third, or on a slow machine a later
# one, finishes (seen here, 2026-11-28, 4 helpers on 2 cores: ~15 s of steps per attempt).
STEPS, EVERY, SEED, STEP_TIME = 450, 50, 4, 0.15


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

    wait_for(lambda: any(e["event"] == "attempt_start" for e in read_events(ckpt)), "the session's start", 240)
    urgent = slurm_cluster.sbatch("-p", "urgent", "-N", "1", "-o", os.devnull, "--wrap", "sleep 1")
    rows = slurm_cluster.wait_gone(job, timeout=600)
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


def test_lightning_fsdp2_preempted_ends_bit_exact(slurm_cluster: SlurmCluster) -> None:
    """FSDP2 through CociModelParallelStrategy, 2 nodes: preempted once as soon as the session
    started (the model's and Adam's DTensor shards saved by each node, Lightning's dict beside
    them), requeued, resumed without repeating a step, and ends with the parameters of an
    uninterrupted run. Short on purpose (CI's time limit; 74 s here, 2026-11-29): 50 steps of
    0.05 s, about 8 s of training (the preemption came at step 2 and 5, 0.7 and 1.8 s after the
    session's start, in two runs here), --time 5, so no time limit is reached."""
    wd = slurm_cluster.workdir / "lightning-fsdp2"
    wd.mkdir()
    train_args = ["--strategy", "fsdp2", "--steps", "50", "--seed", "2"]
    ckpt = wd / "ckpt"
    p = slurm_cluster.cli("coci_hpc.cli.submit", "--partition", "gpu", "--nodes", "2", "--time", "5",
                          "--signal-lead", "60", "--job-name", "lightning-fsdp2", "--output-dir", str(wd / "run"),
                          "--ckpt-dir", str(ckpt), "--policy", "fixed:25", str(TRAIN), *train_args,
                          "--step-time", "0.05", cwd=wd)
    assert p.returncode == 0, p.stdout + p.stderr
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)
    # the uninterrupted run, meanwhile (its two ranks share the CPU with the job's: nothing here is timed)
    ref = reference_run_later(2, "-m", "mpi4py", str(TRAIN), *train_args, "--policy", "fixed:25",
                              ckpt_dir=wd / "ref", timeout=300)
    wait_for(lambda: any(e["event"] == "attempt_start" for e in read_events(ckpt)), "the session's start", 240)
    urgent = slurm_cluster.sbatch("-p", "urgent", "-N", "1", "-o", os.devnull, "--wrap", "sleep 1")
    rows = slurm_cluster.wait_gone(job, timeout=300)
    log0 = wd / "run" / "logs" / f"{job}_0_log.out"
    out = log0.read_text() if log0.exists() else ""
    err = (wd / "run" / "logs" / f"{job}_0_log.err").read_text()
    events = read_events(ckpt)
    print(out[-2000:], err[-4000:], rows, *[e for e in events if e["event"] != "losses"], sep="\n")

    assert reference_hash(out) == reference_hash(ref.result().stdout)    # bit-exact with the uninterrupted run
    states = [r["State"] for r in rows]
    assert states[0] in ("REQUEUED", "PREEMPTED") and states[-1] == "COMPLETED" and len(states) == 2, rows
    starts = [e for e in events if e["event"] == "attempt_start"]
    assert [s["prev_end"]["reason"] for s in starts] == ["none", "preemption"], starts
    stop = next(e for e in events if e["event"] == "stop")
    assert stop["reason"] == "preemption" and stop["saved"] and 0 < stop["step"] < 50, stop
    assert starts[1]["resumed_step"] == stop["step"] and starts[1]["steps_lost"] == 0, starts[1]
    k = stop["step"]
    assert [len(re.findall(rf"^step={n} ", out, re.M)) for n in (k, k + 1)] == [1, 1], k
    assert [e for e in events if e["event"] == "end"][-1]["status"] == "completed"
    assert slurm_cluster.wait_gone(urgent, timeout=60)[-1]["State"] == "COMPLETED"


def test_lightning_ddp_job_array_keeps_each_tasks_state(slurm_cluster: SlurmCluster) -> None:
    """Two array tasks of the 2-node DDP run (seeds 0 and 1, one after the other on this 2-node
    cluster) share --ckpt-dir: each checkpoints in its own task<ID> directory, the preempted one
    resumes from its own checkpoint and ends bit-identical to an uninterrupted run of its seed
    (Lightning's own requeue fails for arrays, #15022, and loads another job's hpc_ckpt, #12369)."""
    wd = slurm_cluster.workdir / "lightning-array"
    wd.mkdir()
    steps, every = 120, 20
    ckpt = wd / "ckpt"
    p = slurm_cluster.cli("coci_hpc.cli.submit", "--partition", "gpu", "--nodes", "2", "--time", "5",
                          "--signal-lead", "60", "--array", "0-1", "--job-name", "lightning-array",
                          "--output-dir", str(wd / "run"), "--ckpt-dir", str(ckpt), "--policy", f"fixed:{every}",
                          str(TRAIN), "--steps", str(steps), "--seed", "%a", "--step-time", "0.05", cwd=wd)
    assert p.returncode == 0, p.stdout + p.stderr
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)
    started: list[int] = []

    def a_task_started() -> bool:
        started[:] = [t for t in (0, 1) if any(e["event"] == "attempt_start" for e in read_events(ckpt / f"task{t}"))]
        return bool(started)
    wait_for(a_task_started, "an array task's session", 240)
    hit = started[0]                                        # the task the urgent job preempts
    urgent = slurm_cluster.sbatch("-p", "urgent", "-N", "1", "-o", os.devnull, "--wrap", "sleep 1")
    ref = reference_hash(run_ranks(2, "-m", "mpi4py", str(TRAIN), "--steps", str(steps), "--seed", str(hit),
                                   "--policy", f"fixed:{every}", "--ckpt-dir", str(wd / "ref"), timeout=300).stdout)
    for task in (0, 1):
        rows = slurm_cluster.wait_gone(f"{job}_{task}", timeout=300)
        assert rows[-1]["State"] == "COMPLETED", (task, rows)
    out = {t: (wd / "run" / "logs" / f"{job}_{t}_0_log.out").read_text() for t in (0, 1)}
    events = {t: read_events(ckpt / f"task{t}") for t in (0, 1)}
    print(*[e for t in (0, 1) for e in events[t] if e["event"] != "losses"], sep="\n")

    assert reference_hash(out[hit]) == ref and reference_hash(out[1 - hit]) != ref   # each its own seed and state
    jobs = [{e["job_id"] for e in events[t] if "job_id" in e} for t in (0, 1)]
    assert all(len(j) == 1 for j in jobs) and jobs[0] != jobs[1], jobs             # one job per directory
    stops = [e for e in events[hit] if e["event"] == "stop"]
    starts = [e for e in events[hit] if e["event"] == "attempt_start"]
    assert stops and stops[0]["reason"] == "preemption" and stops[0]["saved"], stops
    assert starts[1]["resumed_step"] == stops[0]["step"] and starts[1]["steps_lost"] == 0, starts
    assert all(e["status"] == "completed" for t in (0, 1) for e in events[t] if e["event"] == "end")
    assert not list(wd.rglob("hpc_ckpt_*.ckpt"))
    assert slurm_cluster.wait_gone(urgent, timeout=60)[-1]["State"] == "COMPLETED"
