"""The memory tier on the local cluster (issue 25's acceptance): examples/train_fsdp.py (FSDP2: a lost
rank's shards exist nowhere else) loses a node the hard way at a random step.

* 2 nodes + 1 spare: the survivor writes the newest memory-tier step from its partner's copy, the
  relaunch loop restarts the ranks in place, at most k steps are lost, and the run ends
  bit-identical to an uninterrupted one; the event log and coci-status say the memory tier served.
* 3 nodes (one rank each, partner = next rank): the nodes of rank 1 AND of its partner (rank 2) fail:
  no copy of rank 1 survives, rank 0 writes nothing, says the disk tier serves, the job is requeued
  and resumes from the last disk checkpoint, bit-identical at the end.

``slurm`` marked (the shared cluster); the 3-node fixture is tests/submit/conftest.py's."""
from __future__ import annotations

import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coci_hpc.runtime.events import read_events
from tests.conftest import FINAL_HASH_RE, ROOT, SlurmCluster, reference_run
from tests.submit.conftest import wait_step

pytestmark = pytest.mark.slurm

TRAIN = ROOT / "examples" / "train_fsdp.py"
STEPS, DISK_EVERY, K, SEED, STEP_TIME = 300, 100, 5, 5, "0.05"


def _env(cluster: SlurmCluster) -> dict[str, str]:
    # k fixed (not planned) so that "at most k steps lost" is a number the test knows
    return {**cluster.env, "PYTHONPATH": str(ROOT), "COCI_MEMTIER_K": str(K)}


def _submit(cluster: SlurmCluster, wd: Path, *args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "coci_hpc.cli.submit", "--partition", "gpu", "--time", "10",
                        "--signal-lead", "60", "--output-dir", str(wd / "run"), *args],
                       capture_output=True, text=True, env=_env(cluster), cwd=wd, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return re.search(r"submitted job (\d+)", p.stdout).group(1)


def _reference(wd: Path, ranks: int) -> str:
    ref = reference_run(ranks, "-m", "mpi4py", str(TRAIN), "--steps", str(STEPS), "--seed", str(SEED),
                        "--policy", f"fixed:{DISK_EVERY}", ckpt_dir=wd / "ref", timeout=600)
    return FINAL_HASH_RE.findall(ref.stdout)[-1]


def _status(cluster: SlurmCluster, ckpt: Path) -> str:
    st = subprocess.run([sys.executable, "-m", "coci_hpc.cli.status", str(ckpt), "--no-png"], capture_output=True,
                        text=True, env=_env(cluster), timeout=120)
    assert st.returncode == 0, st.stdout + st.stderr
    print(st.stdout)
    return st.stdout


def test_fsdp2_node_lost_resumes_from_the_memory_tier_bit_exact(three_nodes: SlurmCluster) -> None:
    cluster = three_nodes
    wd = cluster.workdir / "memtier"
    wd.mkdir()
    ref_hash = _reference(wd, 2)
    ckpt = wd / "ckpt"
    job = _submit(cluster, wd, "--nodes", "2", "--spare-nodes", "1", "--job-name", "memtier", "--ckpt-dir",
                  str(ckpt), "--policy", f"fixed:{DISK_EVERY}", str(TRAIN), "--steps", str(STEPS), "--seed",
                  str(SEED), "--step-time", STEP_TIME)
    log0 = wd / "run" / "logs" / f"{job}_0_log.out"
    # A random step past the first disk checkpoint and well before the second: the memory tier's
    # step is newer than the disk's, so the test tells which one served.
    target = random.randint(DISK_EVERY + 2 * K, 2 * DISK_EVERY - 3 * K)
    wait_step(log0, target, timeout=240, cluster=cluster)
    try:
        cluster.run(str(cluster.devcluster), "fail", "n2", "--hard", "--delay", "1")   # rank 1's node
        rows = cluster.wait_gone(job, timeout=400)
    finally:
        cluster.run(str(cluster.devcluster), "recover", "n2", check=False)
    out = log0.read_text()
    err = (wd / "run" / "logs" / f"{job}_0_log.err").read_text()
    print(out[-2000:], err[-4000:], rows, sep="\n")
    states = [r["State"] for r in rows]
    assert states[-1] == "COMPLETED" and set(states) <= {"RESIZING", "COMPLETED"}, rows   # in place
    assert FINAL_HASH_RE.findall(out)[-1] == ref_hash
    events = read_events(ckpt)
    lost = [e for e in events if e["event"] == "peer_lost"]
    assert len(lost) == 1 and lost[0]["committed"] and lost[0]["tier"] == "memory", lost
    assert lost[0]["lost_ranks"] == [1] and lost[0]["step"] % K == 0 and lost[0]["step"] > DISK_EVERY, lost
    starts = [e for e in events if e["event"] == "attempt_start"]
    assert starts[0]["memory_tier_every"] == K
    assert starts[1]["resumed_step"] == lost[0]["step"]
    # at most k steps lost (plus the step the failure cut short)
    assert starts[1]["steps_lost"] is not None and starts[1]["steps_lost"] <= K + 1, starts[1]
    text = _status(cluster, ckpt)
    assert f"survivors' checkpoint from the memory tier of step {lost[0]['step']} committed" in text


def test_fsdp2_rank_and_partner_lost_falls_back_to_the_disk_tier(three_nodes: SlurmCluster) -> None:
    cluster = three_nodes
    wd = cluster.workdir / "memtier-both"
    wd.mkdir()
    ref_hash = _reference(wd, 3)
    ckpt = wd / "ckpt"
    # 3 nodes, one rank each: rank r's partner is rank r+1 mod 3; rank 1's copy lives on rank 2.
    job = _submit(cluster, wd, "--nodes", "3", "--job-name", "memtier2", "--ckpt-dir", str(ckpt),
                  "--policy", f"fixed:{DISK_EVERY}", str(TRAIN), "--steps", str(STEPS), "--seed", str(SEED),
                  "--step-time", STEP_TIME)
    log0 = wd / "run" / "logs" / f"{job}_0_log.out"
    wait_step(log0, random.randint(DISK_EVERY + 2 * K, 2 * DISK_EVERY - 3 * K), timeout=240, cluster=cluster)
    try:
        # both at once: one command after the other, the survivors of n2's loss (ranks 0 and 2, which
        # holds rank 1's copy) saved and committed before n3 died (CI 2026-12-01)
        cluster.run(str(cluster.devcluster), "fail", "n2", "n3", "--hard", "--delay", "1")
        _wait_for_peer_lost(ckpt, 120)
    finally:
        # the requeued job needs 3 nodes again
        cluster.run(str(cluster.devcluster), "recover", "n2", check=False)
        cluster.run(str(cluster.devcluster), "recover", "n3", check=False)
    rows = cluster.wait_gone(job, timeout=600)
    out = log0.read_text()
    print(out[-2000:], rows, sep="\n")
    assert rows[-1]["State"] == "COMPLETED" and rows[0]["State"] in ("REQUEUED", "NODE_FAIL"), rows
    assert FINAL_HASH_RE.findall(out)[-1] == ref_hash
    events = read_events(ckpt)
    lost = [e for e in events if e["event"] == "peer_lost"]
    assert len(lost) == 1 and not lost[0]["committed"] and lost[0]["tier"] == "disk", lost
    assert "disk tier" in lost[0]["reason"] and lost[0]["fallback_step"] == DISK_EVERY, lost
    starts = [e for e in events if e["event"] == "attempt_start"]
    assert starts[1]["resumed_step"] == DISK_EVERY
    # the lost ranks are named (n2 ran rank 1, n3 rank 2), not "?": no copy came from a partner
    assert lost[0]["lost"] == [1, 2] and not lost[0]["lost_ranks"], lost
    assert "rank(s) [1, 2] lost after step" in starts[1]["prev_end"]["detail"], starts[1]
    text = _status(cluster, ckpt)
    assert f"fell back to step {DISK_EVERY} (the disk tier served)" in text
    assert "rank(s) [1, 2] were lost after step" in text


def _wait_for_peer_lost(ckpt: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(e["event"] == "peer_lost" for e in read_events(ckpt)):
        assert time.monotonic() < deadline, "no peer_lost record"
        time.sleep(0.5)
