"""A retired step's data file written over by the next save (checkpoint/spare.py, issue 33): the
recycled file is the file a fresh save makes, byte for byte; loads are bit-exact; it is never done
on Lustre, a full disk frees it, and a spare that cannot be used leaves the fresh file."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, lustre, spare
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def _state(seed: int, rows: int = 64) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(rows, 48), torch.nn.Linear(48, 7))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {"model": model, "extra": torch.randn(1000, generator=g, dtype=torch.float64)}


def _data(root: Path, step: int) -> Path:
    return cat.step_dir(root, step) / mf.DATA_FILE


def _spares(root: Path) -> list[Path]:
    p = cat.spare_path(root)
    return [p] if p.exists() else []


def _bytes_at(comm: Any, path: Path) -> bytes:
    comm.barrier()
    return path.read_bytes()


@pytest.mark.parametrize("grow", [False, True], ids=["same-layout", "layout-changed"])
def test_the_next_save_writes_over_the_retired_file_and_makes_the_fresh_file_byte_for_byte(
        comm: Any, shared_dir: Path, grow: bool) -> None:
    a, b = shared_dir / "recycled", shared_dir / "fresh"
    mgr = CheckpointManager(a, comm=comm, keep=1)
    mgr.save(1, _state(1))
    ino1 = os.stat(_data(a, 1)).st_ino if comm.rank == 0 else None
    mgr.save(2, _state(2))
    catalog_root = a
    if comm.rank == 0:
        cat.wait_for_deletions()
        kept = _spares(catalog_root)
        assert len(kept) == 1 and kept[0].stat().st_ino == ino1   # step 1's file, not deleted
    # step 3 (bigger when ``grow``: a changed layout) goes into step 1's blocks
    final = _state(3, rows=96 if grow else 64)
    mgr.save(3, final)
    if comm.rank == 0:
        assert os.stat(_data(a, 3)).st_ino == ino1
        assert [p.stat().st_ino for p in _spares(a)] != [ino1]   # step 2's file is the spare now
    # the same state saved with no spare: the same file, byte for byte (every dataset byte is
    # written by the save; everything else carried over from HDF5's fresh file), but for the
    # times HDF5 stamps into its object headers: the bytes two fresh saves a second apart differ in
    CheckpointManager(b, comm=comm, keep=1).save(3, final)
    time.sleep(1.1)
    CheckpointManager(shared_dir / "fresh2", comm=comm, keep=1).save(3, final)
    got, want = _bytes_at(comm, _data(a, 3)), _bytes_at(comm, _data(b, 3))
    stamps = {i for i, (x, y) in enumerate(zip(want, _data(shared_dir / "fresh2", 3).read_bytes())) if x != y}
    assert len(got) == len(want) and len(stamps) < 64
    assert [i for i, (x, y) in enumerate(zip(got, want)) if x != y and i not in stamps] == []
    target = _state(99, rows=96 if grow else 64)
    mgr.load(3, target)
    for (n, p), q in zip(target["model"].state_dict().items(), final["model"].state_dict().values()):
        assert torch.equal(p, q), n
    assert torch.equal(target["extra"], final["extra"])
    comm.barrier()


def test_no_spare_on_lustre_and_a_full_disk_frees_the_spare(
        comm: Any, shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = shared_dir / "ckpt"
    mgr = CheckpointManager(root, comm=comm, keep=1)
    for s in (1, 2):
        mgr.save(s, _state(s))
    if comm.rank == 0:
        assert len(_spares(root)) == 1
        freed = cat.StepCatalog(root).free_space()
        assert any(f == cat.SPARE_FILE for f in freed) and _spares(root) == []
    comm.barrier()
    # Lustre: striping is fixed at a file's creation, so a retired file is never kept nor reused
    real = lustre.decide
    monkeypatch.setattr(lustre, "decide", lambda _l, *a, **k: real(True, *a, **k))
    other = shared_dir / "lustre"
    m2 = CheckpointManager(other, comm=comm, keep=1)
    for s in (1, 2, 3):
        m2.save(s, _state(s))
    if comm.rank == 0:
        assert _spares(other) == []
    comm.barrier()


def test_a_spare_that_cannot_be_made_the_file_is_dropped_and_the_save_is_right(
        comm: Any, shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = shared_dir / "ckpt"
    mgr = CheckpointManager(root, comm=comm, keep=1)
    for s in (1, 2):
        mgr.save(s, _state(s))

    def no_punch(*_: Any) -> None:
        raise OSError(95, "fallocate(PUNCH_HOLE): Operation not supported")

    monkeypatch.setattr(spare, "_punch", no_punch)
    final = _state(3)
    mgr.save(3, final)
    if comm.rank == 0:
        assert not list(cat.step_dir(root, 3).glob(".*spare*"))   # the half-made spare is gone
    target = _state(7)
    mgr.load(3, target)
    assert torch.equal(target["extra"], final["extra"])
    comm.barrier()


def test_regions_and_punching_on_this_filesystem(tmp_path: Path) -> None:
    """The two calls the carry needs (SEEK_DATA / SEEK_HOLE, fallocate PUNCH_HOLE) do what it
    assumes on the test's filesystem: a punched range reads as zeros, the rest is kept."""
    p = tmp_path / "f"
    p.write_bytes(b"\x07" * (1 << 20))
    fd = os.open(p, os.O_RDWR)
    try:
        spare._punch(fd, 4096, 8192 * 4)
        regions = list(spare._regions(fd, 1 << 20))
    finally:
        os.close(fd)
    data = p.read_bytes()
    assert data[:4096] == b"\x07" * 4096 and data[4096:8192 * 4] == bytes(8192 * 4 - 4096)
    assert data[8192 * 4:] == b"\x07" * ((1 << 20) - 8192 * 4)
    assert (4096, 8192 * 4, False) in regions and regions[0] == (0, 4096, True)
    assert list(spare._minus(0, 100, [(10, 20), (50, 60)])) == [(0, 10), (20, 50), (60, 100)]


def test_carry_makes_the_spare_the_fresh_file_outside_the_datasets(tmp_path: Path) -> None:
    """Old bytes of the spare where the fresh file has holes (padding, a layout that moved) are
    punched out, its written bytes copied, its length taken; only the datasets keep old bytes
    (the save writes them)."""
    fresh, old = tmp_path / "fresh", tmp_path / "spare"
    with open(fresh, "wb") as f:
        f.write(b"\x01" * 3000)          # metadata at the start
        f.seek(40960 - 100)
        f.write(b"\x02" * 100)           # and at the end; holes between
    old.write_bytes(b"\x07" * 65536)     # longer, full of an old step's bytes
    spare.carry(fresh, old, [(8192, 4096), (20480, 5000)])
    got, want = old.read_bytes(), fresh.read_bytes()
    assert len(got) == len(want) == 40960
    inside = set(range(8192, 12288)) | set(range(20480, 25480))
    assert all(got[i] == 7 for i in inside)
    assert [i for i in range(len(got)) if i not in inside and got[i] != want[i]] == []
