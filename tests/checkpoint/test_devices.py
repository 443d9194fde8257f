"""The CUDA fast paths of ``coci_hpc/checkpoint/devices.py`` on the CPU, under the FAKE device
boundary (tests/checkpoint/fake_device.py, issue 32): the async snapshot, the memory tier's copy
and the partner copy move device tensors into reused page-locked buffers with copies queued on a
side stream, waited for once; the first async save does not stall for page-locking its buffers
when they were prepared ahead.

Under the fake a queued copy poisons its destination and lands only when its stream is waited
for, so a missing wait leaves NaN (0xFF bytes) where the values should be. Each path has a
negative control here: with :meth:`~coci_hpc.checkpoint.devices.HostCopies.wait` made a no-op,
the same checks fail (the fake sees the missing wait). One process, a small plain model.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, devices
from coci_hpc.checkpoint.leaves import PerRank
from coci_hpc.checkpoint.state import collect
from coci_hpc.comm import Comm
from coci_hpc.runtime import memtier
from coci_hpc.runtime.partner import Capturer
from tests.checkpoint.fake_device import DeviceBoundary

State = dict[str, Any]


@pytest.fixture
def fake() -> Iterator[DeviceBoundary]:
    boundary = DeviceBoundary()
    with boundary.installed():
        yield boundary


@pytest.fixture(params=[False, True], ids=["waited", "wait-removed"])
def no_wait(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """True: the negative control, HostCopies.wait a no-op (the copies never waited for)."""
    if request.param:
        monkeypatch.setattr(devices.HostCopies, "wait", lambda self: None)
    return bool(request.param)


def build(fake: DeviceBoundary, layers: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    fake.adopt(model, opt)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int, fake: DeviceBoundary) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 32, generator=gen)).pow(2).mean().backward()
    opt.step()
    fake.adopt(opt)            # Adam's moments, made by the first step, are device memory


def values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            out[f"opt/{i}/{k}"] = v.detach().clone()
    return out


def differ(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in sorted(want) if k not in got or not torch.equal(want[k], got[k])]


def loaded(fake: DeviceBoundary, mgr: CheckpointManager, step: int, layers: int = 2) -> dict[str, torch.Tensor]:
    model, opt = build(fake, layers)
    mgr.load(step, {"model": model, "optimizer": opt})
    return values(model, opt)


# -- the async snapshot ------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [True, False], ids=["background", "at-start"])
def test_async_snapshot_copies_on_the_side_stream_land_before_the_write(
        tmp_path: Path, fake: DeviceBoundary, no_wait: bool, overlap: bool) -> None:
    """Every device piece of the snapshot is queued on the side stream (ordered after the step's
    work, into page-locked buffers) and waited for once before the write; the optimizer step after
    save_async changes the state only after the copies (the snapshot is of step 2, not 3). Two
    saves: the second into the reused buffers."""
    model, opt = build(fake)
    train(model, opt, 1, fake)
    mgr = CheckpointManager(tmp_path, comm=Comm.serial(), keep=3, overlap=overlap)
    mgr._async.overlap_min_bytes = 0      # every deferrable piece in the background (overlap=True)
    state: State = {"model": model, "optimizer": opt}
    mgr.save_async(2, state)
    want2 = values(model, opt)
    train(model, opt, 2, fake)
    mgr.wait()
    mgr.save_async(3, state)
    want3 = values(model, opt)
    train(model, opt, 3, fake)
    mgr.wait()
    current_stream_copies = fake.crossings["non_blocking"]
    bad = {2: differ(want2, loaded(fake, mgr, 2)), 3: differ(want3, loaded(fake, mgr, 3))}
    mgr.close()
    assert fake.crossings["unordered"] == 0 and fake.crossings["unpinned_dst"] == 0, fake.crossings
    assert current_stream_copies == 0   # no copy on the current stream with a wait per copy, any more
    if no_wait and overlap:
        # negative control: the deferred copies never landed, the file holds poison
        assert bad[2] and bad[3], bad
    elif no_wait:
        # at-start copies land at the fence (later work on the current stream waits for them): the
        # wait is what the background copies need, and there are none; the fence is checked below
        assert not bad[2] and not bad[3], bad
    else:
        assert not bad[2] and not bad[3], bad
        assert fake.crossings["side_stream"] >= 2 * 12 and fake.crossings["side_stream_waits"] >= 2


def test_async_snapshot_without_the_fence_tears(tmp_path: Path, fake: DeviceBoundary,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the fence: copies made at start (not deferred) must be ordered before
    the state's next in-place update. Without it (and with the persist thread held back, as a
    slow device would) the snapshot holds the values after the next optimizer step."""
    monkeypatch.setattr(devices.HostCopies, "fence", lambda self: None)
    gate = threading.Event()
    real_wait = devices.HostCopies.wait

    def late_wait(self: devices.HostCopies) -> None:
        gate.wait(10)
        real_wait(self)

    monkeypatch.setattr(devices.HostCopies, "wait", late_wait)
    model, opt = build(fake)
    train(model, opt, 1, fake)
    mgr = CheckpointManager(tmp_path, comm=Comm.serial(), keep=3, overlap=False)
    mgr.save_async(2, {"model": model, "optimizer": opt})
    want2 = values(model, opt)
    train(model, opt, 2, fake)     # overlap=False: nothing deferred, the step does not wait
    gate.set()
    mgr.wait()
    bad = differ(want2, loaded(fake, mgr, 2))
    mgr.close()
    assert bad, "without the fence the at-start copies read the state after the next step"


# -- the first save's page-locked buffers -------------------------------------------------------------
DELAY = 0.5   # seconds the fake takes to page-lock one buffer (6 device pieces: 3 s in all)


@pytest.mark.parametrize("ahead", ["prepared", "prepared-just-before", "not-prepared"])
def test_first_async_save_does_not_stall_for_page_locking(tmp_path: Path, fake: DeviceBoundary, ahead: str) -> None:
    """prepare_async page-locks the snapshot's buffers in a background thread: the first
    save_async then blocks for far less than one buffer's page-locking. Right after
    prepare_async the save waits for the buffers still being registered (it never copies into a
    buffer before), and without it the first save pays for all of them (the stall it removes)."""
    model, opt = build(fake, layers=1)
    train(model, opt, 1, fake)
    fake.register_delay_s = DELAY
    mgr = CheckpointManager(tmp_path, comm=Comm.serial(), keep=3)
    state: State = {"model": model, "optimizer": opt}
    if ahead != "not-prepared":
        reserved = mgr.prepare_async(state)
        assert reserved == 3 * sum(p.numel() * 4 for p in model.parameters())   # weights + 2 moments, float32
        if ahead == "prepared":
            mgr._async.buffers.settle()    # the training steps between (here: until it is done)
    t0 = time.perf_counter()
    mgr.save_async(2, state)
    first = time.perf_counter() - t0
    want2 = values(model, opt)
    train(model, opt, 2, fake)
    mgr.wait()
    t0 = time.perf_counter()
    mgr.save_async(3, state)
    later = time.perf_counter() - t0
    mgr.wait()
    fake.register_delay_s = 0.0
    bad = differ(want2, loaded(fake, mgr, 2, layers=1))
    mgr.close()
    assert not bad, bad
    assert fake.crossings["unpinned_dst"] == 0, fake.crossings     # never a copy into unregistered memory
    assert fake.crossings["registered"] >= 6
    assert later < DELAY, later                                     # reused: nothing page-locked again
    if ahead == "prepared":
        assert first < DELAY, (first, later)
    else:
        assert first > 6 * DELAY / 3, (first, later)   # the registration still to do was waited for


# -- the memory tier -------------------------------------------------------------------------------------
def host_leaves(state: State) -> dict[str, bytes]:
    """The state's bytes by leaf name, the reference way (``.cpu()`` per device tensor)."""
    return {l.name: l.array.view(np.uint8).tobytes() for l in collect(state, rng=True)[1] if l.array is not None}


def test_memtier_copy_goes_straight_into_the_pinned_slot(fake: DeviceBoundary, no_wait: bool) -> None:
    """copy_state: device tensors into the slot's page-locked buffer on the side stream (no
    ``.cpu()`` tensor per copy), waited for before it returns: the slot decodes to the state.
    Again into the same slot after a step: not reallocated, the new values."""
    model, opt = build(fake)
    train(model, opt, 1, fake)
    state: State = {"model": model, "optimizer": opt}
    slot = memtier.Slot()
    for step in (1, 2):
        cpu = fake.crossings["cpu"]
        memtier.copy_state(slot, 0, step, state)
        assert fake.crossings["cpu"] == cpu            # not one host tensor made by .cpu()
        got = {l.name: l.array.view(np.uint8).tobytes() for l in slot.snapshot().leaves}
        want = host_leaves(state)
        bad = [n for n in want if got.get(n) != want[n]]
        if no_wait:
            assert bad, "the fake must see the missing wait"
            return
        assert not bad and slot.snapshot().step == step, bad
        train(model, opt, step + 1, fake)
    assert slot.allocations == 1 and slot.tensor is not None
    assert fake.crossings["unpinned_dst"] == 0 and fake.crossings["side_stream"] >= 2 * 12, fake.crossings


def test_memtier_state_in_host_memory_keeps_the_plain_path() -> None:
    """Without device tensors the slot is plain memory and nothing of devices.py runs."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    slot = memtier.Slot()
    memtier.copy_state(slot, 0, 1, {"model": model})
    assert slot.tensor is None
    got = {l.name: l.array.view(np.uint8).tobytes() for l in slot.snapshot().leaves}
    assert got == host_leaves({"model": model})


# -- the partner copy ------------------------------------------------------------------------------------
def test_partner_copy_of_device_per_rank_values(fake: DeviceBoundary, no_wait: bool) -> None:
    """A PerRank value on the device: captured into the stage's reused page-locked buffers on the
    side stream, no ``.cpu()`` per copy; the packed copy decodes to the live values, twice."""
    torch.manual_seed(0)
    h = fake.tag(torch.randn(5, 7))
    cap = Capturer({"extra": PerRank({"h": h, "n": 3})}, rank=0)
    for step in (1, 2):
        cpu = fake.crossings["cpu"]
        copy, _ = cap.capture(step)
        assert fake.crossings["cpu"] == cpu
        leaf = next(l for l in copy.state().leaves if l.name == "per_rank/extra/h")
        same = leaf.array.tobytes() == h.numpy().tobytes()
        assert same != no_wait, (step, no_wait)
        if no_wait:
            return
        with torch.no_grad():
            h.add_(1.0)
    assert fake.crossings["unpinned_dst"] == 0 and fake.crossings["side_stream"] == 2, fake.crossings


def test_memtier_slot_is_not_whole_while_its_device_copies_are_in_flight(fake: DeviceBoundary) -> None:
    """Between pack_into (copies queued) and their wait a slot is not whole (step -1: a survivors'
    save does not post it); copy_state marks it after the wait, and not at all when ``whole()``
    says the tier froze meanwhile."""
    model, opt = build(fake)
    train(model, opt, 1, fake)
    state: State = {"model": model, "optimizer": opt}
    slot = memtier.Slot()
    copies = devices.HostCopies()
    memtier.pack_into(slot, 0, 4, *collect(state, rng=True, defer_device=True), copies)
    assert copies.issued == 12 and slot.step == -1
    copies.wait()
    assert memtier.copy_state(slot, 0, 5, state) and slot.step == 5
    assert not memtier.copy_state(slot, 0, 6, state, whole=lambda: False) and slot.step == -1
