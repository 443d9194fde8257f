"""Lustre decisions, with a fake `lfs` on PATH and COCI_FORCE_FSTYPE=lustre (test-only)."""
from __future__ import annotations

import os

import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, LustrePolicy, lustre
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.errors import CheckpointError
from tests.checkpoint.conftest import FAKES

MiB = 1 << 20


@pytest.fixture
def fake_lfs(tmp_path, monkeypatch):
    log = tmp_path / "lfs.log"
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LFS_LOG", str(log))
    return log


def test_this_machine_is_not_lustre_by_statfs(tmp_path, monkeypatch):
    monkeypatch.delenv(lustre.FORCE_ENV, raising=False)
    magic = lustre.fs_magic(tmp_path)
    assert magic is not None and magic != lustre.LUSTRE_SUPER_MAGIC
    assert not lustre.is_lustre(tmp_path)
    monkeypatch.setenv(lustre.FORCE_ENV, "lustre")
    assert lustre.is_lustre(tmp_path)


def test_decisions_are_pure_and_differ_on_lustre():
    plain = lustre.decide(False, LustrePolicy(), 4, "/usr/bin/lfs")
    assert not plain.lustre and plain.setstripe is None and plain.align == 4096
    on = lustre.decide(True, LustrePolicy(stripe_count=8, stripe_size=4 * MiB), 4, "/usr/bin/lfs")
    assert on.setstripe == ["/usr/bin/lfs", "setstripe", "-c", "8", "-S", str(4 * MiB)]
    assert on.align == on.align_threshold == 4 * MiB
    assert on.mpi_hints["striping_factor"] == "8" and on.mpi_hints["striping_unit"] == str(4 * MiB)
    assert on.mpi_hints["romio_cb_write"] == "enable" and on.mpi_hints["cb_nodes"] == "4"
    no_lfs = lustre.decide(True, LustrePolicy(), 2, None)
    assert no_lfs.setstripe is None and "striping_factor" not in no_lfs.mpi_hints  # count -1: all OSTs


def test_mpi_info_carries_the_hints():
    pytest.importorskip("mpi4py")
    info = lustre.mpi_info({"striping_unit": "1048576", "romio_cb_write": "enable"})
    try:
        assert info.Get("striping_unit") == "1048576" and info.Get("romio_cb_write") == "enable"
    finally:
        info.Free()


def test_save_on_forced_lustre_stripes_the_new_directory_and_aligns_datasets(tmp_path, fake_lfs, monkeypatch):
    monkeypatch.setenv(lustre.FORCE_ENV, "lustre")
    mgr = CheckpointManager(tmp_path / "ck", comm=None, lustre=LustrePolicy(stripe_count=4, stripe_size=MiB))
    state = {"w": {"a": torch.ones(300_000), "b": torch.ones(300_000), "tiny": torch.ones(3)}}
    mgr.save(1, state)
    calls = fake_lfs.read_text().splitlines()
    assert calls == [f"setstripe -c 4 -S {MiB} {cat.step_dir(tmp_path / 'ck', 1)}"]
    m = cat.read_manifest(cat.step_dir(tmp_path / "ck", 1))
    assert m["lustre"] is True and m["align"] == MiB
    big = [t for t in m["tensors"] if t["nbytes"] >= MiB]
    assert big and all(t["offset"] % MiB == 0 for t in big)
    target = {"w": {"a": torch.zeros(300_000), "b": torch.zeros(300_000), "tiny": torch.zeros(3)}}
    mgr.load(1, target)
    assert torch.equal(target["w"]["a"], state["w"]["a"])


def test_no_setstripe_off_lustre_even_with_lfs_installed(tmp_path, fake_lfs, monkeypatch):
    monkeypatch.setenv(lustre.FORCE_ENV, "other")
    CheckpointManager(tmp_path, comm=None).save(1, {"x": {"t": torch.ones(10)}})
    assert not fake_lfs.exists()
    assert cat.read_manifest(cat.step_dir(tmp_path, 1))["lustre"] is False


def test_failing_lfs_is_reported_with_its_output(tmp_path, fake_lfs, monkeypatch):
    monkeypatch.setenv(lustre.FORCE_ENV, "lustre")
    monkeypatch.setenv("FAKE_LFS_FAIL", "Disk quota exceeded")
    with pytest.raises(CheckpointError, match="Disk quota exceeded"):
        CheckpointManager(tmp_path, comm=None).save(1, {"x": {"t": torch.ones(10)}})
    assert cat.committed_steps(tmp_path) == []
