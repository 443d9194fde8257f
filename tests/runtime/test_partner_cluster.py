"""The partner link on the local cluster: a rank SIGKILLed while its partner streams copies to it
must not take the sender with it. Over MPI it did (Open MPI 4.1's ob1 aborts the sender when a TCP
write to the dead peer fails: ``pml_ob1_sendreq.c:190 FATAL``, exit 255, or a hang until the job's
limit: CI runs ci21 and ci24 of 2026-11-29); :class:`coci_hpc.runtime.partner.PartnerLink` now uses
sockets of its own, where the same failure is an ``OSError`` that marks the link broken."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SlurmCluster

pytestmark = pytest.mark.slurm

SCRIPT = ROOT / "tests" / "runtime" / "scripts" / "partner_kill_job.py"
ROUNDS = 3


def test_a_rank_killed_mid_stream_leaves_its_partner_alive_with_the_link_broken(
        slurm_cluster: SlurmCluster) -> None:
    wd = slurm_cluster.workdir / "partner-kill"
    wd.mkdir()
    log = wd / "job-%j.out"
    # One job, ROUNDS steps one after the other: each kills its rank 1 at a random point of the stream.
    steps = "; ".join(f"srun --mpi=pmix --kill-on-bad-exit=0 {sys.executable} -u {SCRIPT} {wd}/out{i}.json link"
                      for i in range(ROUNDS))
    job = slurm_cluster.sbatch(f"--export=ALL,PYTHONPATH={ROOT}", "-N", "2", "--ntasks-per-node=1", "--time=5",
                               "-o", str(log), "--wrap", steps)
    slurm_cluster.wait_gone(job, timeout=240)
    text = Path(str(log).replace("%j", job)).read_text()
    print(text)
    for i in range(ROUNDS):
        out = wd / f"out{i}.json"
        assert out.exists(), f"round {i}: rank 0 did not live to write its result\n{text}"
        res = json.loads(out.read_text())
        # It sent into the stream, part of it completed, and then the link said why it broke.
        assert res["done"] > 0 and res["sent"] > res["done"], res
        assert res["broken"] and ("reset" in res["broken"].lower() or "pipe" in res["broken"].lower()), res
    assert "FATAL" not in text, text
