"""CociStorageReader: dcp.load straight from a coci checkpoint, bit-identical to
CheckpointManager.load; a damaged shard is refused; slices read only the rows asked for."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.interop.dcp_reader import CociStorageReader
from coci_hpc.interop.source import CheckpointSource
from tests.interop.helpers import loaded_reference, same_bits, save_full


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    save_full(root, step=3)
    save_full(root, step=5, seed=2)
    return root


def test_dcp_load_reads_the_newest_or_a_named_step(ck: Path) -> None:
    for step in (5, 3):
        ref = loaded_reference(ck, step)["model"].state_dict()
        target = {k: torch.zeros_like(v) for k, v in ref.items()}
        dcp.load(target, storage_reader=CociStorageReader(ck, step if step == 3 else None), no_dist=True)
        assert all(same_bits(target[k], v) for k, v in ref.items()), step


def test_with_others_serves_the_optimizer_too(ck: Path) -> None:
    ref = loaded_reference(ck, 5)["optimizer"].state_dict()["state"][1]["exp_avg"]   # param 1: fc1.bias (the leaves are keyed by name)
    target = {"optimizer.state.fc1.bias.exp_avg": torch.zeros_like(ref)}
    dcp.load(target, storage_reader=CociStorageReader(ck, with_others=True), no_dist=True)
    assert same_bits(target["optimizer.state.fc1.bias.exp_avg"], ref)


def test_a_box_reads_its_rows_checked(ck: Path) -> None:
    ref = loaded_reference(ck, 5)["model"].state_dict()["fc1.weight"]
    with CheckpointSource(ck) as src:
        e = next(e for e in src.model() if e.path == "fc1.weight")
        got = src.read_box(e, (10, 3), (7, 20))
    assert same_bits(got.contiguous(), ref[10:17, 3:23].contiguous())


def test_damaged_shard_is_refused(ck: Path) -> None:
    d = cat.step_dir(ck, 5)
    t = next(t for t in cat.read_manifest(d)["tensors"] if t["dataset"] == "replicated/model/fc1.weight")
    with open(d / mf.DATA_FILE, "r+b") as f:
        f.seek(t["offset"] + 100)
        f.write(b"\xff\xff\xff\xff")
    target = {"fc1.weight": torch.zeros(64, 32)}
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as e:   # DCP wraps each rank's error
        dcp.load(target, storage_reader=CociStorageReader(ck), no_dist=True)
    inner = e.value.failures[0][0]
    assert "model.fc1.weight" in str(inner) and "fails its checksum" in str(inner)
    # (the bytes were read straight into the target: like any failed dcp.load, it is not restored)


def test_a_step_directory_names_its_step(ck: Path) -> None:
    with CheckpointSource(cat.step_dir(ck, 3)) as src:
        assert src.step == 3 and src.root == ck
