"""Peer-loss pieces that need no cluster: the agreement's deadline, the packed per-rank state, the
boundary snapshot's rollback, the survivors' writer (its checkpoint loads through the normal path),
and init_distributed's bounded collectives."""
from __future__ import annotations

import random
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, PerRank, Sharded
from coci_hpc.checkpoint.lustre import LustrePolicy, tuning_for
from coci_hpc.comm import Comm
from coci_hpc.errors import PeerLost
from coci_hpc.runtime import distributed
from coci_hpc.runtime import survivors as sv
from coci_hpc.runtime.data import ResumableSampler
from coci_hpc.runtime.partner import RankState, capture
from coci_hpc.runtime.stepsync import StepSync


class _NeverDone:
    def Test(self) -> bool:      # noqa: N802 - mpi4py's name
        return False


class _StuckComm(Comm):
    """A peer that never joins: the allreduce request never completes."""

    def __init__(self) -> None:
        super().__init__(None)
        self.size = 2

    def iallreduce_max_array(self, send, recv):
        return _NeverDone()


def test_agreement_with_a_vanished_peer_raises_peer_lost_within_the_deadline() -> None:
    sync = StepSync(_StuckComm(), deadline_s=0.3)
    sync.send(0, False, False)
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="did not complete within 0.3s"):
        sync.receive()
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert sync.lost
    assert StepSync(_StuckComm(), deadline_s=0.2).probe() is False


def test_the_relaunch_loops_notice_ends_the_wait_at_once_and_a_slow_peer_keeps_its_deadline(tmp_path: Path) -> None:
    """Under coci-submit's relaunch loop, srun's report of a task's end (the loop's notice file)
    ends a survivor's wait within ~POLL_S, not after the 5 s deadline; without a notice (a slow
    but live peer) the wait still runs to its deadline."""
    from coci_hpc.runtime import peernotice

    path = tmp_path / ".7_0_peer_notice"
    sync = StepSync(_StuckComm(), deadline_s=5.0, notice=peernotice.PeerNotice.from_env({peernotice.ENV: str(path)}))
    sync.send(0, False, False)
    peernotice.post(path, "srun: error: n2: task 1: Killed")
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="relaunch loop saw it end: srun: error: n2: task 1: Killed"):
        sync.receive()
    assert time.monotonic() - t0 < 3.0 and sync.lost       # the deadline is 5 s
    # The generator-exit path (gloo's "Connection reset by peer" inside the step) probes: same.
    probe = StepSync(_StuckComm(), deadline_s=5.0, notice=peernotice.PeerNotice(path))
    t0 = time.monotonic()
    assert probe.probe(5.0) is False and time.monotonic() - t0 < 3.0
    assert "relaunch loop saw it end" in probe.lost_why       # the event log's `how` says which path

    # No notice posted: the whole deadline.
    slow = StepSync(_StuckComm(), deadline_s=0.4, notice=peernotice.PeerNotice(tmp_path / "never"))
    slow.send(0, False, False)
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="did not complete within 0.4s"):
        slow.receive()
    assert time.monotonic() - t0 >= 0.4
    # A request that completes wins over a notice (the lost rank had already sent its part).
    class _Done:
        def Test(self) -> bool:      # noqa: N802 - mpi4py's name
            return True

        def Wait(self) -> None:      # noqa: N802
            pass

    class _Answering(_StuckComm):
        def iallreduce_max_array(self, send, recv):
            recv[:] = send
            return _Done()
    done = StepSync(_Answering(), notice=peernotice.PeerNotice(path))
    done.send(1, True, False)
    assert done.receive() == (1, True, False)


def test_sigterm_shortens_the_wait_for_a_silent_peer_but_not_for_an_answering_one() -> None:
    """Slurm cancelling a job that lost nodes sends SIGTERM, then SIGKILL KillWait later (5 s on the
    local cluster): a survivor waiting out its 5 s deadline was killed before recording the disk-tier
    fallback (issue 25). After SIGTERM a silent peer gets ENDING_GRACE_MIN_S (1 s here), not the deadline."""
    from coci_hpc.runtime import stepsync

    term: list[float] = []
    sync = StepSync(_StuckComm(), deadline_s=5.0, ending=lambda: term[0] if term else None)
    sync.send(0, False, False)
    term.append(time.monotonic())
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="Slurm is ending this step"):
        sync.receive()
    waited = time.monotonic() - t0
    assert stepsync.ENDING_GRACE_MIN_S <= waited < 3.0 and sync.lost, waited
    # The probe after an exception inside the step: the same, and `how` names it.
    probe = StepSync(_StuckComm(), deadline_s=5.0, ending=lambda: term[0])
    t0 = time.monotonic()
    assert probe.probe(5.0) is False and time.monotonic() - t0 < 3.0
    assert "Slurm is ending this step" in probe.lost_why
    # The grace follows the step time (3 typical steps), never beyond the deadline.
    slow = StepSync(_StuckComm(), deadline_s=5.0, ending=lambda: term[0])
    slow.follow(1.0)                      # deadline 10 typical steps, grace 3
    assert (slow.deadline_s, slow.ending_grace_s()) == (pytest.approx(10.0), pytest.approx(3.0))
    slow.deadline_s = 2.0
    assert slow.ending_grace_s() == pytest.approx(2.0)
    # No SIGTERM: the whole deadline.
    quiet = StepSync(_StuckComm(), deadline_s=0.4, ending=lambda: None)
    quiet.send(0, False, False)
    with pytest.raises(PeerLost, match="did not complete within 0.4s"):
        quiet.receive()


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "loader": ResumableSampler(64, seed=1, rank=0, world_size=2),
            "extra": PerRank({"count": torch.tensor([seed])})}


def test_rank_state_packs_without_pickle_and_round_trips() -> None:
    random.seed(5)
    np.random.seed(5)
    rs = capture(_state(), rank=1, step=7)
    data = rs.pack()
    assert b"pickle" not in data and data[8:9] == b"{"          # a JSON header, then raw bytes
    back = RankState.unpack(data)
    assert (back.rank, back.step, back.skeleton) == (1, 7, rs.skeleton)
    for a, b in zip(rs.leaves, back.leaves):
        assert a.name == b.name and a.dtype == b.dtype and bytes(a.array.view(np.uint8)) == bytes(b.array.view(np.uint8))
    with pytest.raises(ValueError, match="truncated"):
        RankState.unpack(data[:-3])


def test_boundary_snapshot_rolls_back_what_a_step_changed_before_optimizer_step() -> None:
    st = _state()
    snap = sv.BoundarySnapshot()
    snap.take(st, 10, 0)
    before = st["loader"].state_dict()
    st["loader"].next_batch(8)                                 # the next step drew its batch...
    assert st["loader"].state_dict() != before
    snap.rollback(st)                                          # ...and the failure came in backward
    assert st["loader"].state_dict() == before


def test_boundary_snapshot_rolls_back_a_generator_the_step_drew_from() -> None:
    # a generator in the state (an augmentation's): its state, not the object, is what is kept
    st = {**_state(), "aug": torch.Generator().manual_seed(3), "np_aug": PerRank(np.random.default_rng(4))}
    snap = sv.BoundarySnapshot()
    snap.take(st, 10, 0)
    expected = (torch.rand(3, generator=torch.Generator().manual_seed(3)).tolist(),
                np.random.default_rng(4).random(3).tolist())
    torch.rand(5, generator=st["aug"])                         # the next step drew from them...
    st["np_aug"].value.random(5)
    snap.rollback(st)                                          # ...and the failure came in backward
    assert (torch.rand(3, generator=st["aug"]).tolist(), st["np_aug"].value.random(3).tolist()) == expected


def test_survivors_checkpoint_loads_through_the_normal_path(tmp_path: Path) -> None:
    """Rank 0 writes a 2-rank checkpoint alone, rank 1's per-rank state from its partner copy; a
    2-rank load (run here as rank 1 of a fake world through the same reader) gets rank 1's RNG."""
    st = _state()
    own = capture(st, 0, 5)
    torch.manual_seed(99)                                      # "rank 1" has other RNG streams
    other = capture({**st, "extra": PerRank({"count": torch.tensor([41])})}, 1, 5)
    tuning = tuning_for(tmp_path, LustrePolicy(), 2)
    out = sv.save(tmp_path, 5, st, 0, 2, own, [other], tuning, keep=2, window_s=1.0)
    assert out.committed and out.writer and out.ranks_from_partner == [1], out
    assert [p.name for p in sv.staging_dir(tmp_path, 5).iterdir()] == ["claim"]    # the posted states go
    m = CheckpointManager(tmp_path, Comm.serial(), lock=False)
    assert m.latest_step() == 5
    fresh = _state(seed=3)
    fresh["extra"] = PerRank({"count": torch.tensor([0])})
    m.load(5, fresh)                                           # 2 -> 1 reshard: rank 0's per-rank state
    assert torch.equal(fresh["model"].weight, st["model"].weight)
    assert fresh["extra"].value["count"].item() == 0
    import h5py

    from coci_hpc.checkpoint import catalog as cat
    man = cat.read_manifest(tmp_path / "step_000000005")
    t = next(x for x in man["tensors"] if x["name"] == "per_rank/extra/count")
    with h5py.File(tmp_path / "step_000000005" / "data.h5", "r") as f:   # rank 1's part, from the copy
        raw = np.asarray(f[t["dataset"]][()]).view(np.uint8).reshape(-1)
    got = {r: int(raw[start:start + n].view(np.int64)[0]) for r, start, _, n in t["parts"]}
    assert got == {0: 0, 1: 41}


def test_a_rank_that_runs_again_after_the_commit_neither_writes_nor_records_the_step(tmp_path: Path) -> None:
    """A frozen host's rank woken by the requeue's SIGCONT after rank 0 committed the survivors'
    save of the same step: the claim is still there, so it is not a writer (no second peer_lost
    record, no second requeue); the next attempt's sweep removes the claim and names no torn step."""
    st = _state()
    tuning = tuning_for(tmp_path, LustrePolicy(), 2)
    first = sv.save(tmp_path, 5, st, 0, 2, capture(st, 0, 5), [capture(st, 1, 5)], tuning, keep=2, window_s=1.0)
    assert first.committed and first.writer
    late = sv.save(tmp_path, 5, st, 1, 2, capture(st, 1, 5), [capture(st, 0, 5)], tuning, keep=2, window_s=1.0)
    assert not late.writer and not late.committed and late.reason == "another survivor writes", late
    assert sv.sweep_torn(tmp_path) == [] and not sv.staging_dir(tmp_path, 5).exists()
    again = sv.save(tmp_path, 5, st, 0, 2, capture(st, 0, 5), [capture(st, 1, 5)], tuning, keep=2, window_s=1.0)
    assert again.writer and again.committed          # a later attempt failing at the same step saves it
    assert CheckpointManager(tmp_path, Comm.serial(), lock=False).latest_step() == 5


def test_missing_partner_copy_or_sharded_state_commits_nothing(tmp_path: Path) -> None:
    st = _state()
    tuning = tuning_for(tmp_path, LustrePolicy(), 2)
    out = sv.save(tmp_path, 5, st, 0, 2, capture(st, 0, 5), [], tuning, keep=2, window_s=0.3)
    assert not out.committed and "rank(s) [1]" in out.reason
    st2 = {**st, "emb": Sharded(torch.zeros(4, 2))}
    out = sv.save(tmp_path, 6, st2, 0, 2, capture(st2, 0, 6), [capture(st2, 1, 6)], tuning, keep=2, window_s=0.3)
    assert not out.committed and "Sharded" in out.reason and "emb" in out.reason
    assert CheckpointManager(tmp_path, Comm.serial(), lock=False).latest_step() is None


def test_init_distributed_bounds_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **k: seen.update(k))
    monkeypatch.setattr(distributed, "_store", lambda *a: seen.update(store_timeout_s=a[-1]))
    monkeypatch.setattr(distributed, "_all_joined", lambda *a: seen.update(joined_timeout_s=a[-1]))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("COCI_DIST_TIMEOUT_S", "42")
    distributed.init_distributed("gloo", comm=Comm.serial())
    assert seen["timeout"] == timedelta(seconds=42) and seen["store_timeout_s"] == 42   # the rendezvous too
    assert seen["joined_timeout_s"] == 42                                                # and the join after it


def test_a_writer_killed_before_its_manifest_leaves_the_previous_checkpoint_and_is_swept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The survivors' writer SIGKILLed mid-save (here in a forked child, paused by the test-only
    faulty writer after its shards and before its manifest): step 4 stays latest; the next attempt's
    sweep names the torn step and removes its staging; the next save removes its data file."""
    import os
    import signal

    from coci_hpc.checkpoint import catalog as cat
    from coci_hpc.checkpoint import manifest as mf
    from coci_hpc.history import build, render_text

    st = _state()
    tuning = tuning_for(tmp_path, LustrePolicy(), 2)
    assert sv.save(tmp_path, 4, st, 0, 2, capture(st, 0, 4), [capture(st, 1, 4)], tuning, keep=2,
                   window_s=1.0).committed
    from tests.faults.faulty import FaultyWriter

    make = sv.make_writer                                      # the survivors' writer pauses after its shards
    monkeypatch.setattr(sv, "make_writer", lambda: FaultyWriter(make(), pause_s=60, at="written", once=False))
    pid = os.fork()
    if pid == 0:                                               # the writer, to be killed mid-save
        try:
            sv.save(tmp_path, 9, st, 0, 2, capture(st, 0, 9), [capture(st, 1, 9)], tuning, keep=2, window_s=1.0)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while not (cat.step_dir(tmp_path, 9) / mf.DATA_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)                                            # in the pause: shards written, no manifest
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert (cat.step_dir(tmp_path, 9) / mf.DATA_FILE).exists()
    assert not (cat.step_dir(tmp_path, 9) / mf.MANIFEST).exists()
    m = CheckpointManager(tmp_path, Comm.serial())
    assert m.latest_step() == 4                                # the torn save never counts
    assert sv.torn_steps(tmp_path) == [9] and sv.staging_dir(tmp_path, 9).exists()    # read only
    assert sv.sweep_torn(tmp_path) == [9] and not sv.staging_dir(tmp_path, 9).exists()
    assert sv.sweep_torn(tmp_path) == []
    fresh = _state(seed=3)
    m.load_latest(fresh)
    assert torch.equal(fresh["model"].weight, st["model"].weight)
    m.save(6, fresh)                                           # the catalog removes the leftover
    assert not cat.step_dir(tmp_path, 9).exists()
    m.close()
    h = build([{"event": "attempt_start", "attempt": 1, "wall": 1.0},
               {"event": "attempt_start", "attempt": 2, "wall": 9.0, "resumed_step": 4, "steps_lost": 5,
                "torn_survivors_saves": [9]}], str(tmp_path))
    assert h.peer_losses[0]["attempt"] == 1 and h.peer_losses[0]["step"] == 9 and not h.peer_losses[0]["committed"]
    text = render_text(h)
    assert "killed before its manifest" in text and "fell back to step 4" in text and "steps lost 5" in text, text


def test_fsdp2_state_falls_back_with_the_reason_and_no_state_dict_on_one_rank(tmp_path: Path) -> None:
    """Pure FSDP2 (DTensor shards, here on a real one-rank gloo mesh): a lost rank's shards exist
    nowhere else, so the survivors' save commits nothing and says why, from the parts the session
    found at its start on every rank (no state_dict() on a survivor for it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from coci_hpc.checkpoint.state import collect

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        st = {"model": model, "optimizer": opt}
        parts = sv.held_in_parts(collect(st, rng=False)[1])
        assert "replicated/model/0.weight" in parts and any("exp_avg" in n for n in parts)
        tuning = tuning_for(tmp_path, LustrePolicy(), 2)
        # An empty state: the reason can only come from ``parts`` (found at the session's start).
        out = sv.save(tmp_path, 3, {}, 0, 2, capture(st, 0, 3), [], tuning, keep=2, window_s=0.2, parts=parts)
        assert out.writer and not out.committed
        assert "DTensor" in out.reason and "replicated/model/0.weight" in out.reason and "falls back" in out.reason
        assert CheckpointManager(tmp_path, Comm.serial(), lock=False).latest_step() is None
    finally:
        if started:
            dist.destroy_process_group()
