"""Acceptance on the local Slurm cluster: the Hugging Face Trainer example on 2 nodes (one rank
each, through the plain sbatch template) is preempted mid-epoch, saves at the next step boundary,
requeues itself, and ends with the parameters of an uninterrupted 2-rank run, having trained on
exactly the batches that run trained on: none twice, none skipped."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from coci_hpc.runtime.events import read_events
from tests.conftest import ROOT, SlurmCluster, reference_hash, run_ranks_later, wait_for

pytestmark = pytest.mark.slurm
pytest.importorskip("transformers")

TRAIN = ROOT / "examples" / "hf_trainer_train.py"
TEMPLATE = ROOT / "slurm" / "templates" / "train_preemptible.sbatch"
# 256 samples, 2 per batch on each of 2 ranks: an epoch is 64 steps. The preemption comes a few
# steps after step 8, so it lands mid-epoch, and the resumed attempt crosses the epoch's end.
STEPS, EVERY, LEAD, PER_EPOCH = 120, 25, 30, 64
BATCH_RE = re.compile(r"^batch step=(\d+) rank=(\d+) idx=([\d,]+)$", re.M)


def _batches(samples: Path) -> dict[int, list[tuple[int, str]]]:
    """Per rank, every (step, sample indices) line it wrote, in order, over all its attempts."""
    return {r: [(int(s), idx) for s, rank, idx in BATCH_RE.findall((samples / f"rank{r}.txt").read_text())
                if int(rank) == r] for r in (0, 1)}


def test_hf_trainer_preempted_mid_epoch_ends_bit_identical_on_the_same_batches(slurm_cluster: SlurmCluster) -> None:
    wd = slurm_cluster.workdir / "hf-trainer"
    wd.mkdir()
    common = ("--steps", str(STEPS), "--policy", f"fixed:{EVERY}", "--batch", "2")
    # The uninterrupted run trains in the background while the job waits on Slurm; read where compared.
    ref = run_ranks_later(2, "-m", "mpi4py", str(TRAIN), *common, "--ckpt-dir", str(wd / "ref"),
                          "--samples-log", str(wd / "ref-samples"), timeout=300)

    ckpt, log = wd / "run", wd / "job-%j.out"
    job = slurm_cluster.sbatch(f"--export=ALL,COCI_SIGNAL_LEAD_S={LEAD}", f"--signal=USR2@{LEAD}", "--time=5",
                               "-o", str(log), str(TEMPLATE), sys.executable, str(TRAIN), *common,
                               "--ckpt-dir", str(ckpt), "--samples-log", str(wd / "samples"), "--step-time", "0.1")
    logfile = Path(str(log).replace("%j", job))
    text = lambda: logfile.read_text() if logfile.exists() else ""  # noqa: E731
    wait_for(lambda: re.search(r"^step=8$", text(), re.M) is not None, "step 8", 240)
    slurm_cluster.sbatch("-p", "urgent", "-N", "1", "-o", os.devnull, "--wrap", "sleep 1")
    rows = slurm_cluster.wait_gone(job, timeout=300)
    out = text()
    events = read_events(ckpt)
    print(out[-3000:], rows, *[e for e in events if e["event"] != "losses"], sep="\n")

    ref_hash = reference_hash(ref.result().stdout)
    assert reference_hash(out) == ref_hash                                  # bit-identical
    assert [r["State"] for r in rows][-1] == "COMPLETED" and len(rows) >= 2, rows
    stop = [e for e in events if e["event"] == "stop"]
    assert [(s["reason"], s["requeued"], s["saved"]) for s in stop] == [("preemption", True, True)], stop
    k = stop[0]["step"]
    assert 8 < k < STEPS and k % PER_EPOCH, k                               # mid-epoch
    start2 = [e for e in events if e["event"] == "attempt_start"][1]
    assert start2["resumed_step"] == k and start2["steps_lost"] == 0, start2
    got, want = _batches(wd / "samples"), _batches(wd / "ref-samples")
    for r in (0, 1):
        assert [s for s, _ in got[r]] == list(range(1, STEPS + 1)), r     # each step once, in order
        assert got[r] == want[r], r                                         # the same samples as uninterrupted
    epoch0 = [int(i) for r in (0, 1) for _, idx in got[r][:PER_EPOCH] for i in idx.split(",")]
    assert sorted(epoch0) == list(range(256))                               # an epoch: every sample once
    assert events[-1]["event"] == "end" and events[-1]["status"] == "completed"
