"""A sync save reports its time per phase (``CheckpointManager.stats``), so a slow save names the
phase it was slow in (issue 33): every phase present, none negative, together within the save."""
from __future__ import annotations

import time

import numpy as np

from coci_hpc.checkpoint import CheckpointManager, rawio
from coci_hpc.checkpoint.rawio import WriteItem

PHASES = ("state_s", "plan_s", "create_s", "collect_s", "write_s", "sync_s", "commit_s", "manifest_s")


def test_sync_save_reports_each_phase(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    try:
        mgr.save(1, {"w": np.arange(1 << 16, dtype=np.float32)})
        stats = dict(mgr.stats)
    finally:
        mgr.close()
    assert set(PHASES) <= set(stats), stats
    assert all(stats[k] >= 0.0 for k in PHASES), stats
    assert sum(stats[k] for k in PHASES if k != "manifest_s") <= stats["save_s"] + 1e-3, stats
    assert stats["manifest_s"] <= stats["commit_s"] + 1e-3, stats   # rank 0 seals inside the commit


def test_writer_splits_data_from_sync(tmp_path, monkeypatch):
    """The write's own split: a slow fsync shows as ``sync_s``, not as ``write_s``."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 4096)
    real_fsync = rawio.os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(0.2)
        real_fsync(fd)

    monkeypatch.setattr(rawio.os, "fsync", slow_fsync)
    rawio.write_posix(path, [WriteItem(0, np.ones(4096, np.uint8))])
    t = rawio.last_write_times()
    assert t["sync_s"] >= 0.2 and t["write_s"] < 0.2, t
