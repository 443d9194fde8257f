"""The step catalog (issue 15): rank 0 lists the checkpoint root once and keeps the list; a
save's file-system metadata operations are counted and do not grow with the steps kept."""
from __future__ import annotations

import os

import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, catalog
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def listings(monkeypatch):
    """Counts real directory listings (os.scandir / os.listdir), whoever makes them."""
    seen: list[str] = []
    real_scandir, real_listdir = os.scandir, os.listdir

    def scandir(path="."):
        seen.append(str(path))
        return real_scandir(path)

    def listdir(path="."):
        seen.append(str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    return seen


def _saves(root, keep: int, n: int, listings: list[str]) -> list[dict[str, int]]:
    mgr = CheckpointManager(root, comm=None, keep=keep)
    per_save = []
    for step in range(1, n + 1):
        catalog.wait_for_deletions()
        before = catalog.metadata_ops()
        listings.clear()
        mgr.save(step, {"w": torch.full((4,), float(step))})
        assert mgr.latest_step() == step
        after = catalog.metadata_ops()
        per_save.append({k: after[k] - before[k] for k in after} | {"real_listings": len(
            [p for p in listings if os.path.realpath(p).startswith(os.path.realpath(root))])})
    mgr.close()
    return per_save


def test_a_save_lists_the_root_once_then_never_and_its_metadata_ops_do_not_grow_with_keep(tmp_path, listings):
    few = _saves(tmp_path / "keep1", 1, 8, listings)
    many = _saves(tmp_path / "keep5", 5, 8, listings)
    for run in (few, many):
        assert run[0]["listings"] == 1 and run[0]["real_listings"] >= 1   # the first save lists once
        for ops in run[1:]:
            assert ops["listings"] == 0 and ops["real_listings"] == 0, run  # then the catalog knows
    # Steady state (retention removing one step per save): the same count whatever keep is.
    assert few[-1] == many[-1], (few, many)
    assert few[-1]["total"] == few[-2]["total"]
    assert few[-1]["creates"] >= 2 and few[-1]["renames"] >= 2   # step dir + manifest; manifest + trash


def test_the_catalog_follows_rollback_retention_and_partial_leftovers(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    (cat.step_dir(root, 9)).mkdir()                             # a crashed save of an earlier job
    mgr = CheckpointManager(root, comm=None, keep=2)
    s = {"w": torch.zeros(2)}
    for step in (1, 2, 3):
        mgr.save(step, s)
    catalog.wait_for_deletions()
    assert [c.step for c in cat.scan(root)] == [2, 3] and mgr.latest_step() == 3
    mgr.load(2, s)
    mgr.save(4, s)                                             # rollback: 3 moves to abandoned/
    catalog.wait_for_deletions()
    assert [c.step for c in cat.scan(root)] == [2, 4] and mgr.latest_step() == 4
    assert (root / catalog.ABANDONED / "step_000000003" / mf.MANIFEST).is_file()
    mgr.close()
    reader = CheckpointManager(root, comm=None, lock=False)    # a reader lists afresh
    assert reader.latest_step() == 4


def test_one_managers_close_never_waits_for_another_managers_deletions(tmp_path, monkeypatch):
    """Each catalog owns its deletion thread: manager A's retention stuck in a slow delete (a
    loaded file system) does not hold up manager B's saves or close()."""
    import shutil
    import threading
    import time

    gate = threading.Event()
    real_rmtree = shutil.rmtree
    slow = os.path.realpath(tmp_path / "a")

    def rmtree(path, *args, **kwargs):
        if threading.current_thread().name == "coci-retention" and os.path.realpath(path).startswith(slow):
            gate.wait(60)                                   # A's background delete hangs
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(catalog.shutil, "rmtree", rmtree)
    s = {"w": torch.zeros(2)}
    a = CheckpointManager(tmp_path / "a", comm=None, keep=1)
    a.save(1, s)
    a.save(2, s)                                            # retires step 1: A's thread now hangs
    assert a.catalog._reaper is not None and a.catalog._reaper.is_alive()
    t0 = time.monotonic()
    b = CheckpointManager(tmp_path / "b", comm=None, keep=1)
    for step in (1, 2, 3):
        b.save(step, s)
    b.close()
    elapsed = time.monotonic() - t0
    assert elapsed < 20, f"B waited {elapsed:.1f}s for A's deletions"
    assert a.catalog._reaper.is_alive()                     # A's deletion still running meanwhile
    assert [p.name for p in (tmp_path / "b").iterdir() if p.name.startswith(catalog.TRASH_PREFIX)] == []
    gate.set()
    a.close()                                               # A waits for its own
    assert [p.name for p in (tmp_path / "a").iterdir() if p.name.startswith(catalog.TRASH_PREFIX)] == []


def test_the_memory_tiers_staging_holds_copies_by_step_and_is_swept_with_the_survivors(tmp_path):
    """catalog.TierStaging (runtime/memtier.py's survivors' save): copies named by step, rank and
    holder, one claim, the posted copies dropped after a commit; the next attempt's sweep removes
    the directory, which is never reported as a torn survivors' save."""
    st = cat.TierStaging(tmp_path, 12)
    st.post_at(12, 0, 0, b"own12")
    st.post_at(9, 0, 0, memoryview(b"own9"))
    st.post_at(12, 1, 0, b"partner12")
    st.post_at(12, 1, 1, b"its-own12")         # a second copy of rank 1 at 12: the first name wins
    got = st.posted_at()
    assert sorted(got) == [9, 12] and sorted(got[12]) == [0, 1] and list(got[9]) == [0]
    holder, path = got[12][1]
    assert holder == 0 and path.read_bytes() == b"partner12"
    assert got[12][0][0] == 0 and got[9][0][1].read_bytes() == b"own9"
    # the survivors that posted: holder 1 too, though its copy of rank 1 is shadowed in posted_at
    assert st.holders() == {0, 1} and cat.TierStaging(tmp_path, 13).holders() == set()
    assert st.absent(4) == [2, 3] and cat.TierStaging(tmp_path, 13).absent(2) == [0, 1]
    (tmp_path / "dp").mkdir()
    dp = cat.Staging(tmp_path / "dp", 12)
    dp.post(0, 2, b"copy of 0 held by 2")
    dp.post(2, 2, b"own")
    assert dp.holders() == {2}
    assert st.claim() and not cat.TierStaging(tmp_path, 12).claim()
    st.drop_posted()
    assert cat.TierStaging(tmp_path, 12).posted_at() == {} and (st.path / "claim").exists()
    catalog_ = cat.StepCatalog(tmp_path)
    assert catalog_.torn_staging() == []       # not a survivors' save: nothing reported torn
    assert catalog_.sweep_staging() == [] and not st.path.exists()
