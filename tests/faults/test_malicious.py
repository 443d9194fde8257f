"""Crafted checkpoints (issue 8, defect 12 and the suite's "malicious input"): manifests with
``..`` or absolute paths, huge shapes, object dtypes; data files with extra datasets, external or
soft links, a symlinked data.h5 or step directory. Each is refused with a clear
CheckpointCorrupt by ``load(step)`` and skipped (with a warning) by ``load_latest``; nothing
outside the checkpoint directory is read.

Manifest edits are re-sealed with a valid own checksum: they model a crafted file, not damage
(damage is caught earlier by the checksum, see test_corruption.py).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.integrity import seal
from coci_hpc.cli.ckpt import main as ckpt_main
from coci_hpc.errors import CheckpointCorrupt
from tests.checkpoint.helpers import canonical, empty_state, full_state

pytestmark = pytest.mark.timeout(300)



def _crafted(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        path = cat.step_dir(root, 2) / mf.MANIFEST
        m = json.loads(path.read_text())
        fn(m)
        path.write_text(json.dumps(seal(m)))
    return edit


def _weight(m: dict) -> dict:
    return next(t for t in m["tensors"] if t["dataset"] == "replicated/model/fc1.weight")


def _outside_file(root: Path) -> Path:
    """A file outside the checkpoint directory with a dataset of the right name (all zeros)."""
    outside = root.parent / f"{root.name}-outside.h5"
    with h5py.File(outside, "w") as f:
        f.create_dataset("replicated/model/fc1.weight", data=np.zeros((64, 32), np.float32))
    return outside


def _external_link(root: Path) -> None:
    outside = _outside_file(root)
    with h5py.File(cat.step_dir(root, 2) / mf.DATA_FILE, "r+") as f:
        del f["replicated/model/fc1.weight"]
        f["replicated/model/fc1.weight"] = h5py.ExternalLink(str(outside), "replicated/model/fc1.weight")


def _soft_link(root: Path) -> None:
    with h5py.File(cat.step_dir(root, 2) / mf.DATA_FILE, "r+") as f:
        f.create_dataset("elsewhere", data=np.zeros((64, 32), np.float32))
        del f["replicated/model/fc1.weight"]
        f["replicated/model/fc1.weight"] = h5py.SoftLink("/elsewhere")


def _extra_dataset(root: Path) -> None:
    with h5py.File(cat.step_dir(root, 2) / mf.DATA_FILE, "r+") as f:
        f.create_dataset("replicated/model/smuggled", data=np.arange(10))


def _symlinked_data(root: Path) -> None:
    data = cat.step_dir(root, 2) / mf.DATA_FILE
    outside = _outside_file(root)
    data.unlink()
    data.symlink_to(outside)


def _symlinked_step_dir(root: Path) -> None:
    real = root.parent / f"{root.name}-real-step"
    shutil.move(cat.step_dir(root, 2), real)
    cat.step_dir(root, 2).symlink_to(real, target_is_directory=True)


CASES: dict[str, Callable[[Path], None]] = {
    "file name with ..": _crafted(lambda m: (m.update(files=["../x.h5"]),
                                             [t.update(file="../x.h5") for t in m["tensors"]],
                                             [s.update(file="../x.h5") for s in m["shards"]])),
    "absolute file name": _crafted(lambda m: (m.update(files=["/etc/passwd"]),
                                              [t.update(file="/etc/passwd") for t in m["tensors"]],
                                              [s.update(file="/etc/passwd") for s in m["shards"]])),
    "dataset path with ..": _crafted(lambda m: (_weight(m).update(dataset="replicated/../../x"),
                                                [s.update(dataset="replicated/../../x") for s in m["shards"]
                                                 if s["dataset"] == "replicated/model/fc1.weight"])),
    "huge shape": _crafted(lambda m: (_weight(m).update(shape=[1 << 20, 1 << 20], nbytes=(1 << 42)),
                                      [s.update(stop=1 << 42) for s in m["shards"]
                                       if s["dataset"] == "replicated/model/fc1.weight"])),
    "shape and byte count disagree": _crafted(lambda m: _weight(m).update(shape=[64, 64])),
    "object dtype": _crafted(lambda m: _weight(m).update(dtype="numpy.object")),
    "shard checksums dropped": _crafted(lambda m: m.update(shards=m["shards"][1:])),
    "extra HDF5 dataset": _extra_dataset,
    "HDF5 external link": _external_link,
    "HDF5 soft link": _soft_link,
    "data.h5 is a symlink": _symlinked_data,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_checkpoint_is_refused_and_skipped(case, pristine, tmp_path, capfd, record_figure):
    root = tmp_path / "r"
    shutil.copytree(pristine, root)
    CASES[case](root)
    with pytest.raises(CheckpointCorrupt) as info:
        CheckpointManager(root, comm=None).load(2, empty_state())
    assert info.value.hint
    assert ckpt_main(["verify", str(root), "2"]) == 7
    target = empty_state()
    capfd.readouterr()
    res = CheckpointManager(root, comm=None).load_latest(target)
    accepted = int(res.step != 1 or canonical(target) != canonical(full_state(1)))
    record_figure("malicious input (.., absolute, huge shape, object dtype, links, extra datasets)",
                  tried=1, accepted=accepted)
    assert res.step == 1 and not accepted
    assert "step 2" in capfd.readouterr().err


def test_a_symlinked_step_directory_is_not_a_checkpoint(pristine, tmp_path):
    root = tmp_path / "r"
    shutil.copytree(pristine, root)
    _symlinked_step_dir(root)
    assert cat.committed_steps(root) == [1]
    assert CheckpointManager(root, comm=None).load_latest(empty_state()).step == 1
