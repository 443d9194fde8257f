"""Two-phase save: overlap safety, one persist in flight, errors surface, and no hang."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.rawio import write_posix
from coci_hpc.errors import CommError, UsageError
from tests.checkpoint.helpers import canonical, empty_state, full_state
from tests.faults.faulty import patch_writes

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]
BIG = 1 << 19  # 2 MiB parameter: above the overlap threshold, copied by the background thread


def slow_writes(monkeypatch, seconds: float, only_rank: int | None, comm, started: threading.Event | None = None):
    real = write_posix

    def slow(path, items, **kw):
        if only_rank is None or comm.rank == only_rank:
            if started is not None:
                started.set()
            time.sleep(seconds)
        return real(path, items, **kw)

    patch_writes(slow, monkeypatch.setattr)


def test_async_round_trip_and_snapshot_is_taken_before_the_update(shared_dir, comm, monkeypatch):
    slow_writes(monkeypatch, 0.3, None, comm)
    state = full_state(11, comm.rank, comm.size, big=BIG)
    expected = canonical(state)
    mgr = CheckpointManager(shared_dir, comm=comm)
    assert mgr.save_async(3, state) == "started"
    assert mgr.persist_in_flight
    # The training loop goes on: optimizer.step() waits for the snapshot copy (pre-hook), then
    # changes the weights; the checkpoint must still hold the weights of step 3.
    model, opt = state["model"], state["optimizer"]
    opt.zero_grad()
    model(torch.randn(4, 32)).sum().backward()
    model.big.grad = torch.ones_like(model.big)
    opt.step()
    assert canonical(state["model"]) != expected["model"]
    mgr.wait()
    assert not mgr.persist_in_flight and mgr.latest_step() == 3
    target = empty_state(comm.rank, comm.size, big=BIG)
    mgr.load_latest(target)
    assert canonical(target)["model"] == expected["model"]
    assert canonical(target)["optimizer"] == expected["optimizer"]
    mgr.close()


def test_second_request_waits_by_default(shared_dir, comm, monkeypatch):
    slow_writes(monkeypatch, 0.5, 0, comm)
    mgr = CheckpointManager(shared_dir, comm=comm, keep=5)
    state = full_state(1, comm.rank, comm.size)
    mgr.save_async(1, state)
    t0 = time.perf_counter()
    assert mgr.save_async(2, state) == "started"  # blocks until step 1 is committed
    assert mgr.latest_step() == 1
    assert comm.rank != 0 or time.perf_counter() - t0 > 0.2
    mgr.close()
    assert mgr.latest_step() == 2


def test_second_request_is_skipped_on_every_rank_with_on_busy_skip(shared_dir, comm, monkeypatch):
    slow_writes(monkeypatch, 1.0, 0, comm)
    mgr = CheckpointManager(shared_dir, comm=comm, on_busy="skip")
    state = full_state(1, comm.rank, comm.size)
    assert mgr.save_async(1, state) == "started"
    assert mgr.save_async(2, state) == "skipped"  # rank 0 is still writing: all ranks skip
    mgr.wait()
    assert mgr.save_async(3, state) == "started"
    mgr.close()
    assert [c.step for c in mgr.list()] == [1, 3]
    with pytest.raises(UsageError):
        CheckpointManager(shared_dir, comm=comm, on_busy="later")


def test_background_error_surfaces_on_every_rank_at_the_next_call(shared_dir, comm, monkeypatch):
    mgr = CheckpointManager(shared_dir, comm=comm)
    state = full_state(1, comm.rank, comm.size)
    mgr.save(1, state)
    bad = comm.size - 1
    real = write_posix

    def failing(path, items, **kw):
        if comm.rank == bad:
            raise OSError("Input/output error")  # (a full disk has its own error: test_ckpt_no_space)
        return real(path, items, **kw)

    patch_writes(failing, monkeypatch.setattr)
    assert mgr.save_async(2, state) == "started"
    time.sleep(0.2)
    with pytest.raises(CommError) as info:
        while not mgr.poll():
            time.sleep(0.05)
    assert set(info.value.failed_ranks) == {bad} and "Input/output error" in str(info.value)
    assert mgr.latest_step() == 1
    assert not (cat.step_dir(shared_dir, 2) / mf.MANIFEST).exists()
    mgr.close()


def test_training_collectives_while_a_persist_is_in_flight_do_not_hang(shared_dir, comm, monkeypatch):
    """Rank 0's persist is slow; every rank keeps running training-loop allreduces meanwhile."""
    started = threading.Event()
    slow_writes(monkeypatch, 1.5, 0, comm, started)
    mgr = CheckpointManager(shared_dir, comm=comm)
    state = full_state(2, comm.rank, comm.size, big=BIG)
    mgr.save_async(1, state)
    if comm.rank == 0:
        assert started.wait(10)
    t0 = time.perf_counter()
    total = 0.0
    for i in range(50):
        total += comm.allreduce_max(float(i))  # the training loop's own collective
        mgr.poll()  # commits only once every rank is done
    elapsed = time.perf_counter() - t0
    assert total == sum(range(50))
    assert elapsed < 1.5 or comm.size == 1  # allreduces were not serialised behind the persist
    mgr.wait()
    assert mgr.latest_step() == 1
