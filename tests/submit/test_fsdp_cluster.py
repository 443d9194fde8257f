"""coci-submit end to end with FSDP2 on the local cluster: examples/train_fsdp.py on 2 nodes of `gpu`
(each rank saves only its own shards of the DTensor parameters and Adam moments), preempted once by an
`urgent` job after its first checkpoint, ends bit-identical to an uninterrupted `mpiexec -n 2` run;
coci-status tells the story. The FSDP2 twin of test_submit_cluster.py."""
from __future__ import annotations

import json
import os
import re

import pytest

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.runtime.events import read_events
from tests.conftest import FINAL_HASH_RE, ROOT, SlurmCluster, reference_run_later, wait_for

pytestmark = pytest.mark.slurm

TRAIN = ROOT / "examples" / "train_fsdp.py"
# Few, cheap steps; --step-time keeps the job running >= 13 s after its first checkpoint (step EVERY),
# the margin test_submit_cluster.py has shown the preemption needs to land before the end. (The
# reference run, 200 steps with no --step-time, took 21 s under mpiexec -n 2 on the 2-core dev box.)
STEPS, EVERY, SEED, STEP_TIME = 200, 25, 5, "0.075"


def test_coci_submit_fsdp2_preempted_once_resumes_bit_exactly(slurm_cluster: SlurmCluster) -> None:
    wd = slurm_cluster.workdir / "submit-fsdp"
    wd.mkdir()
    train_args = ["--steps", str(STEPS), "--seed", str(SEED)]
    # The uninterrupted run trains in the background while the job waits on Slurm; its hash is compared at the end.
    ref_run = reference_run_later(2, "-m", "mpi4py", str(TRAIN), *train_args, "--policy", f"fixed:{EVERY}",
                                  ckpt_dir=wd / "ref", timeout=300)

    ckpt = wd / "ckpt"
    p = slurm_cluster.cli("coci_hpc.cli.submit", "--partition", "gpu", "--nodes", "2", "--time", "10",
                          "--signal-lead", "60", "--job-name", "fsdp-e2e", "--output-dir", str(wd / "run"),
                          "--ckpt-dir", str(ckpt), "--policy", f"fixed:{EVERY}", str(TRAIN), *train_args,
                          "--step-time", STEP_TIME, cwd=wd)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"submitted job (\d+)", p.stdout)
    assert m, p.stdout
    job = m.group(1)
    log0 = wd / "run" / "logs" / f"{job}_0_log.out"
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
    assert states[-1] == "COMPLETED" and states[0] in ("REQUEUED", "PREEMPTED") and len(states) == 2, rows
    ref_hash = FINAL_HASH_RE.findall(ref_run.result().stdout)[-1]
    assert FINAL_HASH_RE.findall(text)[-1] == ref_hash   # bit-exact with the uninterrupted run
    assert "Caught signal" not in err and "Job not requeued" not in err, err[-2000:]
    assert slurm_cluster.wait_gone(urgent, timeout=60)[-1]["State"] == "COMPLETED"

    # The checkpoints hold sharded state: one global dataset per parameter, each rank its rows.
    last = cat.latest_step(ckpt)
    assert last is not None and last >= EVERY
    dt = {t["name"]: t for t in cat.read_step(ckpt, last)["tensors"] if t["kind"] == "dtensor"}
    w = dt["replicated/model/0.weight"]
    assert w["shape"] == [64, 16] and sorted(b[0] for b in w["boxes"]) == [0, 1]
    assert any(k.startswith("replicated/optimizer/") for k in dt)
    starts = [e for e in read_events(ckpt) if e["event"] == "attempt_start"]
    assert len(starts) == 2 and starts[-1]["resumed_step"] >= EVERY

    st = slurm_cluster.cli("coci_hpc.cli.status", str(ckpt), "--json", cwd=wd)
    assert st.returncode == 0, st.stderr
    h = json.loads(st.stdout)
    print(json.dumps(h["attempts"], indent=1))
    att = h["attempts"]
    assert len(att) >= 2 and att[0]["ended"] == "preemption" and att[-1]["ended"] == "completed"
    assert att[0]["sacct_state"] == states[0] and att[-1]["sacct_state"] == "COMPLETED"
    assert att[1]["prev_end"]["reason"] == "preemption"
    assert att[1]["steps_lost"] is not None and att[1]["steps_lost"] <= 1   # the stop checkpoint saved
    assert h["status"] == "completed" and h["final_step"] == STEPS
    assert sorted(set(h["losses"]["steps"])) == list(range(1, STEPS + 1))
    assert any(c["kind"] == "stop" for c in h["checkpoints"])
