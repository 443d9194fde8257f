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


def _spin(seconds: float) -> None:
    """Use ``seconds`` of this thread's CPU (not wall time: a sleep uses none)."""
    c0 = time.thread_time()
    while time.thread_time() - c0 < seconds:
        pass


def test_writer_reports_the_cpu_of_each_of_its_threads(tmp_path, monkeypatch):
    """CPU seconds, each in the thread that spent them: the checksums' in the checksum thread
    (``crc_cpu_s``), not in the writing thread, which only waits for them (issue 33: what a
    background persist takes from training on busy cores)."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 4096)
    real = rawio.checksum

    def slow_checksum(buf, kind):
        _spin(0.15)
        return real(buf, kind)

    monkeypatch.setattr(rawio, "checksum", slow_checksum)
    rawio.write_posix(path, [WriteItem(0, np.ones(4096, np.uint8))])
    t = rawio.last_write_times()
    assert t["crc_cpu_s"] >= 0.14, t
    assert 0.0 <= t["write_cpu_s"] < 0.1, t


def test_async_save_reports_the_cpu_of_its_persist(tmp_path, monkeypatch):
    """``async_stats`` names the persist's CPU per part: a snapshot copy made to cost 0.15 s of
    CPU shows as ``persist_copy_cpu_s``, a slow checksum as ``persist_crc_cpu_s``."""
    import torch

    from coci_hpc.checkpoint import twophase

    real_copy, real_sum = twophase.copy_bytes, rawio.checksum

    def slow_copy(*a, **kw):
        _spin(0.15)
        return real_copy(*a, **kw)

    def slow_checksum(buf, kind):
        _spin(0.05)
        return real_sum(buf, kind)

    monkeypatch.setattr(twophase, "copy_bytes", slow_copy)
    monkeypatch.setattr(rawio, "checksum", slow_checksum)
    model = torch.nn.Linear(512, 512)   # 1 MiB weight: copied by the background thread
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    mgr = CheckpointManager(tmp_path / "ck")
    try:
        assert mgr.save_async(1, {"model": model, "optimizer": opt}) == "started"
        mgr.wait()
        st = mgr.async_stats
    finally:
        mgr.close()
    assert st["persist_copy_cpu_s"] >= 0.14, st
    assert st["persist_crc_cpu_s"] >= 0.05, st
    assert st["persist_write_cpu_s"] >= 0.0, st
    # each part's CPU is its own thread's: not more than the persist's wall time
    assert st["persist_copy_cpu_s"] <= st["persist_s"] + 0.01, st
