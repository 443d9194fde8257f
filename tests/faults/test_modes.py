"""Checkpoint files are 0600 and directories 0700 whatever the umask; ``access=`` shares them
with the group (issue 8: file modes; defect 14: the manifest's mode was hard-coded 0644)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.errors import UsageError


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def _modes(root: Path, step: int) -> dict[str, int]:
    d = cat.step_dir(root, step)
    return {"root": _mode(root), "step": _mode(d), "data": _mode(d / mf.DATA_FILE),
            "manifest": _mode(d / mf.MANIFEST)}


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("access,dirs,files", [("private", 0o700, 0o600), ("group-read", 0o750, 0o640),
                                               ("group-write", 0o770, 0o660)])
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o000])
def test_modes_follow_access_not_the_umask(tmp_path, umask, access, dirs, files, mask):
    umask(mask)
    root = tmp_path / "new" / "ckpt"  # created by the save: gets the mode too
    mgr = CheckpointManager(root, comm=None, access=access)
    mgr.save(1, {"w": torch.ones(3)})
    mgr.save_async(2, {"w": torch.ones(3)})
    mgr.close()
    for step in (1, 2):
        assert _modes(root, step) == {"root": dirs, "step": dirs, "data": files, "manifest": files}


def test_an_existing_root_keeps_its_owners_mode(tmp_path, umask):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o2775)
    CheckpointManager(root, comm=None).save(1, {"w": torch.ones(3)})
    assert _mode(root) == 0o2775 and _modes(root, 1)["step"] == 0o700


def test_unknown_access_is_refused_with_the_valid_list(tmp_path):
    with pytest.raises(UsageError, match="group-read"):
        CheckpointManager(tmp_path, comm=None, access="world")


@pytest.mark.mpi
def test_modes_with_the_parallel_writer(tmp_path_factory):
    from coci_hpc.comm import Comm

    comm = Comm.world()
    base = comm.bcast(str(tmp_path_factory.mktemp("modes")) if comm.rank == 0 else None)
    root = Path(base) / "ckpt"
    old = os.umask(0o022)
    try:
        CheckpointManager(root, comm=comm).save(1, {"w": torch.ones(1000)})
    finally:
        os.umask(old)
    assert _modes(root, 1) == {"root": 0o700, "step": 0o700, "data": 0o600, "manifest": 0o600}
