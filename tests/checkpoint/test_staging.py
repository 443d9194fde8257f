"""A restore into device tensors goes through the pinned staging of :mod:`coci_hpc.checkpoint.staging`
(issue 32), checked on the CPU with the FAKE device boundary (tests/checkpoint/fake_device.py):
the copies to the device are non-blocking and complete only when waited for, and a staging buffer
handed out again is poisoned, so a load that refilled a buffer before the copy out of it finished
loads wrong bytes. One process, a real checkpoint file."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, devices
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.errors import CheckpointCorrupt
from tests.checkpoint.fake_device import DeviceBoundary


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 20))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.zero_grad()
    model(torch.randn(5, 40)).square().mean().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "extra": {"table": torch.randn(700, 11)}}


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in state["model"].state_dict().items()}
    for i, st in enumerate(state["optimizer"].state.values()):
        out.update({f"optim/{i}/{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    out["extra/table"] = state["extra"]["table"]
    return {k: v.detach().clone() for k, v in out.items()}


def _saved(tmp_path: Path) -> tuple[CheckpointManager, dict[str, torch.Tensor]]:
    mgr = CheckpointManager(tmp_path / "ckpt", rng=False)
    state = _state(0)
    mgr.save(1, state)
    return mgr, _tensors(state)


def _load_on_fake_device(mgr: CheckpointManager, *, wait: bool = True) -> tuple[dict[str, Any], DeviceBoundary]:
    state = _state(1)   # other values: a byte not loaded shows
    boundary = DeviceBoundary()
    boundary.adopt(state["model"], state["optimizer"], state["extra"]["table"])
    with boundary.installed():
        if not wait:
            devices.wait_upload = lambda event: None   # the fake's own is put back on leaving
        mgr.load(1, state)
    return state, boundary


def test_restore_into_device_tensors_streams_through_reused_staging_buffers(tmp_path: Path) -> None:
    mgr, want = _saved(tmp_path)
    state, boundary = _load_on_fake_device(mgr)
    mgr.close()
    got = _tensors(state)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    c = boundary.crossings
    # every device tensor came through the staging buffers, cut into many chunks, the buffers reused
    assert c["uploads"] > 20 and c["poisoned_staging"] > 10, c   # 13 device tensors, the table 8 chunks
    # nothing went to the device another way (no fresh host copy handed to torch, no second device copy)
    assert c["to"] == 0 and c["from_local"] == 0, c


def test_a_staging_buffer_refilled_before_its_copy_finished_loads_wrong_bytes(tmp_path: Path) -> None:
    """The test above fails without the wait: with ``wait_upload`` a no-op, a buffer's pending
    copy reads the next chunk (or the poison) at the end, and the loaded tensors differ."""
    mgr, want = _saved(tmp_path)
    state, _ = _load_on_fake_device(mgr, wait=False)
    mgr.close()
    got = _tensors(state)
    assert any(not torch.equal(got[k], v) for k, v in want.items() if "model/" in k)


def test_a_damaged_checkpoint_leaves_device_tensors_unchanged(tmp_path: Path) -> None:
    mgr, _ = _saved(tmp_path)
    m = cat.read_step(tmp_path / "ckpt", 1)
    w = next(t for t in m["tensors"] if t["name"].endswith("extra/table"))
    with open(cat.step_dir(tmp_path / "ckpt", 1) / mf.DATA_FILE, "r+b") as f:
        f.seek(w["offset"] + 100)
        b = f.read(1)
        f.seek(w["offset"] + 100)
        f.write(bytes([b[0] ^ 0x10]))
    state = _state(1)
    before = _tensors(state)
    boundary = DeviceBoundary()
    boundary.adopt(state["model"], state["optimizer"], state["extra"]["table"])
    with boundary.installed(), pytest.raises(CheckpointCorrupt):
        mgr.load(1, state)
    mgr.close()
    after = _tensors(state)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert boundary.crossings["uploads"] == 0
