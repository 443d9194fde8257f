"""HSDP (2-D mesh: replicate x shard, 2 x 2 on 4 ranks) and a lost rank: the survivors' save
(:func:`coci_hpc.runtime.memtier.survivors_save`) writes a checkpoint that loads bit-exactly
(full tensors gathered with ``full_tensor()``) and trains on as the uninterrupted run did.

Real processes (``mpiexec -n 4 --oversubscribe``, gloo, real ``fully_shard`` on a 2-D mesh); the
"lost" rank stops taking part as in :mod:`tests.runtime.test_memtier` (its memory is gone; the
survivors save without any collective), then every rank loads the result into a fresh model."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coci_hpc.checkpoint import catalog as cat
from tests.conftest import clean_env, run_ranks

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "memtier_job.py")


def job(n: int, *args: Any, rpn: int = 1) -> list[dict[str, Any]]:
    env = clean_env(MEMTIER_JOB_RPN=str(rpn), MEMTIER_JOB_MESH="hsdp")
    out = run_ranks(n, SCRIPT, *map(str, args), timeout=300, env=env).stdout
    line = next(l for l in out.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("lost", ["1", "2"])
def test_hsdp_rank_lost_survivors_checkpoint_loads_bit_exactly_and_resumes(tmp_path: Path, lost: str) -> None:
    # a memory-tier copy every 2 steps; the rank is lost in step 6 (5 done): step 4 is saved,
    # one finished step is lost (the survivors' save writes the newest step every rank's state is held for)
    res = job(4, "recover", tmp_path, 2, 5, lost)
    for r in res:   # every copy taken in by the partner's next boundary, none skipped (as in test_memtier)
        assert r["skipped"] == 0, r
        assert r["seen"][2] == 2 and r["seen"][3] in (2, 4) and r["seen"][4] == 4, (r["rank"], r["seen"])
    writers = [r["outcome"] for r in res if "outcome" in r and r["outcome"]["writer"]]
    assert len(writers) == 1
    w = writers[0]
    assert w["committed"] and w["tier"] == "memory" and w["step"] == 4, w
    assert int(lost) in w["from_partner"]  # the lost rank's state: its partner's copy (others may be too)
    # the rank that is gone; a live rank whose own copy had not arrived when the step was whole
    # (4 ranks on 2 loaded cores: CI, 29 Nov, rank 3 beside rank 1) is counted too, and its state
    # came from its partner like the lost one's: the checkpoint is the same
    assert int(lost) in w["lost"] and set(w["lost"]) <= set(w["from_partner"]), w
    if w["lost"] != [int(lost)]:
        print("a live rank was slower than the step's last partner copy:", w["lost"])
    m = cat.read_step(tmp_path, 4)
    assert m["survivors_save"] is True and m["world_size"] == 4
    # each HSDP shard once in the file (two replicas hold each; the survivors write one)
    fc1 = next(t for t in m["tensors"] if t["name"] == "replicated/model/fc1.weight")
    assert fc1["kind"] == "dtensor" and len(fc1["boxes"]) == 2
    for r in res:
        assert r["loaded_step"] == 4                     # the step every rank finished: none lost
        assert r["loaded"] == r["expected"]              # gathered full tensors, bit for bit
        assert r["resumed"] is True                      # step 5 again from it: the run's step 5

