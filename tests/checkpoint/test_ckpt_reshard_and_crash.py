"""Resharding 2->1 and 1->2 across real processes; a writer killed before commit."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.cli.ckpt import main as ckpt_main
from tests.checkpoint.conftest import ROOT, SCRIPTS, clean_env, run_ranks
from tests.checkpoint.helpers import canonical, empty_state, full_state

pytestmark = pytest.mark.timeout(180)
JOB = str(SCRIPTS / "ckpt_job.py")


def _result(p: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, p.stdout + p.stderr
    return json.loads(lines[0][len("RESULT "):])


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, dict]]:
    """``written(n)``: step 4 of the test state saved by ``n`` ranks, once per module (the tests
    here only read it): (its directory, what the writers reported)."""
    done: dict[int, tuple[Path, dict]] = {}

    def get(writers: int) -> tuple[Path, dict]:
        if writers not in done:
            root = tmp_path_factory.mktemp(f"written-by-{writers}")
            done[writers] = root, _result(run_ranks(writers, JOB, "write", str(root), "4", "21"))
        return done[writers]

    return get


@pytest.mark.parametrize("writers,readers", [(2, 1), (1, 2)])
def test_checkpoint_written_on_n_ranks_loads_on_m_ranks(written, writers, readers):
    root, wrote = written(writers)
    read = _result(run_ranks(readers, JOB, "read", str(root)))
    assert (wrote["world"], read["world"]) == (writers, readers)
    assert read["step"] == 4
    assert read["hash"] == wrote["hash"]          # model, optimizer, scheduler, scaler, extras...
    assert read["rows"] == wrote["rows"]          # the sharded tensor, re-split over M ranks
    assert cat.read_manifest(cat.step_dir(root, 4))["world_size"] == writers


def test_per_rank_state_on_another_world_size_is_explained(written):
    """PerRank values are each rank's own and never redistributed; a load on another number of
    ranks says which ranks got theirs back, which saved values were left and which ranks are new."""
    tmp_path, _ = written(2)
    fewer = run_ranks(1, JOB, "read", str(tmp_path)).stderr
    assert "saved by 2 rank(s) and is loaded by 1: PerRank state ['mine']" in fewer
    assert "rank(s) 0-0 got their own values back" in fewer and "saved rank(s) [1] were not loaded" in fewer
    more = run_ranks(3, JOB, "read", str(tmp_path)).stderr
    assert "loaded by 3" in more and "rank(s) [2] are new and keep the values they were given" in more
    assert "PerRank" not in run_ranks(2, JOB, "read", str(tmp_path)).stderr


def test_writer_killed_before_commit_leaves_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.Popen([sys.executable, JOB, "die", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT)
    try:
        line = ""
        while "MIDWRITE" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
        assert (cat.step_dir(tmp_path, 2) / mf.DATA_FILE).exists()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert cat.committed_steps(tmp_path) == [1]
    assert not (cat.step_dir(tmp_path, 2) / mf.MANIFEST).exists()
    mgr = CheckpointManager(tmp_path, comm=None)
    assert mgr.latest_step() == 1
    target = empty_state()
    mgr.load_latest(target)
    assert canonical(target["model"]) == canonical(full_state(1)["model"])
    assert ckpt_main(["verify", str(tmp_path)]) == 0
    # The next successful save reuses nothing of the dead one and cleans it up.
    mgr.save(3, full_state(3))
    assert [c.step for c in cat.scan(tmp_path)] == [1, 3]


def test_retention_keeps_last_k_and_deletes_only_after_a_newer_commit(tmp_path, monkeypatch):
    from tests.faults.faulty import patch_writes

    mgr = CheckpointManager(tmp_path, comm=None, keep=2)
    s = full_state(1)
    for step in (10, 20, 30):
        mgr.save(step, s)
    assert [c.step for c in mgr.list()] == [20, 30]
    mgr.close()
    cat.step_dir(tmp_path, 25).mkdir()  # a stale uncommitted leftover (of a crash: the job restarts)
    mgr = CheckpointManager(tmp_path, comm=None, keep=2)
    boom = lambda *a, **k: (_ for _ in ()).throw(OSError("boom"))  # noqa: E731
    patch_writes(boom, monkeypatch.setattr)  # the writer fails
    # ... whichever backend "auto" picked: the MPI-IO one once an earlier test initialised MPI
    from coci_hpc.checkpoint.h5_parallel import ParallelH5Writer
    monkeypatch.setattr(ParallelH5Writer, "write", boom)
    with pytest.raises(Exception, match="boom"):
        mgr.save(40, s)
    assert [c.step for c in mgr.list()] == [20, 30]  # failed save deleted nothing
    monkeypatch.undo()
    mgr.save(50, s)
    assert [c.step for c in cat.scan(tmp_path)] == [30, 50]
    assert mgr.latest_step() == 50
    # Saving the newest committed step again is a no-op (issue 8 #6); going back needs a load.
    assert mgr.save(50, s) == cat.step_dir(tmp_path, 50)
    with pytest.raises(Exception, match="step 50 is newer"):
        mgr.save(30, s)


def test_manifest_commit_is_atomic_and_validated(tmp_path):
    d = tmp_path / "step_000000001"
    d.mkdir()
    mf.commit(d, {"format": mf.FORMAT, "format_version": 1, "step": 1})
    assert [p.name for p in d.iterdir()] == [mf.MANIFEST]
    assert cat.latest_step(tmp_path) == 1
    (d / mf.MANIFEST).write_text('{"format": "coci-ckpt", "format_version": 99}')
    with pytest.raises(Exception, match="newer"):
        cat.read_manifest(d)
    (d / mf.MANIFEST).write_text("{trunc")
    with pytest.raises(Exception, match="does not parse"):
        cat.read_manifest(d)


def test_edited_manifest_is_refused_with_a_clear_error(tmp_path):
    import torch

    from coci_hpc.errors import CheckpointCorrupt

    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(1, {"a": torch.arange(8.0), "b": torch.arange(8.0) + 100})
    path = cat.step_dir(tmp_path, 1) / mf.MANIFEST
    good = json.loads(path.read_text())

    def shard_of_b(m):
        return next(s for s in m["shards"] if s["dataset"].endswith("/b"))

    edits = {
        "not an object": lambda m: [1, 2],
        "no shards": lambda m: m.pop("shards"),
        "no skeletons": lambda m: m.pop("skeletons"),
        "no wall_time": lambda m: m.pop("wall_time"),
        "shard before the dataset": lambda m: shard_of_b(m).update(start=-16, stop=0),
        "stop before start": lambda m: shard_of_b(m).update(start=16, stop=8),
        "file outside the dir": lambda m: [t.update(file="../x.h5") for t in m["tensors"]],
        "nbytes past the dataset": lambda m: [t.update(nbytes=64) for t in m["tensors"]],
    }
    for what, edit in edits.items():
        m = json.loads(json.dumps(good))
        out = edit(m)
        path.write_text(json.dumps(out if isinstance(out, list) else m))
        target = {"a": torch.zeros(8), "b": torch.zeros(8)}
        with pytest.raises(CheckpointCorrupt, match="manifest|dataset") as info:
            mgr.load(1, target)
        assert info.value.hint, what
        assert not target["a"].any() and not target["b"].any(), what   # nothing overwritten
        for cmd in (["verify", str(tmp_path), "1"], ["inspect", str(tmp_path), "1"], ["list", str(tmp_path)]):
            assert ckpt_main(cmd) == 7, (what, cmd)


def test_load_latest_survives_a_concurrent_commit_retiring_the_chosen_step(tmp_path, monkeypatch):
    """Another job commits (keep=1) right after this loader chose "latest": it loads the new one."""
    import torch

    writer = CheckpointManager(tmp_path, comm=None, keep=1)
    writer.save(1, {"a": torch.ones(3)})
    real, fired = cat.read_step, []

    def racing(root, step):
        if not fired:
            fired.append(1)
            writer.save(2, {"a": torch.full((3,), 2.0)})
            cat.wait_for_deletions()
        return real(root, step)

    monkeypatch.setattr(cat, "read_step", racing)
    target = {"a": torch.zeros(3)}
    res = CheckpointManager(tmp_path, comm=None).load_latest(target)
    assert fired and res.step == 2 and torch.equal(target["a"], torch.full((3,), 2.0))
    # An explicitly requested step that is gone is still an error, not a silent substitute.
    from coci_hpc.errors import CheckpointNotFound
    with pytest.raises(CheckpointNotFound):
        CheckpointManager(tmp_path, comm=None).load(1, target)
