"""The background save's commit is spread over several ``poll()`` calls (non-blocking collectives,
one stage per call): it must still be all-or-nothing. A rank that fails while the others already
poll with their part written, or rank 0's manifest failing between two polls, commits nothing on
any rank; every rank sees the outcome at the same call; a ``wait()`` (what the Session does at a
stop signal, ``close()`` at exit) finishes a commit that polls began. Runs under plain pytest,
mpiexec -n 1 and -n 2 (`mpi` marker).
"""
from __future__ import annotations

import time

import pytest

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint.catalog import StepCatalog
from coci_hpc.checkpoint.rawio import write_posix
from coci_hpc.comm import Comm
from coci_hpc.errors import CommError
from tests.checkpoint.helpers import canonical, empty_state, full_state
from tests.faults.faulty import patch_writes

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def all_written(mgr: CheckpointManager, comm: Comm) -> None:
    """Every rank's background write is done (local waits, then one barrier)."""
    while not mgr.persist_done:
        time.sleep(0.01)
    comm.barrier()


def polls_until_outcome(mgr: CheckpointManager, limit: int = 400) -> tuple[int, BaseException | None]:
    """poll() every 20 ms (as a training loop would, one call per step) until it commits or raises."""
    for n in range(1, limit + 1):
        try:
            if mgr.poll():
                return n, None
        except CommError as exc:
            return n, exc
        time.sleep(0.02)
    raise AssertionError(f"no outcome after {limit} polls")


def timed_polls_until_committed(mgr: CheckpointManager, pause_s: float) -> tuple[int, float]:
    """poll() with ``pause_s`` between calls (a training step) until it commits: (calls, the
    longest call in seconds)."""
    longest, n = 0.0, 0
    while True:
        t0 = time.monotonic()
        done = mgr.poll()
        longest = max(longest, time.monotonic() - t0)
        n += 1
        if done:
            return n, longest
        time.sleep(pause_s)


def first_commit_call(comm: Comm) -> int:
    """The earliest poll() that can commit once every rank has written (Commit's docstring)."""
    return 8 if comm.size > 1 else 2


def test_the_commit_takes_several_polls_and_ends_at_the_same_call_everywhere(shared_dir, comm):  # noqa: F811
    mgr = CheckpointManager(shared_dir, comm=comm, keep=2)
    state = full_state(1, comm.rank, comm.size)
    mgr.save(1, state)
    state = full_state(2, comm.rank, comm.size)
    expected = canonical(state)
    assert mgr.save_async(2, state) == "started"
    all_written(mgr, comm)
    # Each collective completes two calls after it started: agree all written (calls 1-3);
    # gather (3-5; rank 0 then writes the manifest in a thread); one call for it (6); agree on
    # the outcome (6-8; again while rank 0 is still writing it). So the eighth call at the
    # earliest, the same one on every rank. One rank waits for nobody: its collectives complete
    # at once, and the second call (after the one that starts the manifest's thread) at the earliest.
    before = first_commit_call(comm) - 1
    assert [mgr.poll() for _ in range(before)] == [False] * before
    assert mgr.persist_in_flight
    n, err = polls_until_outcome(mgr)
    assert err is None and not mgr.persist_in_flight
    assert len(set(comm.allgather(n))) == 1
    assert mgr.latest_step() == 2 and [c.step for c in mgr.list()] == [1, 2]
    target = empty_state(comm.rank, comm.size)
    mgr.load(2, target)
    assert canonical(target) == expected
    # With unevenly finishing ranks, every rank still sees the commit at the same call.
    assert mgr.save_async(3, full_state(3, comm.rank, comm.size)) == "started"
    time.sleep(0.05 * comm.rank)
    n, err = polls_until_outcome(mgr)
    assert err is None and len(set(comm.allgather(n))) == 1
    assert mgr.latest_step() == 3 and [c.step for c in mgr.list()] == [2, 3]
    mgr.close()


def test_a_rank_failing_while_the_others_already_poll_commits_nothing_anywhere(
        shared_dir, comm, monkeypatch, record_figure):  # noqa: F811
    mgr = CheckpointManager(shared_dir, comm=comm)
    mgr.save(1, full_state(1, comm.rank, comm.size))
    bad = comm.size - 1
    real = write_posix

    def late_failure(path, items, **kw):
        if comm.rank == bad:
            time.sleep(0.6)  # the other ranks finish and poll meanwhile
            raise OSError("Input/output error")
        return real(path, items, **kw)

    patch_writes(late_failure, monkeypatch.setattr)
    assert mgr.save_async(2, full_state(2, comm.rank, comm.size)) == "started"
    n, err = polls_until_outcome(mgr)
    assert err is not None and set(err.failed_ranks) == {bad} and "Input/output error" in str(err)
    assert len(set(comm.allgather(n))) == 1 and n > 5  # the others polled, written, before it failed
    assert not mgr.persist_in_flight and mgr.latest_step() == 1
    comm.barrier()
    assert not cat.step_dir(shared_dir, 2).exists()  # discarded on every rank's behalf
    patch_writes(real, monkeypatch.setattr)
    assert mgr.save_async(2, full_state(2, comm.rank, comm.size)) == "started"  # the same step again
    mgr.close()
    assert mgr.latest_step() == 2
    record_figure("async commit: a rank fails while others poll", runs=1, polls=n, committed=0)


@pytest.mark.parametrize("polls_before", [0, 1, 2, 3, 5, 6])
@pytest.mark.parametrize("manifest_fails", [False, True], ids=["ok", "manifest_fails"])
def test_wait_finishes_a_commit_that_polls_began(shared_dir, comm, monkeypatch, record_figure,  # noqa: F811
                                                 polls_before, manifest_fails):
    """A stop (Session: ``mgr.wait()``) or exit (``close()``) after 0-6 of the commit's polls:
    it commits, or, when rank 0's manifest write fails between two polls, raises the same
    CommError on every rank and commits nothing."""
    mgr = CheckpointManager(shared_dir, comm=comm)
    mgr.save(1, full_state(1, comm.rank, comm.size))
    if manifest_fails:
        real_write = StepCatalog.write_manifest

        def failing(self, step, manifest):  # type: ignore[no-untyped-def]
            if step == 2:
                raise OSError("Read-only file system")
            return real_write(self, step, manifest)

        monkeypatch.setattr(StepCatalog, "write_manifest", failing)
    assert mgr.save_async(2, full_state(2, comm.rank, comm.size)) == "started"
    all_written(mgr, comm)
    polls_before = min(polls_before, first_commit_call(comm) - 1)  # one rank: the second may commit
    assert [mgr.poll() for _ in range(polls_before)] == [False] * polls_before
    if manifest_fails:
        with pytest.raises(CommError) as info:
            mgr.wait()
        assert set(info.value.failed_ranks) == {0} and "Read-only file system" in str(info.value)
        assert mgr.latest_step() == 1
        comm.barrier()
        assert not cat.step_dir(shared_dir, 2).exists()
    else:
        mgr.wait()
        assert mgr.latest_step() == 2
    assert not mgr.persist_in_flight
    mgr.close()
    record_figure("async commit: wait() after 0-6 polls", runs=1, committed=int(not manifest_fails))


def test_polls_go_on_while_rank_0_writes_the_manifest(shared_dir, comm, monkeypatch):  # noqa: F811
    """Rank 0 writes the manifest (fsync, rename, directory fsync: slow on a parallel file
    system's metadata server) in a thread: no poll waits for it, and the commit still ends at
    the same call everywhere."""
    real_write = StepCatalog.write_manifest

    def slow(self, step, manifest):  # type: ignore[no-untyped-def]
        time.sleep(0.5)
        return real_write(self, step, manifest)

    monkeypatch.setattr(StepCatalog, "write_manifest", slow)
    mgr = CheckpointManager(shared_dir, comm=comm)
    assert mgr.save_async(1, full_state(1, comm.rank, comm.size)) == "started"
    all_written(mgr, comm)
    n, longest = timed_polls_until_committed(mgr, pause_s=0.02)
    assert longest < 0.25, f"a poll waited {longest:.3f} s for the manifest's 0.5 s write"
    assert n > first_commit_call(comm) - 1 and len(set(comm.allgather(n))) == 1   # the calls during the write were extra ones
    assert mgr.latest_step() == 1 and not mgr.persist_in_flight
    mgr.close()


def test_a_rank_ahead_of_rank_0_does_not_wait_for_it_in_poll(shared_dir, comm):  # noqa: F811
    """Rank 0 reaches each poll 0.15 s after the others (its steps run later, by less than a
    step of 0.3 s): the others' polls never wait for it, since every collective of the commit
    is completed two calls after it started and moved on (``MPI_Test``) at the call between.
    (Completed at the very next call, a rank ahead waited there for rank 0, the root of the
    reduction, to reach that call and relay the result.)"""
    mgr = CheckpointManager(shared_dir, comm=comm)
    assert mgr.save_async(1, full_state(1, comm.rank, comm.size)) == "started"
    all_written(mgr, comm)
    if comm.rank == 0:
        time.sleep(0.15)
    n, longest = timed_polls_until_committed(mgr, pause_s=0.3)
    assert len(set(comm.allgather(n))) == 1 and mgr.latest_step() == 1
    if comm.rank != 0:
        assert longest < 0.08, f"a poll of rank {comm.rank} waited {longest:.3f} s for rank 0"
    mgr.close()


def test_one_rank_commits_at_the_second_poll(shared_dir, comm):  # noqa: F811
    """A job of one rank (a single-GPU job's poll loop) has no rank to wait for: its commit does
    not take the eight polls that keep ranks from waiting for each other. The first poll after
    the write starts rank 0's manifest thread; the next one that finds it written commits."""
    mgr = CheckpointManager(shared_dir / f"own{comm.rank}", comm=Comm.serial())
    state = full_state(1)
    assert mgr.save_async(1, state) == "started"
    while not mgr.persist_done:
        time.sleep(0.01)
    assert mgr.poll() is False
    n, longest = timed_polls_until_committed(mgr, pause_s=0.05)
    assert n <= 3, f"{n + 1} polls to commit on one rank"
    assert mgr.latest_step() == 1 and not mgr.persist_in_flight
    mgr.close()
