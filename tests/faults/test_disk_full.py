"""Disk full (issue 8 #13) on a small tmpfs: 1 and 2 ranks, sync and async, both policies.

The filesystem holds two 4 MiB checkpoints but not three, and keep=2 needs keep+1 during a
save. ``on_no_space="raise"``: a clear CheckpointError, the previous checkpoint intact and
loadable, no partial step left. ``"retire_oldest"``: the oldest checkpoint is deleted and the
save retried once, so training goes on.
"""
from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from tests.faults.test_exit import launch, results

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def small_fs(tmp_path: Path):
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=11m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    assert p.returncode == 0, f"this scenario needs root to mount a tmpfs: {p.stderr}"
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("policy", ["raise", "retire_oldest"])
@pytest.mark.parametrize("how", ["sync", "async"])
@pytest.mark.parametrize("ranks", [0, 2])
def test_disk_full(small_fs, ranks, how, policy, record_figure):
    rc, out, _ = launch(ranks, "disk_full", str(small_fs / "ck"), how, policy, timeout=120)
    assert rc == 0, out
    rows = results(out)
    assert len(rows) == max(ranks, 1), out
    for r in rows:
        assert r["intact"], r                       # what is loaded is exactly that step's data
        assert r["entries"] == [f"step_{s:09d}" for s in r["steps"]], r  # no partial step, no temp file
        if policy == "raise":
            assert r["outcome"].startswith("no space left on the device"), r
            assert r["names_option"], r                               # the hint names the option
            assert r["steps"] == [1, 2] and r["loaded"] == 2, r       # previous checkpoint intact
        else:
            assert r["outcome"] == "committed", r
            assert r["steps"] == [2, 3] and r["loaded"] == 3, r
    record_figure(f"disk full ({policy})", runs=1, committed_short=0,
                  partial_left=sum(r["entries"] != [f"step_{s:09d}" for s in r["steps"]] for r in rows))
