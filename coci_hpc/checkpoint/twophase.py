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

Commit of a finished persist happens at a later collective call: ``poll()`` (non-blocking: a
small ``MPI_Iallreduce`` started by one call is completed by the next; call it every step to
commit promptly), ``wait()``, ``start()`` or ``close()``.
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

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint import engine
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.catalog import StepCatalog
from coci_hpc.checkpoint.coordinator import LayoutCache
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.protocol import StorageWriter
from coci_hpc.checkpoint.rawio import WriteItem, aligned_empty, lower_thread_priority
from coci_hpc.checkpoint.state import Leaf, collect
from coci_hpc.comm import Comm, PendingMin
from coci_hpc.errors import UsageError

ON_BUSY = ("wait", "skip")


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
        self._pending: PendingMin | None = None
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
        self._finish_pending()
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
        """Collective and non-blocking: commit the in-flight checkpoint once every rank finished.

        Each call completes the MIN-allreduce of "done" flags started by the previous call
        (by now every rank has started it, so this does not wait for a slower rank) and starts
        the next one. All ranks see the same results at the same call, so they commit together,
        one ``poll`` after the last rank finished writing.
        """
        if self._job is None:
            return False
        if self._pending is not None:
            result = self._pending.wait()
            self._pending = None
            if result >= 1.0 or result < 0.0:  # all done, or some rank timed out
                self._commit()
                return True
        job = self._job
        flag = 1.0 if job.done.is_set() else (-1.0 if self._timed_out(job) else 0.0)
        self._pending = self.comm.iallreduce_min(flag)
        return False

    def _timed_out(self, job: _Job) -> bool:
        if job.done.is_set() or job.deadline is None or time.monotonic() < job.deadline:
            return False
        if job.error is None:
            job.error = TimeoutError(
                f"the background write of step {job.prepared.step} did not finish within "
                f"{self.timeout_s:g} s on rank {self.comm.rank} (hung filesystem or stuck process?)")
        job.snapshot_done.set()  # never leave the optimizer pre-hook waiting for it
        return True

    def _finish_pending(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def wait(self) -> None:
        """Collective: block until the in-flight persist is done everywhere, then commit it."""
        self._finish_pending()
        if self._job is None:
            return
        job = self._job
        remaining = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
        if not job.done.wait(remaining):
            self._timed_out(job)
        self._commit()

    def close(self) -> None:
        self.wait()
        mf.wait_for_deletions()

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

    def _commit(self) -> None:
        job, self._job = self._job, None
        assert job is not None
        if job.thread is not None and job.done.is_set():
            job.thread.join()
        self.last_stats.update({"snapshot_s": job.t_snapshot, "persist_s": job.t_persist})
        try:
            engine.commit(self.comm, job.prepared, job.crcs, job.error, self.keep)
        except BaseException as exc:
            engine.discard(self.comm, job.prepared)
            if self.on_failure is not None:
                self.on_failure(job.prepared, job.items, exc)  # retries it, or raises a clearer error
                self.committed.append(job.prepared.step)
                return
            raise
        self.committed.append(job.prepared.step)
