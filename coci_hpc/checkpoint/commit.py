"""Phase 4 of the save transaction (:mod:`.transaction`): the commit.

ALL ranks agree that every rank wrote (:class:`Written`), rank 0 gathers the commit messages
(CRCs, changed per-rank skeletons) and seals the step (:func:`seal`: the manifest, the commit
point, then retention), and every rank hears the outcome (:class:`Commit`). One process that
wrote every rank's pieces (the survivors' save) reads them back (:func:`verify`) and seals.
"""
from __future__ import annotations

import json
import os
import pickle
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from coci_hpc.checkpoint import integrity
from coci_hpc.checkpoint.entries import manifest_of
from coci_hpc.checkpoint.leaves import LeafKind
from coci_hpc.checkpoint.prepared import Prepared
from coci_hpc.checkpoint.rawio import WriteItem, pread_into
from coci_hpc.comm import Comm, Pending
from coci_hpc.errors import CheckpointError

T = TypeVar("T")


@dataclass
class Written:
    """This rank's write of one save: done now (sync) or by a background thread (async)."""

    crcs: list[int] | None = None
    error: BaseException | None = None
    timeout_s: float | None = None
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.timeout_s is not None:
            self.deadline = time.monotonic() + self.timeout_s

    def finish(self, crcs: list[int] | None = None, error: BaseException | None = None) -> None:
        self.crcs, self.error = crcs, error
        self.done.set()

    def timed_out(self, step: int, rank: int) -> bool:
        if self.done.is_set() or self.deadline is None or time.monotonic() < self.deadline:
            return False
        if self.error is None:
            self.error = TimeoutError(
                f"the background write of step {step} did not finish within {self.timeout_s:g} s on "
                f"rank {rank} (hung filesystem or stuck process?)")
        return True


# What each rank contributes to the "finished writing?" MIN-allreduce of the commit.
_TIMED_OUT, _WRITING, _DONE_FAILED, _DONE_OK = -1.0, 0.0, 1.0, 2.0


class Commit:
    """4. ALL ranks: the commit of one save, as a sequence of non-blocking collectives;
    :meth:`run` completes them at once (the sync save), :meth:`step` a bit more per call (the
    async save's ``poll``):

    a. agree (MIN-allreduce) whether every rank finished writing, without error, and on the size
       of the largest commit message; repeated until all finished;
    b. gather every rank's commit message (CRCs, per-rank skeleton if changed) on rank 0, which
       then builds and writes the manifest in a thread (:class:`_Sealer`: the commit point);
    c. agree (MIN-allreduce) on rank 0's outcome: still sealing (repeated), failed, or committed;
       rank 0 records the commit in its catalog and applies retention first.

    Stepped, each collective is started at one call and completed two calls later, with an
    ``MPI_Test`` at the call between (:meth:`_completed`): the root of a reduction tree relays
    the others' data at that test, so a rank whose steps run ahead of rank 0's by less than a
    step never waits for it (completed at the next call, as until 2026-12-01, it waited for
    rank 0 to reach that call: 23-127 ms in 3 of 9 saves of a two-rank harness of the sharded
    benchmark, none in 11 with the test). Rank 0 writes the manifest (fsync, rename, directory fsync:
    5-20 ms here, more on a parallel file system's metadata server) while training goes on.
    Every rank completes every collective at the same call, so :meth:`step` returns True on
    every rank at the same call: the eighth after the last rank finished writing, or later
    while rank 0 is still sealing. One rank has nobody to wait for: its collectives complete
    where they start, and its commit ends at the second call (the manifest written in the
    thread meanwhile), not the eighth (a single-GPU job's ``poll()`` loop).

    A failure anywhere (a rank's write, a timeout, the manifest) is raised on every rank as one
    CommError naming the failed ranks; the transaction aborts (:meth:`~.transaction.SaveTransaction.abort`,
    after :meth:`settle`).
    """

    def __init__(self, comm: Comm, prepared: Prepared, written: Written, keep: int) -> None:
        self.comm, self.prepared, self.written, self.keep = comm, prepared, written, keep
        self.removed: list[int] = []      # steps retention removed (rank 0)
        self.manifest_s = 0.0
        self._block = False
        self._sealer: _Sealer | None = None
        self._steps = self._run()

    def step(self, block: bool = False) -> bool:
        """Move the commit on (``block``: to its end); True once committed, on every rank at the
        same call. Raises the agreed error on failure."""
        self._block = block
        try:
            next(self._steps)
        except StopIteration:
            return True
        return False

    def run(self) -> list[int]:
        self.step(block=True)
        return self.removed

    def settle(self) -> None:
        """Wait for rank 0's manifest thread, if one is running (before a failed save is
        discarded: the thread must not write into a directory being removed)."""
        if self._sealer is not None:
            self._sealer.join_thread()

    def _completed(self, pending: Pending[T]) -> Generator[None, None, T]:
        """The result of ``pending``: two steps on (tested at the one between), or now
        (blocking, or one rank: there is no other rank to wait for, so its collectives are
        complete as soon as they start). Every rank makes the same calls, so every rank completes
        it at the same one."""
        if not self._block and self.comm.size > 1:
            yield
            if not self._block:
                pending.test()
                yield
        return pending.wait()

    def _again(self) -> Generator[None, None, None]:
        """Before a stage is repeated (still writing, still sealing): the next call, where
        :meth:`_completed` took none (one rank), so that a poll never waits."""
        if not self._block and self.comm.size == 1:
            yield

    def _run(self) -> Generator[None, None, None]:
        comm, prepared, written = self.comm, self.prepared, self.written
        data, blob = b"", None
        while True:  # a.
            if self._block and not written.done.is_set():
                written.done.wait(None if written.deadline is None else max(0.0, written.deadline - time.monotonic()))
            if written.done.is_set():
                flag = _DONE_FAILED if written.error is not None else _DONE_OK
            else:
                flag = _TIMED_OUT if written.timed_out(prepared.step, comm.rank) else _WRITING
            if flag == _DONE_OK and not data:  # this rank's commit message, made once
                try:
                    message, blob = commit_message(prepared, written.crcs)
                    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:  # noqa: BLE001 - agreed on like a failed write
                    written.error, flag = exc, _DONE_FAILED
            sent = len(data) if flag == _DONE_OK else 0
            agreed, longest = yield from self._completed(comm.iallreduce_min_array([flag, -sent]))
            if agreed != _WRITING:
                break
            yield from self._again()
        if written.thread is not None and written.done.is_set():
            written.thread.join()
        if agreed != _DONE_OK:  # some rank failed or timed out: one error on every rank
            comm.check(written.error, f"writing checkpoint step {prepared.step}")
            raise AssertionError("the ranks agreed on success after a failure was reported")
        raw = yield from self._completed(comm.igather_bytes(data, int(-longest)))  # b.
        error: BaseException | None = None
        if raw is not None:  # rank 0
            try:
                gathered = [pickle.loads(b) for b in raw]  # noqa: S301 - our own ranks' messages, over MPI
                commit_received(prepared, blob, gathered)
                self._sealer = _Sealer(comm.size, prepared, gathered, start=not self._block)
            except Exception as exc:  # noqa: BLE001 - every rank hears of it below
                error = exc
        else:
            commit_received(prepared, blob, None)
        if not self._block:
            yield  # rank 0's thread writes the manifest meanwhile
        sealer = self._sealer
        while True:  # c.
            flag = _SEALED
            if sealer is not None and error is None:
                if self._block:
                    sealer.join()
                if not sealer.done():
                    flag = _SEALING
                else:
                    self.manifest_s, error = sealer.seconds, sealer.error
                    if error is None:
                        try:  # in this thread: the catalog's listing is this thread's alone
                            assert prepared.catalog is not None
                            prepared.catalog.committed_now(prepared.step)
                            self.removed = prepared.catalog.retain(self.keep, recycle=not prepared.tuning.lustre)
                        except Exception as exc:  # noqa: BLE001 - every rank hears of it below
                            error = exc
            if error is not None:
                flag = _SEAL_FAILED
            (outcome,) = yield from self._completed(comm.iallreduce_min_array([flag]))
            if outcome != _SEALING:
                break
            yield from self._again()
        if outcome != _SEALED:  # the same CommError on every rank
            comm.check(error, f"committing checkpoint step {prepared.step}")
            raise AssertionError("rank 0 reported a failed manifest but no error")


# What each rank contributes to the outcome's MIN-allreduce (c.); only rank 0 says other than _SEALED.
_SEALING, _SEAL_FAILED, _SEALED = 0.0, 1.0, 2.0


class _Sealer:
    """Rank 0: the manifest of a gathered commit built (:func:`manifest_from`) and written
    (``StepCatalog.write_manifest``: temp name, fsync, rename, directory fsync; the commit
    point) in a thread of its own, started at once (the async save's poll), or in the caller
    by :meth:`join` (``start=False``: a blocking commit). The thread touches nothing the
    training thread uses: the step's own directory, and the catalog's I/O alone."""

    def __init__(self, world_size: int, prepared: Prepared, gathered: list[dict[str, Any]], *,
                 start: bool) -> None:
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._args = (world_size, prepared, gathered)
        self._ran = False
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="coci-seal", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        world_size, prepared, gathered = self._args
        try:
            assert prepared.catalog is not None
            prepared.catalog.write_manifest(prepared.step, manifest_from(world_size, prepared, gathered))
        except BaseException as exc:  # noqa: BLE001 - reported by rank 0 in the outcome's agreement
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - t0
            self._ran = True

    def done(self) -> bool:
        return self._ran

    def join(self) -> None:
        """The manifest written: the thread's end, or (``start=False``) written now."""
        if self._thread is not None:
            self._thread.join()
        elif not self._ran:
            self._run()

    def join_thread(self) -> None:
        """The thread's end, if one was started; never writes the manifest itself (a failed
        save is about to be discarded)."""
        if self._thread is not None:
            self._thread.join()


def verify(prepared: Prepared, items: Sequence[WriteItem], crcs: Sequence[int]) -> None:
    """Read every item back from the file and check it against its CRC-32C (before it counts)."""
    fd = os.open(prepared.data_path, os.O_RDONLY)
    try:
        for it, crc in zip(items, crcs):
            buf = np.empty(it.buf.nbytes, dtype=np.uint8)
            if buf.nbytes:
                pread_into(fd, buf, it.offset)
            if integrity.checksum(buf) != crc:
                raise OSError(f"bytes {it.offset}..{it.offset + buf.nbytes} of {prepared.data_path} read back "
                              f"with a wrong checksum")
    finally:
        os.close(fd)


def commit_message(prepared: Prepared, crcs: list[int] | None) -> tuple[dict[str, Any], bytes | None]:
    """What this rank sends rank 0 for the commit (its CRCs and, when changed, its per-rank
    skeleton), and the skeleton's JSON form for :func:`commit_received`."""
    skeleton, blob = _skeleton_to_send(prepared)
    return {"crcs": crcs, LeafKind.PER_RANK: skeleton}, blob


def commit_received(prepared: Prepared, blob: bytes | None, gathered: list[dict[str, Any]] | None) -> None:
    """After the commit gather: from now on this rank and rank 0 both know this skeleton."""
    cache = prepared.layouts
    if cache is not None:
        cache.sent_skeleton = blob
        for r, g in enumerate(gathered or ()):
            if g[LeafKind.PER_RANK] is not None:
                cache.skeletons[r] = g[LeafKind.PER_RANK]


def seal(world_size: int, prepared: Prepared, gathered: list[dict[str, Any]], keep: int, *,
         background: bool = True) -> list[int]:
    """Rank 0, no communication: write the manifest of ``prepared`` from every rank's commit
    message (the commit point, ``catalog.commit``), then apply retention; returns the steps
    removed. (The commit of a save, :class:`Commit`, does the same in two parts.)"""
    m = manifest_from(world_size, prepared, gathered)
    assert prepared.catalog is not None
    prepared.catalog.commit(prepared.step, m)
    return prepared.catalog.retain(keep, background=background, recycle=not prepared.tuning.lustre)


def manifest_from(world_size: int, prepared: Prepared, gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest of ``prepared`` from every rank's commit message (a rank that sent no
    skeleton has the one it sent last, cached)."""
    assert prepared.full is not None
    cache = prepared.layouts
    if any(g[LeafKind.PER_RANK] is None for g in gathered):
        assert cache is not None
        for r, g in enumerate(gathered):
            if g[LeafKind.PER_RANK] is None:
                if r not in cache.skeletons:
                    raise CheckpointError(f"rank {r} sent no skeleton and none is cached",
                                          hint="report this; save again under a new step")
                g[LeafKind.PER_RANK] = cache.skeletons[r]
    return manifest_of(world_size, prepared, gathered)


def _skeleton_to_send(prepared: Prepared) -> tuple[Any, bytes | None]:
    """(what this rank sends rank 0 as its per-rank skeleton, its JSON form): None when it is
    the one this rank sent at the last commit of the same manager (rank 0 still has it). The
    skeleton goes into the JSON manifest, so its JSON text is exactly what must not change; it
    also tells 1, 1.0 and True apart, which ``==`` does not."""
    skeleton = prepared.skeletons[LeafKind.PER_RANK]
    if prepared.layouts is None:
        return skeleton, None
    blob = json.dumps(skeleton, separators=(",", ":")).encode()
    return (None if blob == prepared.layouts.sent_skeleton else skeleton), blob


