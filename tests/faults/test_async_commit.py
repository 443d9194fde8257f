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


def test_the_commit_takes_several_polls_and_ends_at_the_same_call_everywhere(shared_dir, comm):  # noqa: F811
    mgr = CheckpointManager(shared_dir, comm=comm, keep=2)
    state = full_state(1, comm.rank, comm.size)
    mgr.save(1, state)
    state = full_state(2, comm.rank, comm.size)
    expected = canonical(state)
    assert mgr.save_async(2, state) == "started"
    all_written(mgr, comm)
    # One stage per call: agree all written; gather (rank 0 writes the manifest); the outcome.
    assert [mgr.poll(), mgr.poll(), mgr.poll()] == [False, False, False]
    assert mgr.persist_in_flight
    assert mgr.poll() is True and not mgr.persist_in_flight
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


@pytest.mark.parametrize("polls_before", [0, 1, 2, 3])
@pytest.mark.parametrize("manifest_fails", [False, True], ids=["ok", "manifest_fails"])
def test_wait_finishes_a_commit_that_polls_began(shared_dir, comm, monkeypatch, record_figure,  # noqa: F811
                                                 polls_before, manifest_fails):
    """A stop (Session: ``mgr.wait()``) or exit (``close()``) after 0-3 of the commit's polls:
    it commits, or, when rank 0's manifest write fails between two polls, raises the same
    CommError on every rank and commits nothing."""
    mgr = CheckpointManager(shared_dir, comm=comm)
    mgr.save(1, full_state(1, comm.rank, comm.size))
    if manifest_fails:
        real_commit = StepCatalog.commit

        def failing(self, step, manifest):  # type: ignore[no-untyped-def]
            if step == 2:
                raise OSError("Read-only file system")
            return real_commit(self, step, manifest)

        monkeypatch.setattr(StepCatalog, "commit", failing)
    assert mgr.save_async(2, full_state(2, comm.rank, comm.size)) == "started"
    all_written(mgr, comm)
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
    record_figure("async commit: wait() after 0-3 polls", runs=1, committed=int(not manifest_fails))
