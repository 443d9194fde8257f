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
     sharded parts) are copied into reused, page-aligned host buffers (page-locked for device
     tensors, whose copies are queued on a side copy stream and waited for once, in the thread,
     before the write: :class:`~coci_hpc.checkpoint.devices.HostCopies`) either now
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
step) spreads it over a few calls, each small non-blocking collective started at one call,
tested at the next and completed at the one after (all finished? -> gather the CRCs on rank 0,
which writes the manifest in a thread -> agree on the outcome; the one commit of every save,
:class:`~coci_hpc.checkpoint.commit.Commit`, stepped), so no training step waits for another
rank to reach the same call; ``poll`` returns True on every rank at the same call, the eighth
call after the last rank finished writing (later while rank 0 is still writing the manifest; on
one rank the second). ``wait()``, ``start()`` (through
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

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint import devices
from coci_hpc.checkpoint.catalog import StepCatalog
from coci_hpc.checkpoint.commit import Commit, Written
from coci_hpc.checkpoint.coordinator import LayoutCache
from coci_hpc.checkpoint.devices import wait_copies
from coci_hpc.checkpoint.integrity import copy_checksum
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.protocol import StorageWriter
from coci_hpc.checkpoint.rawio import (
    STREAM_MIN,
    WriteItem,
    aligned_empty,
    last_write_times,
    lower_thread_priority,
    stream_copy,
)
from coci_hpc.checkpoint.state import collect
from coci_hpc.checkpoint.transaction import SaveTransaction
from coci_hpc.checkpoint.treecode import Leaf
from coci_hpc.comm import Comm
from coci_hpc.errors import UsageError

ON_BUSY = ("wait", "skip")


class HostBuffers:
    """Host copies of the state's tensors, reused across checkpoints: page-aligned memory, and
    page-locked (``cudaHostRegister``) for the pieces of device tensors, so their copies run
    asynchronously on the side stream at full speed.

    Page-locking gigabytes takes seconds (the first save of issue 32 stalled 1.88 s for it, later
    ones 0.073 s). :meth:`reserve` (:meth:`TwoPhaseSaver.prepare`) does it ahead, in a background
    thread, for the pieces the coming saves will use; :meth:`get` of a reserved piece waits until
    that thread has registered it (never hands out a buffer half-registered), and allocates an
    unreserved one itself (inline, as before). Own buffers rather than ``pin_memory=True``: torch's
    pinned allocator rounds every request up to a power of two (up to 2x the host memory), and the
    writer's O_DIRECT path wants page-aligned memory anyway."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}
        self._pinned: dict[str, torch.Tensor] = {}     # torch views of the page-locked ones
        self._lock = threading.Lock()
        self._ready: dict[str, threading.Event] = {}   # reserved, registered in the background
        self._thread: threading.Thread | None = None
        self.reserve_s = 0.0          # seconds the background registration took (the last reserve)
        self.reserve_error: BaseException | None = None

    def get(self, name: str, nbytes: int, pin: bool = False) -> np.ndarray:
        ready = self._ready.get(name)
        if ready is not None:
            ready.wait()        # its registration (a background thread) is complete before any copy
        with self._lock:
            buf = self._bufs.get(name)
            if buf is not None and (buf.nbytes != nbytes or pin != (name in self._pinned)):
                self._release(name)
                buf = None
            if buf is None:
                buf = self._alloc(name, nbytes, pin)
        # Reused across saves: safe, start() runs only once the previous persist (which reads
        # it, after waiting for its copies) finished (make_room), and every byte is copied in again
        # before this save's write.
        return buf

    def _alloc(self, name: str, nbytes: int, pin: bool) -> np.ndarray:
        # a host leaf's snapshot: huge pages, which its O_DIRECT writes pin at a tenth of the CPU
        buf = devices.pinned_host(nbytes, register=True) if pin else aligned_empty(nbytes, huge=True)
        self._bufs[name] = buf
        if pin:
            self._pinned[name] = torch.from_numpy(buf)
        return buf

    def _release(self, name: str) -> None:
        buf = self._bufs.pop(name)
        self._ready.pop(name, None)
        devices.release_host(buf, registered=self._pinned.pop(name, None) is not None)

    def reserve(self, sizes: Mapping[str, int]) -> None:
        """Allocate and page-lock buffers for ``sizes`` (name -> bytes of a device tensor's piece)
        in a background thread; :meth:`get` of one of them waits for its registration."""
        self.settle()
        # Only new names: a buffer already held may be read by a persist in flight; get() resizes it.
        todo = {n: b for n, b in sizes.items() if n not in self._bufs}
        if not todo:
            return
        for n in todo:
            self._ready[n] = threading.Event()

        def run() -> None:
            t0 = time.perf_counter()
            try:
                for n, b in todo.items():
                    ready = self._ready[n]
                    buf = devices.pinned_host(b, register=True)   # slow: off the training thread
                    with self._lock:
                        self._bufs[n] = buf
                        self._pinned[n] = torch.from_numpy(buf)
                    ready.set()
            except BaseException as exc:  # noqa: BLE001 - the save allocates inline instead
                self.reserve_error = exc
            finally:
                for n in todo:           # never leave get() waiting: an unset one allocates inline
                    ev = self._ready.pop(n, None)
                    if ev is not None:
                        ev.set()
                self.reserve_s = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="coci-pin-ahead", daemon=True)
        self._thread.start()

    def settle(self) -> None:
        """Wait for a background :meth:`reserve` to end."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def pinned(self, name: str) -> torch.Tensor | None:
        return self._pinned.get(name)

    def drop_unused(self, names: set[str]) -> None:
        # No save is in flight here (start's caller settled it): nothing still reads a dropped buffer.
        self.settle()
        with self._lock:
            for n in [n for n in self._bufs if n not in names]:
                self._release(n)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


def copy_bytes(leaf: Leaf, start: int, dst: np.ndarray, pinned: torch.Tensor | None,
               copies: devices.HostCopies | None = None) -> int | None:
    """Copy bytes [start, start + dst.nbytes) of a leaf into ``dst``; returns their CRC-32C where
    the copy computed it on the way (a host leaf, :func:`copy_checksum`), else None. With
    ``copies``, a device leaf's copy is only queued (on its device's side stream):
    ``copies.wait()`` before ``dst`` is read."""
    stop = start + dst.nbytes
    if leaf.array is not None:
        # streaming stores: the snapshot is read next by the writer's pwrite, not by this core,
        # and evicting the training's working set for it only slows the steps beside it
        # (528 MB in 22 MB tensors, copy then pwrite, 7 rounds: 0.075 + 0.100 s with numpy,
        # 0.055 + 0.102 s streamed). The checksum in the same pass costs the copy about 10 %
        # and saves the checksum thread a pass of its own (640 MB on one core: copy 0.028 s,
        # copy + CRC-32C 0.030 s, the crc32c library apart 0.043-0.049 s).
        host = leaf.array.view(np.uint8)[start:stop]
        crc = copy_checksum(dst, host) if dst.nbytes >= STREAM_MIN else None
        if crc is None:
            stream_copy(dst, host)
        return crc
    assert leaf.source is not None
    if pinned is not None and copies is not None:
        # Safe: queued after the step's work (copies ordered its stream after the current one) into
        # a buffer no persist reads any more (make_room); the persist thread waits for it (wait)
        # before writing ``dst``, and later in-place updates wait for it (fence / snapshot_done).
        copies.copy(pinned, leaf.source, start)
        return None
    src = leaf.source.contiguous().reshape(-1).view(torch.uint8)[start:stop]
    if pinned is not None:
        # Issued on the source device's current stream, after the work already queued there (the
        # step that made these values); waited for before ``dst`` is written out or reused. A
        # training loop on a stream of its own must synchronise it before saving.
        pinned.copy_(src, non_blocking=True)
        wait_copies(src.device)
    else:
        stream_copy(dst, src.cpu().numpy())  # .cpu(): a blocking copy (or the host tensor itself)
    return None


@dataclass
class _Job:
    """One save in flight: its transaction planned and created (phases 1-2) in ``start``,
    written by the thread (3), committed by ``poll`` / ``wait`` (4)."""

    tx: SaveTransaction
    items: list[WriteItem]
    deferred: list[tuple[int, Leaf, int, np.ndarray, torch.Tensor | None]]   # (item index, copy_bytes' args)
    written: Written
    commit: Commit
    snapshot_done: threading.Event = field(default_factory=threading.Event)
    t_start: float = 0.0
    t_snapshot: float = 0.0
    t_persist: float = 0.0
    # CPU seconds of the persist (copy_cpu_s: the snapshot copies in the thread; write_cpu_s,
    # crc_cpu_s: the writes and the checksums): what it takes from training on busy cores
    cpu: dict[str, float] = field(default_factory=dict)
    copies: devices.HostCopies = field(default_factory=devices.HostCopies)


class TwoPhaseSaver:
    def __init__(self, comm: Comm, root: Path, writer: StorageWriter, tuning: Callable[[], IOTuning],
                 *, keep: int, on_busy: str = "wait", overlap: bool = True, rng: bool = True,
                 overlap_min_bytes: int = 1 << 20, direct: bool = True,
                 timeout_s: float | None = None,
                 on_failure: Callable[[SaveTransaction, list[WriteItem], BaseException], None] | None = None,
                 layouts: LayoutCache | None = None, catalog: StepCatalog) -> None:
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
        self.catalog = catalog   # the manager's: one catalog per root
        self.buffers = HostBuffers()
        self._job: _Job | None = None
        self.last_stats: dict[str, float] = {}
        self.committed: list[int] = []

    @property
    def in_flight(self) -> bool:
        return self._job is not None

    @property
    def persist_done(self) -> bool:
        """Local: this rank's background write of the in-flight save has finished (True when none
        is in flight); committing it is still collective."""
        return self._job is None or self._job.written.done.is_set()

    # ------------------------------------------------------------------ collective calls
    def make_room(self) -> bool:
        """Collective: settle the persist in flight as ``on_busy`` says; False: skip the new save."""
        if self._job is not None:
            if self.on_busy == "skip":
                if self.comm.allreduce_min(1.0 if self._job.written.done.is_set() else 0.0) < 1.0:
                    return False
            self.wait()
        return True

    def prepare(self, state: Mapping[str, Any], guarded: frozenset[int] = frozenset()) -> int:
        """Collective (every rank, no save in flight): plan the layout of a save of ``state`` (kept
        in the layout cache: the next save of a state of the same shapes reuses it) and allocate and
        page-lock, in a background thread, the host buffers of its device tensors' pieces on this
        rank, so the first :meth:`start` does not stall for them. Returns the bytes reserved (0 for
        a state in host memory: nothing to page-lock). Call it once the state has its final shapes
        (after the first optimizer step has created the optimizer's moments)."""
        if self._job is not None:
            raise RuntimeError("TwoPhaseSaver.prepare with a save in flight: wait() first")
        skeletons, leaves = collect(state, rng=self.rng, defer_device=True, guarded=guarded)
        prepared = SaveTransaction.plan(self.comm, self.writer, self.catalog, self.layouts, 0, skeletons, leaves,
                                        self.tuning(), self.keep).prepared
        sizes = {f"{p.leaf}@{p.src_start}": p.stop - p.start for p in prepared.my_pieces()
                 if prepared.leaves[p.leaf].array is None}
        self.buffers.reserve(sizes)
        return sum(sizes.values())

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
        tx = SaveTransaction.plan(self.comm, self.writer, self.catalog, self.layouts, step, skeletons, leaves,
                                  self.tuning(), self.keep).create()           # 1-2.
        prepared = tx.prepared
        # Snapshot only the bytes this rank writes: 1/N of the replicated state plus its own.
        items: list[WriteItem] = []
        deferred = []
        used = set()
        # Device leaves: every copy on the side stream, ordered (here, in the training thread) after
        # the work its current stream has queued; one wait, in the persist thread, before the write.
        copies = devices.HostCopies()
        for p in prepared.my_pieces():
            leaf = prepared.leaves[p.leaf]
            key = f"{p.leaf}@{p.src_start}"
            used.add(key)
            buf = self.buffers.get(key, p.stop - p.start, pin=leaf.array is None)
            copy = (leaf, p.src_start, buf, self.buffers.pinned(key))
            if leaf.array is None and leaf.source is not None:
                copies.order(leaf.source.device)
            crc = None
            if self.overlap and leaf.deferrable and buf.nbytes >= self.overlap_min_bytes:
                deferred.append((len(items), *copy))
            else:
                crc = copy_bytes(*copy, copies=copies)
            items.append(WriteItem(prepared.offsets[p.dataset] + p.start, buf, crc))
        # The tensors copied now may change in place (forward) as soon as this returns: on the
        # device, that later work waits for these copies (no host wait here).
        copies.fence()
        self.buffers.drop_unused(used)
        written = Written(timeout_s=self.timeout_s)
        job = _Job(tx, items, deferred, written, tx.commit(written), t_start=t0, copies=copies)
        if not deferred:
            # Nothing left for the thread to copy; the optimizer step's kernels are ordered after
            # the side-stream copies on the device (fence above), so it need not wait on the host.
            job.snapshot_done.set()
        written.thread = threading.Thread(target=self._persist, args=(job,), name="coci-persist", daemon=True)
        self._job = job
        written.thread.start()
        self.last_stats = {"start_blocked_s": time.perf_counter() - t0}
        return "started"

    def poll(self) -> bool:
        """Collective and non-blocking: move the commit of the in-flight checkpoint one stage on;
        True at the call that committed it (the same call on every rank).

        Each collective of the commit is started at one call, tested at the next and completed
        at the one after (every rank started it two calls ago, so this does not wait for a
        slower rank to reach this call); see :class:`~coci_hpc.checkpoint.commit.Commit`. The
        commit finishes at the eighth call after the last rank finished writing (one rank: the
        second), or later while rank 0 is still writing the manifest.
        """
        if self._job is None:
            return False
        return self._advance(block=False)

    def wait(self) -> None:
        """Collective: block until the in-flight persist is done everywhere, then commit it
        (finishing a commit that :meth:`poll` calls began)."""
        if self._job is not None:
            self._advance(block=True)

    def close(self) -> None:
        self.wait()
        self.catalog.wait_for_deletions()   # this manager's deletions only

    def _advance(self, block: bool) -> bool:
        """Move the in-flight job's commit on (``block``: to its end); True once committed. On
        a failure the step directory is discarded on every rank, and ``on_failure`` may retry."""
        job = self._job
        assert job is not None
        try:
            done = job.commit.step(block)
            if not done and job.written.error is not None and not job.written.done.is_set():
                job.snapshot_done.set()  # timed out: never leave the optimizer pre-hook waiting for it
        except BaseException as exc:
            self._job = None
            job.snapshot_done.set()  # never leave the optimizer pre-hook waiting for it
            job.commit.settle()      # rank 0's manifest thread is done with the step's directory
            self._note(job)
            job.tx.abort()
            if self.on_failure is None:
                raise
            self.on_failure(job.tx, job.items, exc)  # retries it, or raises a clearer error
            done = True
        if done:
            self._job = None
            self._note(job)
            self.committed.append(job.tx.step)
        return done

    def _note(self, job: _Job) -> None:
        self.last_stats.update({"snapshot_s": job.t_snapshot, "persist_s": job.t_persist,
                                "manifest_s": job.commit.manifest_s,
                                **{f"persist_{k}": v for k, v in job.cpu.items()}})

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
        return job.written.done.wait(timeout_s)

    # ------------------------------------------------------------------------ internals
    def _persist(self, job: _Job) -> None:
        """The background thread: finish the snapshot, then phase 3 (no MPI)."""
        crcs, error = None, None
        c0 = time.thread_time()
        try:
            for i, leaf, start, buf, pinned in job.deferred:
                crc = copy_bytes(leaf, start, buf, pinned, copies=job.copies)
                if crc is not None:
                    job.items[i] = WriteItem(job.items[i].offset, buf, crc)
            # The one wait: no buffer is written (below) or reused (the next start, after this
            # thread ended) and no optimizer step runs (snapshot_done) before every copy landed.
            job.copies.wait()
            job.t_snapshot = time.perf_counter() - job.t_start
            job.snapshot_done.set()
            job.cpu["copy_cpu_s"] = time.thread_time() - c0
            # The copy ran at full priority (the optimizer step may be waiting for it); the
            # writes yield the CPU to training, which keeps interference low on few cores.
            lower_thread_priority()
            crcs = job.tx.write(job.items, independent=True, direct=self.direct)
            job.t_persist = time.perf_counter() - job.t_start
            io = last_write_times()
            job.cpu.update(write_cpu_s=io.get("write_cpu_s", 0.0), crc_cpu_s=io.get("crc_cpu_s", 0.0))
        except BaseException as exc:  # noqa: BLE001 - surfaced on every rank at commit
            error = exc
        finally:
            job.snapshot_done.set()
            job.written.finish(crcs, error)
