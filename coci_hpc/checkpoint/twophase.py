"""Two-phase (CheckFreq-style) save: snapshot to host memory, persist in the background.

Design that cannot hang
-----------------------
Every MPI call (allgather of the plan, the collective HDF5 file and dataset creation, the
agreement on success, the manifest commit, the barrier) happens in the MAIN thread, inside calls
that every rank makes at the same training step: :meth:`TwoPhaseSaver.start` (from
``save_async``), :meth:`poll`, :meth:`wait` and :meth:`close`. The background thread makes no MPI
call and no HDF5 call: it copies the snapshot and writes its pieces into the already created
datasets with plain ``pwrite`` at their fixed offsets, then ``fsync``. So the training loop's own
collectives (allreduce of gradients, ...) can never interleave with ours inside MPI, there is no
need for ``MPI_THREAD_MULTIPLE``, and no lock is shared with the training thread except the GIL,
which ``pwrite``, ``fsync``, the CRC-32C and numpy copies release. (The alternative, MPI-IO
from the thread on a duplicated communicator, depends on the MPI library's thread level and on
h5py holding the GIL during I/O; rejected.)

Phases
------
``start(step, state)`` (collective):
  1. flatten the state; small tensors (< ``overlap_min_bytes``) and all JSON are copied now;
  2. prepare: plan, directory, file and datasets (collective, main thread);
  3. only the bytes THIS rank will write (its ~1/N of the replicated tensors, its per-rank and
     sharded parts) are copied into reused, page-aligned host buffers (pinned when CUDA is
     available) either now
     (``overlap=False``) or by the background thread while the next iteration's forward and
     backward run (``overlap=True``). In that case the state must not be modified in place
     before :meth:`wait_snapshot` returns; :class:`~coci_hpc.checkpoint.api.CheckpointManager`
     installs it as a ``step`` pre-hook on every optimizer in the state, so ``optimizer.step()``
     waits for the copy automatically (CheckFreq: "only the weight update waits").
  4. the background thread persists (pwrite, O_DIRECT for whole aligned pages, + fsync +
     CRC-32C per piece) at a lower CPU priority (nice 10) than the training threads.

A second ``start`` while a persist is in flight does what ``on_busy`` says:
  * ``"wait"`` (default): block until the persist finishes, commit it, then start the new one;
  * ``"skip"``: if any rank is still persisting, return ``"skipped"`` on every rank and save
    nothing (the ranks agree with one allreduce); otherwise commit the old one and start.

Commit of a finished persist happens at later collective calls: ``poll()`` (call it every
step) spreads it over a few calls, each completing the small non-blocking collective started by
the previous call and starting the next (all finished? -> gather the CRCs on rank 0, which writes
the manifest -> broadcast the outcome; :meth:`TwoPhaseSaver._settle`), so no training step waits
for another rank to reach the same call; ``poll`` returns True on every rank at the same call,
the fourth call after the last rank finished writing. ``wait()``, ``start()`` (through
``make_room``) and ``close()`` finish whatever stage the commit is in, blocking. Until the
manifest is written nothing is committed, and "latest" is still the previous checkpoint.
Background errors are re-raised there on EVERY rank as one CommError naming the failed ranks.
``close()`` runs at interpreter exit too; if it fails there the error is printed and the process
exits with status 1, so a failed persist is never silent.

Only tensors that nothing but an optimizer step changes (parameters and state of the
optimizers that got the snapshot pre-hook, :func:`~coci_hpc.checkpoint.state.guarded_ptrs`) are
copied in the background; every other tensor (module buffers that forward updates in place,
tensors in plain dicts) is copied before ``start`` returns, so the snapshot cannot tear.

A persist that does not finish within ``timeout_s`` (a hung filesystem, a stuck rank) is
abandoned: ``wait`` gives up after the timeout, ``poll`` reports it through its allreduce, and
the commit agreement raises one CommError on every rank naming the rank that timed out. Nothing
is committed, the snapshot pre-hook is released, and the step directory is removed.
"""
from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from coci_hpc.checkpoint import engine
from coci_hpc.checkpoint.catalog import StepCatalog
from coci_hpc.checkpoint.coordinator import LayoutCache
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.protocol import StorageWriter
from coci_hpc.checkpoint.rawio import WriteItem, aligned_empty, lower_thread_priority
from coci_hpc.checkpoint.state import Leaf, collect
from coci_hpc.comm import Comm, Pending
from coci_hpc.errors import UsageError

ON_BUSY = ("wait", "skip")
T = TypeVar("T")
# What each rank contributes to the "finished writing?" MIN-allreduce of the commit.
_TIMED_OUT, _WRITING, _DONE_FAILED, _DONE_OK = -1.0, 0.0, 1.0, 2.0


class HostBuffers:
    """Host copies of the state's tensors, reused across checkpoints (pinned when CUDA)."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}
        self._pinned: dict[str, torch.Tensor] = {}

    def get(self, name: str, nbytes: int) -> np.ndarray:
        buf = self._bufs.get(name)
        if buf is None or buf.nbytes != nbytes:
            if torch.cuda.is_available():
                t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self._pinned[name] = t
                buf = t.numpy()
            else:
                buf = aligned_empty(nbytes)
            self._bufs[name] = buf
        return buf

    def pinned(self, name: str) -> torch.Tensor | None:
        return self._pinned.get(name)

    def drop_unused(self, names: set[str]) -> None:
        for n in [n for n in self._bufs if n not in names]:
            del self._bufs[n]
            self._pinned.pop(n, None)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


def copy_bytes(leaf: Leaf, start: int, dst: np.ndarray, pinned: torch.Tensor | None) -> None:
    """Copy bytes [start, start + dst.nbytes) of a leaf into ``dst``."""
    stop = start + dst.nbytes
    if leaf.array is not None:
        np.copyto(dst, leaf.array.view(np.uint8)[start:stop])
        return
    assert leaf.source is not None
    src = leaf.source.contiguous().reshape(-1).view(torch.uint8)[start:stop]
    if pinned is not None:
        pinned.copy_(src, non_blocking=True)
        torch.cuda.current_stream(src.device).synchronize()
    else:
        np.copyto(dst, src.cpu().numpy())


@dataclass
class _Job:
    prepared: engine.Prepared
    items: list[WriteItem]
    deferred: list[tuple[Leaf, int, np.ndarray, torch.Tensor | None]]
    snapshot_done: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    crcs: list[int] | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None
    deadline: float | None = None
    t_start: float = 0.0
    t_snapshot: float = 0.0
    t_persist: float = 0.0
    settle: Generator[None, None, None] | None = None  # TwoPhaseSaver._settle of this job, once begun


class TwoPhaseSaver:
    def __init__(self, comm: Comm, root: Path, writer: StorageWriter, tuning: Callable[[], IOTuning],
                 *, keep: int, on_busy: str = "wait", overlap: bool = True, rng: bool = True,
                 overlap_min_bytes: int = 1 << 20, direct: bool = True,
                 timeout_s: float | None = None,
                 on_failure: Callable[[engine.Prepared, list[WriteItem], BaseException], None] | None = None,
                 layouts: LayoutCache | None = None, catalog: StepCatalog | None = None) -> None:
        if on_busy not in ON_BUSY:
            raise UsageError(f"on_busy={on_busy!r} is not one of {ON_BUSY}",
                             hint="'wait' blocks until the previous persist commits; 'skip' drops the new save")
        self.comm, self.root, self.writer, self.tuning = comm, root, writer, tuning
        self.keep, self.on_busy, self.overlap, self.rng = keep, on_busy, overlap, rng
        self.overlap_min_bytes = overlap_min_bytes
        self.direct = direct
        self.timeout_s = timeout_s
        self.on_failure = on_failure
        self.layouts = layouts if layouts is not None else LayoutCache()
        self.catalog = catalog if catalog is not None else StepCatalog(root)
        self.buffers = HostBuffers()
        self._job: _Job | None = None
        self._blocking = False  # how the running _settle step completes its collective
        self.last_stats: dict[str, float] = {}
        self.committed: list[int] = []

    @property
    def in_flight(self) -> bool:
        return self._job is not None

    @property
    def persist_done(self) -> bool:
        """Local: this rank's background write of the in-flight save has finished (True when none
        is in flight); committing it is still collective."""
        return self._job is None or self._job.done.is_set()

    # ------------------------------------------------------------------ collective calls
    def make_room(self) -> bool:
        """Collective: settle the persist in flight as ``on_busy`` says; False: skip the new save."""
        if self._job is not None:
            if self.on_busy == "skip":
                if self.comm.allreduce_min(1.0 if self._job.done.is_set() else 0.0) < 1.0:
                    return False
            self.wait()
        return True

    def start(self, step: int, state: Mapping[str, Any], guarded: frozenset[int] = frozenset(),
              ) -> str:
        """Collective; returns "started". The caller has settled the previous save first
        (:meth:`make_room` returned True: ``CheckpointManager.save_async`` does it before deciding
        on rollback and retention, which need that save committed).

        ``guarded``: data pointers of tensors that may be copied in the background (only an
        optimizer step with the snapshot pre-hook changes them); all others are copied now.
        """
        t0 = time.perf_counter()
        if self._job is not None:
            raise RuntimeError("TwoPhaseSaver.start with a save in flight: call make_room() first")
        skeletons, leaves = collect(state, rng=self.rng, defer_device=True, guarded=guarded)
        prepared = engine.prepare(self.comm, self.root, step, skeletons, leaves, self.writer, self.tuning(),
                                  self.layouts, self.catalog)
        # Snapshot only the bytes this rank writes: 1/N of the replicated state plus its own.
        items: list[WriteItem] = []
        deferred = []
        used = set()
        for p in prepared.my_pieces():
            leaf = prepared.leaves[p.leaf]
            key = f"{p.leaf}@{p.src_start}"
            used.add(key)
            buf = self.buffers.get(key, p.stop - p.start)
            items.append(WriteItem(prepared.offsets[p.dataset] + p.start, buf))
            copy = (leaf, p.src_start, buf, self.buffers.pinned(key))
            if self.overlap and leaf.deferrable and buf.nbytes >= self.overlap_min_bytes:
                deferred.append(copy)
            else:
                copy_bytes(*copy)
        self.buffers.drop_unused(used)
        job = _Job(prepared, items, deferred, t_start=t0,
                   deadline=None if self.timeout_s is None else time.monotonic() + self.timeout_s)
        if not deferred:
            job.snapshot_done.set()
        job.thread = threading.Thread(target=self._persist, args=(job,), name="coci-persist", daemon=True)
        self._job = job
        job.thread.start()
        self.last_stats = {"start_blocked_s": time.perf_counter() - t0}
        return "started"

    def poll(self) -> bool:
        """Collective and non-blocking: move the commit of the in-flight checkpoint one stage on;
        True at the call that committed it (the same call on every rank).

        Each call completes the non-blocking collective started by the previous call (every
        rank started it one call ago, so this does not wait for a slower rank to reach this
        call) and starts the next one; see :meth:`_settle`. The commit finishes at the fourth
        call after the last rank finished writing.
        """
        if self._job is None:
            return False
        return self._advance(block=False)

    def _timed_out(self, job: _Job) -> bool:
        if job.done.is_set() or job.deadline is None or time.monotonic() < job.deadline:
            return False
        if job.error is None:
            job.error = TimeoutError(
                f"the background write of step {job.prepared.step} did not finish within "
                f"{self.timeout_s:g} s on rank {self.comm.rank} (hung filesystem or stuck process?)")
        job.snapshot_done.set()  # never leave the optimizer pre-hook waiting for it
        return True

    def wait(self) -> None:
        """Collective: block until the in-flight persist is done everywhere, then commit it
        (finishing a commit that :meth:`poll` calls began)."""
        if self._job is not None:
            self._advance(block=True)

    def close(self) -> None:
        self.wait()
        self.catalog.wait_for_deletions()   # this manager's deletions only

    def _advance(self, block: bool) -> bool:
        """Run the in-flight job's :meth:`_settle` to its next stop (``block``: to its end)."""
        job = self._job
        assert job is not None
        if job.settle is None:
            job.settle = self._settle(job)
        self._blocking = block
        try:
            next(job.settle)
        except StopIteration:
            return True
        return False

    def _completed(self, pending: Pending[T]) -> Generator[None, None, T]:
        """Inside :meth:`_settle`: the result of ``pending``, at the next call (``poll``) or now
        (``wait``). Every rank makes the same calls, so every rank completes it at the same one."""
        if not self._blocking:
            yield
        return pending.wait()

    def _settle(self, job: _Job) -> Generator[None, None, None]:
        """The end of a background save, as a sequence of non-blocking collectives; each
        ``poll`` completes one and starts the next, ``wait`` runs the rest at once:

        1. agree (MIN-allreduce) whether every rank finished writing, without error, and on the
           size of the largest commit message; repeated each call until all finished;
        2. gather every rank's commit message (CRCs, per-rank skeleton if changed) on rank 0,
           which then writes the manifest (the commit point) and applies retention;
        3. broadcast rank 0's outcome: committed, or failed.

        A failure anywhere (a rank's write, a timeout, the manifest) leaves the non-blocking path
        at a step every rank reaches at the same call, and is then agreed on with the blocking
        collectives of :func:`engine.commit` (one CommError on every rank naming the failed
        ranks); the step directory is discarded on every rank, and ``on_failure`` may retry.
        """
        data, blob = b"", None
        try:
            while True:
                if self._blocking and not job.done.is_set():
                    remaining = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
                    job.done.wait(remaining)
                if job.done.is_set():
                    flag = _DONE_FAILED if job.error is not None else _DONE_OK
                else:
                    flag = _TIMED_OUT if self._timed_out(job) else _WRITING
                if flag == _DONE_OK and not data:  # this rank's commit message, made once
                    try:
                        message, blob = engine.commit_message(job.prepared, job.crcs)
                        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
                    except Exception as exc:  # noqa: BLE001 - agreed on like a failed write
                        job.error, flag = exc, _DONE_FAILED
                sent = len(data) if flag == _DONE_OK else 0
                agreed, longest = yield from self._completed(self.comm.iallreduce_min_array([flag, -sent]))
                if agreed != _WRITING:
                    break
            self._finish_thread(job)
            if agreed != _DONE_OK:  # some rank failed or timed out: agree on it the blocking way
                engine.commit(self.comm, job.prepared, job.crcs, job.error, self.keep)
                raise AssertionError("engine.commit agreed on success after a failure was reported")
            raw = yield from self._completed(self.comm.igather_bytes(data, int(-longest)))
            error: BaseException | None = None
            t0 = time.perf_counter()
            if raw is not None:  # rank 0
                try:
                    gathered = [pickle.loads(b) for b in raw]  # noqa: S301 - our own ranks' messages, over MPI
                    engine.commit_received(job.prepared, blob, gathered)
                    engine.write_manifest(self.comm.size, job.prepared, gathered, self.keep)
                except Exception as exc:  # noqa: BLE001 - every rank hears of it below
                    error = exc
            else:
                engine.commit_received(job.prepared, blob, None)
            self.last_stats["manifest_s"] = time.perf_counter() - t0
            outcome = self.comm.ibcast_floats([0.0 if error is None else 1.0] if self.comm.rank == 0 else None, 1)
            (failed,) = yield from self._completed(outcome)
            if failed:  # the same CommError on every rank as a blocking commit raises
                self.comm.check(error, f"committing checkpoint step {job.prepared.step}")
                raise AssertionError("rank 0 reported a failed manifest but no error")
        except GeneratorExit:
            raise
        except BaseException as exc:
            self._job = None
            engine.discard(self.comm, job.prepared)
            if self.on_failure is not None:
                self.on_failure(job.prepared, job.items, exc)  # retries it, or raises a clearer error
                self.committed.append(job.prepared.step)
                return
            raise
        self._job = None
        self.committed.append(job.prepared.step)

    def _finish_thread(self, job: _Job) -> None:
        if job.thread is not None and job.done.is_set():
            job.thread.join()
        self.last_stats.update({"snapshot_s": job.t_snapshot, "persist_s": job.t_persist})

    # --------------------------------------------------------------------- local calls
    def wait_snapshot(self) -> float:
        """Block until the snapshot copy is complete (local, no MPI). Returns seconds blocked."""
        job = self._job
        if job is None or job.snapshot_done.is_set():
            return 0.0
        t0 = time.perf_counter()
        job.snapshot_done.wait()
        dt = time.perf_counter() - t0
        self.last_stats["snapshot_wait_s"] = self.last_stats.get("snapshot_wait_s", 0.0) + dt
        return dt

    def quiesce(self, timeout_s: float) -> bool:
        """Local: wait up to ``timeout_s`` for the background write to end, without committing
        (a lost peer: no agreement can follow). The optimizer pre-hook is released."""
        job = self._job
        if job is None:
            return True
        job.snapshot_done.set()
        return job.done.wait(timeout_s)

    # ------------------------------------------------------------------------ internals
    def _persist(self, job: _Job) -> None:
        try:
            for leaf, start, buf, pinned in job.deferred:
                copy_bytes(leaf, start, buf, pinned)
            job.t_snapshot = time.perf_counter() - job.t_start
            job.snapshot_done.set()
            # The copy ran at full priority (the optimizer step may be waiting for it); the
            # writes yield the CPU to training, which keeps interference low on few cores.
            lower_thread_priority()
            job.crcs = engine.write_posix(job.prepared.data_path, job.items, direct=self.direct)
            job.t_persist = time.perf_counter() - job.t_start
        except BaseException as exc:  # noqa: BLE001 - surfaced on every rank at commit
            job.error = exc
        finally:
            job.snapshot_done.set()
            job.done.set()
