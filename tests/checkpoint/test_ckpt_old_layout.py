"""Format-2 checkpoints (one HDF5 dataset per rank and per-rank leaf, ``rank00001/...``) still
load after per-rank state was packed. The fixture was written on 2 ranks by the code before the
change (see tests/checkpoint/old_layout_state.py); loading it on any number of ranks reshards
the Sharded rows and gives each saving rank its own per-rank values; a rank beyond the 2 that
saved keeps the per-rank values it was given, and ``LoadResult.missing`` says so there."""
from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, PerRank, Sharded
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.cli.ckpt import main as ckpt_main
from tests.checkpoint.old_layout_state import old_state

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "ckpt_v2_per_rank_datasets"


def _blank(rank: int, world: int) -> dict:
    s = old_state(rank, world)
    return {"model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
            "mine": PerRank({k: torch.zeros_like(v) for k, v in s["mine"].value.items()}),
            "rows": Sharded(torch.zeros_like(s["rows"].local))}  # the saved "step" int is not loaded


def test_a_format_2_checkpoint_with_per_rank_datasets_still_loads(shared_dir, comm):
    root = shared_dir / "old"
    if comm.rank == 0:
        shutil.copytree(FIXTURE, root)
        with h5py.File(root / "step_000000009" / "data.h5", "r") as f:
            assert "rank00001/mine/v" in f  # really the old layout
        assert cat.read_manifest(root / "step_000000009")["format_version"] == 2
        assert ckpt_main(["verify", str(root), "9"]) == 0
    comm.barrier()
    mgr = CheckpointManager(root, comm=comm, rng=False)
    target = _blank(comm.rank, comm.size)
    res = mgr.load_latest(target)
    assert res.step == 9 and res.saved_world_size == 2
    expected = old_state(comm.rank, comm.size)
    for k in ("w", "b"):
        assert torch.equal(target["model"][k], expected["model"][k])
    for k in ("v", "s"):  # rank r's own per-rank values, as rank r saved them
        if comm.rank < 2:
            assert torch.equal(target["mine"].value[k], expected["mine"].value[k])
        else:                 # a new rank: nothing saved for it; it keeps what it was given
            assert not target["mine"].value[k].any()
    assert ("mine" in res.missing) == (comm.rank >= 2), res.missing
    assert torch.equal(target["rows"].local, expected["rows"].local)
    # The next save writes the packed layout (format 3 and later; now 4) next to it.
    mgr.save(10, target)
    m = cat.read_manifest(cat.step_dir(root, 10))
    assert m["format_version"] == 4
    assert [t["dataset"] for t in m["tensors"] if t["kind"] == "per_rank"] == ["per_rank/mine/v", "per_rank/mine/s"]
    mgr.close()
