"""coci-submit end to end on the local cluster: examples/train.py on 2 nodes of `gpu`, preempted once by
an `urgent` job, ends bit-identical to an uninterrupted `mpiexec -n 2` run; coci-status tells the story."""
from __future__ import annotations

import json
import os
import re

import pytest

from coci_hpc.runtime.events import read_events
from tests.conftest import FINAL_HASH_RE as HASH_RE
from tests.conftest import ROOT, SlurmCluster, reference_run_later, wait_for

pytestmark = pytest.mark.slurm

TRAIN = ROOT / "examples" / "train.py"
STEPS, EVERY, SEED = 300, 50, 3


def test_coci_submit_preempted_once_resumes_bit_exactly(slurm_cluster: SlurmCluster) -> None:
    wd = slurm_cluster.workdir / "submit-e2e"
    wd.mkdir()
    train_args = ["--steps", str(STEPS), "--seed", str(SEED)]
    # The uninterrupted run trains in the background while the job waits on Slurm; its hash is compared at the end.
    ref_run = reference_run_later(2, "-m", "mpi4py", str(TRAIN), *train_args, "--policy", f"fixed:{EVERY}",
                                  ckpt_dir=wd / "ref", timeout=300)

    ckpt = wd / "ckpt"
    p = slurm_cluster.cli("coci_hpc.cli.submit", "--partition", "gpu", "--nodes", "2", "--time", "10",
                          "--signal-lead", "60", "--job-name", "e2e", "--output-dir", str(wd / "run"),
                          "--ckpt-dir", str(ckpt), "--policy", f"fixed:{EVERY}", str(TRAIN), *train_args,
                          "--step-time", "0.05", cwd=wd)
    assert p.returncode == 0, p.stdout + p.stderr
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)
    log0 = wd / "run" / "logs" / f"{job}_0_log.out"
    assert f"rank 0 log     {log0}" in p.stdout and f"coci-status {ckpt}" in p.stdout
    script = (wd / "run" / "logs" / f"{job}_submission.sh").read_text()
    assert "#SBATCH --signal=USR2@60" in script and "--mpi=pmix" in script

    # Preempt after the first planned checkpoint, well before the end.
    wait_for(lambda: any(e["event"] == "checkpoint" for e in read_events(ckpt)), "the first checkpoint", 180)
    urgent = slurm_cluster.sbatch("-p", "urgent", "-N", "1", "-o", os.devnull, "--wrap", "sleep 1")
    rows = slurm_cluster.wait_gone(job, timeout=300)
    text = log0.read_text() if log0.exists() else ""
    err = (wd / "run" / "logs" / f"{job}_0_log.err").read_text()
    print(text[-3000:], err[-3000:], rows, sep="\n")
    states = [r["State"] for r in rows]
    # The Session requeues itself inside the grace time (REQUEUED); had it not, Slurm would say PREEMPTED.
    assert states[-1] == "COMPLETED" and states[0] in ("REQUEUED", "PREEMPTED") and len(states) == 2, rows
    ref_hash = HASH_RE.findall(ref_run.result().stdout)[-1]
    assert HASH_RE.findall(text)[-1] == ref_hash  # bit-exact with the uninterrupted run
    # submitit's own USR2 handler never ran (it would log "Caught signal ... this job is ...").
    assert "Caught signal" not in err and "Job not requeued" not in err, err[-2000:]
    assert slurm_cluster.wait_gone(urgent, timeout=60)[-1]["State"] == "COMPLETED"

    st = slurm_cluster.cli("coci_hpc.cli.status", str(ckpt), "--json", "--png", str(wd / "h.png"), cwd=wd)
    assert st.returncode == 0, st.stderr
    h = json.loads(st.stdout)
    print(json.dumps(h["attempts"], indent=1))
    att = h["attempts"]
    assert len(att) >= 2 and att[0]["ended"] == "preemption" and att[-1]["ended"] == "completed"
    assert att[0]["sacct_state"] == states[0] and att[-1]["sacct_state"] == "COMPLETED"
    assert att[1]["prev_end"]["reason"] == "preemption"
    assert att[1]["steps_lost"] is not None and att[1]["steps_lost"] <= 1   # preemption repeats at most a step
    lat = att[1]["restart_latency_s"]
    assert lat["total"] > 0 and lat["slurm_requeue_s"] is not None and lat["restore_s"] is not None
    assert h["status"] == "completed" and h["final_step"] == STEPS
    assert sorted(set(h["losses"]["steps"])) == list(range(1, STEPS + 1))
    assert any(c["kind"] == "stop" for c in h["checkpoints"])
    assert (wd / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    st = slurm_cluster.cli("coci_hpc.cli.status", str(ckpt), "--no-png", cwd=wd)
    assert st.returncode == 0, st.stderr
    print(st.stdout)
    rows_txt = [ln for ln in st.stdout.splitlines() if ln[:3].strip().isdigit()]
    assert "preemption [session]" in rows_txt[0] and states[0] in rows_txt[0]
    assert "config conflict" not in err  # the policy came from coci-submit's environment alone
    assert "SIGUSR2 received while no training session runs" not in err  # it came during the session
    assert f"status completed at step {STEPS}" in st.stdout
