"""The user-facing checkpoint API.

    mgr = CheckpointManager("/scratch/ckpt", keep=2)          # comm=None: MPI world if launched by MPI
    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": sampler,
             "planner": planner_state_dict, "extras": {"note": "..."}}
    if mgr.latest_step() is not None:
        step = mgr.load_latest(state).step                   # restores in place, RNG included
    ...
    mgr.save(step, state)                  # synchronous: returns after the commit
    mgr.save_async(step, state)            # two-phase: returns after the snapshot is set up
    mgr.poll()                             # each step: commits a finished background persist
    mgr.close()                            # at the end: waits and commits

Every method marked *collective* must be called by all ranks at the same point.
Semantics (rollback, the directory lock, a full disk, exceptions and exit, a hung rank, launches
without MPI) are described in docs/reference/checkpoint-semantics.md.
"""
from __future__ import annotations

import numbers
import os
import shutil
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import exitguard, h5_parallel, perms, rawio, recovery, transaction
from coci_hpc.checkpoint.catalog import ABANDONED, StepCatalog, is_no_space
from coci_hpc.checkpoint.coordinator import LayoutCache
from coci_hpc.checkpoint.h5_serial import SerialH5Writer
from coci_hpc.checkpoint.launch import check_launch
from coci_hpc.checkpoint.leaves import LeafKind
from coci_hpc.checkpoint.load import LoadResult
from coci_hpc.checkpoint.load import load as load_into
from coci_hpc.checkpoint.lock import CheckpointLocked, DirectoryLock
from coci_hpc.checkpoint.lustre import IOTuning, LustrePolicy, tuning_for
from coci_hpc.checkpoint.prepared import check_step
from coci_hpc.checkpoint.protocol import StorageWriter
from coci_hpc.checkpoint.rawio import WriteItem
from coci_hpc.checkpoint.state import collect, find_optimizers, guarded_ptrs
from coci_hpc.checkpoint.transaction import SaveTransaction
from coci_hpc.checkpoint.twophase import TwoPhaseSaver
from coci_hpc.checkpoint.watchdog import Watchdog
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError, CociError, UsageError

BACKENDS = ("auto", "parallel", "serial")
ON_NO_SPACE = ("raise", "retire_oldest")
DEFAULT_TIMEOUT_S = 600.0


def make_writer(comm: Comm, backend: str) -> StorageWriter:
    if backend not in BACKENDS:
        raise UsageError(f"backend={backend!r} is not one of {BACKENDS}",
                         hint="'auto' picks parallel HDF5 under MPI with an MPI-enabled h5py")
    if backend == "parallel" or (backend == "auto" and h5_parallel.available(comm)):
        return h5_parallel.ParallelH5Writer(comm)
    return SerialH5Writer(comm)


def per_rank_note(result: LoadResult, size: int) -> str | None:
    """What a load on ``size`` ranks did with the ``PerRank`` state of a checkpoint saved on
    another number of ranks (None: same size, or no PerRank state but the RNG streams). The rule:
    each value is its rank's own and is never redistributed; rank r gets saved rank r's value
    back, a saved rank with no counterpart is not loaded, a new rank keeps what it was given."""
    saved = result.saved_world_size
    per_rank = result.manifest.get("skeletons", {}).get(LeafKind.PER_RANK, {})
    keys = sorted({k for tree in per_rank.values() for k in tree} - {"__rng__"})
    if saved == size or not keys:
        return None
    both = min(saved, size)
    text = (f"checkpoint step {result.step} was saved by {saved} rank(s) and is loaded by {size}: PerRank "
            f"state {keys} is each rank's own and is not redistributed; rank(s) 0-{both - 1} got their own "
            f"values back")
    if saved > size:
        text += f"; the values of saved rank(s) {list(range(size, saved))[:8]} were not loaded (no rank has their number now)"
    else:
        text += (f"; rank(s) {list(range(saved, size))[:8]} are new and keep the values they were given "
                 f"(LoadResult.missing lists those keys there, with their RNG streams)")
    return text


def _fresh(phases: dict[str, float]) -> dict[str, float]:
    """``phases`` emptied: a load that falls back to an older step reports that step's load."""
    phases.clear()
    return phases


class CheckpointManager:
    """Save, load and list checkpoints under one directory.

    Sharded parallel-HDF5 checkpoints (``step_NNNNNNNNN/data.h5`` + ``manifest.json``) that
    commit atomically, verify on load and reshard to any world size. Methods marked collective
    are called by every rank at the same point. Values are replicated across ranks by default;
    wrap rank-specific values in ``PerRank(...)`` and tensors split along dim 0 in
    ``Sharded(...)``.

    Args:
        directory: The checkpoint root (created if missing, with the mode ``access`` says).
        comm: Communicator (mpi4py or ``coci_hpc.comm.Comm``). Default: MPI's world when launched
            by MPI, else one process.
        keep: Committed checkpoints to retain (older ones are deleted after a newer commit).
        backend: ``"auto"``, ``"parallel"`` (MPI-IO into an HDF5 file) or ``"serial"`` (the same
            format, no MPI-IO).
        lustre: Stripe settings for new step directories on Lustre
            (``LustrePolicy(stripe_count, stripe_size)``); ignored elsewhere.
        on_busy: A ``save_async`` while one is in flight: ``"wait"`` for it and commit it, or
            ``"skip"`` (returns ``"skipped"`` on every rank); see
            :mod:`coci_hpc.checkpoint.twophase`.
        overlap: Copy large tensors of a two-phase snapshot in a background thread while
            training continues (each optimizer's step waits for that copy).
        rng: Also save and restore every rank's RNG states (python, numpy, torch, CUDA).
        lock: Take the directory's writer lock (:mod:`.lock`) now; ``False`` opens it to read
            only (``save`` is then refused), for tools that look while a run writes.
        on_no_space: ``"raise"`` (a clear ``CheckpointError``; the previous checkpoint stays
            intact) or ``"retire_oldest"`` (delete abandoned and all but the newest committed
            checkpoints, retry once).
        timeout_s: A save (or the wait for a background one) that has not finished after this
            many seconds on some rank is reported naming that rank and not committed (None: no
            limit; default 600).
        access: Who may read what is created: ``"private"`` (directories 0700, files 0600, the
            default, whatever the umask), ``"group-read"`` (0750/0640) or ``"group-write"``
            (0770/0660); see :mod:`.perms`.

    Raises:
        UsageError: A bad ``keep``, ``on_no_space``, ``timeout_s`` or ``access``.
        CheckpointLocked: Another live writer holds the directory.
    """

    def __init__(self, directory: str | os.PathLike, comm: Any = None, *, keep: int = 2,
                 backend: str = "auto", lustre: LustrePolicy | None = None, on_busy: str = "wait",
                 overlap: bool = True, rng: bool = True, lock: bool = True,
                 on_no_space: str = "raise", timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 access: str = "private") -> None:
        if not isinstance(keep, numbers.Integral) or keep < 1:
            raise UsageError(f"keep={keep!r} must be an integer of at least 1", hint="keep=2 keeps the last two")
        if on_no_space not in ON_NO_SPACE:
            raise UsageError(f"on_no_space={on_no_space!r} is not one of {ON_NO_SPACE}",
                             hint="'raise' stops with a clear error; 'retire_oldest' frees space and retries once")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
                                      or not timeout_s > 0):
            raise UsageError(f"timeout_s={timeout_s!r} must be a positive number of seconds or None",
                             hint=f"the default is {DEFAULT_TIMEOUT_S:g}")
        perms.dir_mode(access)  # refuses an unknown access= now, not at the first save
        self.access: str = access
        self.root: Path = Path(directory)
        self.comm: Comm = Comm.wrap(comm)
        check_launch(self.comm)
        self.keep: int = keep
        self.rng: bool = rng
        self.on_no_space: str = on_no_space
        self.timeout_s: float | None = None if timeout_s is None else float(timeout_s)
        self.lustre: LustrePolicy = lustre or LustrePolicy()
        self.writer: StorageWriter = make_writer(self.comm, backend)
        self._tuning: IOTuning | None = None
        self._catalog: StepCatalog = StepCatalog(self.root)  # rank 0's: lists the root once
        self._layouts: LayoutCache = LayoutCache()  # the last save's layout, reused while the state keeps its shape
        self._async: TwoPhaseSaver = TwoPhaseSaver(self.comm, self.root, self.writer, self.tuning, keep=keep,
                                    on_busy=on_busy, overlap=overlap, rng=rng, timeout_s=self.timeout_s,
                                    on_failure=self._async_failed, layouts=self._layouts,
                                    catalog=self._catalog)
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._base: int | None = None   # the step loaded last: the next save retires newer ones
        self.stats: dict[str, float] = {}
        # this rank's time per phase of the last load (load.load's ``stats``, and ``load_s``)
        self.load_stats: dict[str, float] = {}
        self._closed: bool = False
        self._lock: DirectoryLock | None = self._take_lock() if lock else None
        exitguard.register(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def _take_lock(self) -> DirectoryLock | None:
        """Collective: rank 0 takes the writer lock; a refusal is raised on every rank."""
        outcome: Any = None
        held = None
        if self.comm.rank == 0:
            try:
                perms.make_dirs(self.root, perms.dir_mode(self.access))  # the mode of access=, not the umask
                held = DirectoryLock.acquire(self.root)
            except CheckpointLocked as exc:
                outcome = (exc.message, exc.hint)
            except OSError as exc:
                outcome = (f"cannot take the writer lock of {self.root}: {exc}",
                           "check that the directory exists and is writable")
        outcome = self.comm.bcast(outcome)
        if outcome is not None:
            raise CheckpointLocked(outcome[0], hint=outcome[1])
        return held

    def tuning(self) -> IOTuning:
        """Filesystem decisions (Lustre or not), made once on rank 0 and shared."""
        if self._tuning is None:
            local = tuning_for(self.root, self.lustre, self.comm.size, self.access) if self.comm.rank == 0 else None
            self._tuning = self.comm.bcast(local)
        return self._tuning

    def local_tuning(self) -> IOTuning:
        """The shared filesystem decisions when made, else this rank's own, with no collective
        (a survivors' save, where a peer is gone)."""
        if self._tuning is not None:
            return self._tuning
        return tuning_for(self.root, self.lustre, self.comm.size, self.access)

    # -------------------------------------------------------------------------- saving
    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Collective, synchronous: write, fsync and commit ``step``; returns its directory.

        Saving the newest committed step again is a no-op (it returns that directory).

        Args:
            step: The training step the state belongs to (a non-negative integer).
            state: The state to save, by name (modules, optimizers, schedulers, tensors, JSON-able
                values, random number generators (``torch.Generator``, numpy ``Generator`` /
                ``RandomState``, ``random.Random``), ``PerRank`` / ``Sharded`` wrappers).
        """
        t0 = time.perf_counter()
        self._async.wait()
        step = check_step(step)
        with Watchdog(self.comm, self.timeout_s, f"saving checkpoint step {step}") as dog:
            if self._before_save(step) == "skip":
                return cat.step_dir(self.root, step)
            phases: dict[str, float] = {}
            directory = self._with_space(step, lambda: self._save_once(step, state, dog, phases))
        self.stats = {"save_s": time.perf_counter() - t0, **phases}
        return directory

    def _save_once(self, step: int, state: Mapping[str, Any], dog: Watchdog, phases: dict[str, float]) -> Path:
        """One sync save transaction (:func:`.transaction.save`); ``phases``: its time per phase."""
        dog.enter("preparing the file (collective)", waiting_for_others=True)
        t0 = time.perf_counter()
        skeletons, leaves = collect(state, rng=self.rng)
        phases["state_s"] = time.perf_counter() - t0
        return transaction.save(self.comm, self.writer, self._catalog, self._layouts, step, skeletons, leaves,
                           self.tuning(), self.keep, progress=dog.enter, stats=phases)

    def _with_space(self, step: int, attempt: Callable[[], Any], failed: BaseException | None = None) -> Any:
        """The one no-space policy, for the sync save and the async retry: run ``attempt`` (a save
        transaction); on a full disk with on_no_space="retire_oldest", free space and run it
        once more; otherwise (or if that fails too) raise a clear error. ``failed``: the first
        attempt already failed with it (a background save)."""
        for tries in (0, 1):
            if failed is None:
                try:
                    return attempt()
                except CociError as exc:
                    failed = exc
            if not is_no_space(failed):
                raise failed
            if tries == 0 and self.on_no_space == "retire_oldest" and self._free_space():
                failed = None
                continue
            raise self._no_space_error(step, failed) from failed
        raise AssertionError("unreachable")

    def _before_save(self, step: int) -> str:
        """Collective, before anything is written: lock check, rollback, leftovers, duplicates.

        Returns "skip" when ``step`` is the newest committed step already (nothing to write).
        """
        base = self._base

        def decide() -> str | None:
            if self.comm.rank != 0:
                return None
            if self._lock is None:
                raise UsageError(f"this CheckpointManager of {self.root} was opened with lock=False "
                                 f"(read only)", hint="open it with lock=True (the default) to save")
            if not self._lock.still_held():
                raise CheckpointLocked(f"the writer lock of {self.root} was removed or taken over by "
                                       f"another run", hint="two runs must not share a checkpoint directory")
            if base is not None:
                self._catalog.retire_abandoned(base)
            committed = self._catalog.committed()
            if committed and step == committed[-1]:
                return "skip"
            if committed and step < committed[-1]:
                raise CheckpointError(
                    f"cannot save step {step}: step {committed[-1]} is newer and was not rolled back",
                    hint=f"load the step to continue from first (a save after a load moves the newer "
                         f"steps to {self.root / ABANDONED}), or use a new directory")
            self._catalog.remove_partial()
            return "go"

        outcome = self.comm.bcast(self.comm.run_step(decide, f"preparing to save step {step}"))
        self._base = None
        return outcome

    def _free_space(self) -> bool:
        """Collective: on_no_space="retire_oldest": delete old checkpoints; True if any went."""
        freed = self.comm.run_step(lambda: self._catalog.free_space() if self.comm.rank == 0 else None,
                                   "freeing space")
        freed = self.comm.bcast(freed)
        if freed and self.comm.rank == 0:
            print(f"coci_hpc: no space left under {self.root}: deleted {', '.join(freed)} and "
                  f"retrying (on_no_space='retire_oldest')", file=sys.stderr, flush=True)
        return bool(freed)

    def _no_space_error(self, step: int, exc: BaseException) -> CheckpointError:
        try:
            free = f"{shutil.disk_usage(self.root).free / 2**20:.0f} MiB free"
        except OSError:
            free = "free space unknown"
        retried = " even after deleting older checkpoints" if self.on_no_space == "retire_oldest" else ""
        return CheckpointError(
            f"no space left on the device of {self.root} for checkpoint step {step}{retried} "
            f"({free}); step {step} was not committed, its partial directory was removed and the "
            f"previous checkpoint is intact ({exc})",
            hint=f"free space there (old runs, {self.root / ABANDONED}), lower keep, or pass "
                 f"on_no_space='retire_oldest' to delete the older checkpoints (never the newest) "
                 f"and retry once")

    def _async_failed(self, tx: SaveTransaction, items: list[WriteItem], exc: BaseException) -> None:
        """A background save failed to commit (the transaction aborted): the same no-space policy
        as a sync save, retrying the transaction with the snapshot it still holds."""
        def retry() -> None:
            tx.create(again=True)                                     # 2. again: the same offsets
            tx.write_and_commit(lambda: items, independent=True)      # 3-4.

        self._with_space(tx.step, retry, failed=exc)

    def save_async(self, step: int, state: Mapping[str, Any]) -> str:
        """Collective: two-phase save. Returns "started" or "skipped" (on_busy="skip").

        Tensors that only ``optimizer.step()`` changes (parameters and optimizer state) are
        copied while training continues; every optimizer anywhere in ``state`` (also inside
        ``PerRank``, dicts, lists, schedulers) gets a step pre-hook that waits for that copy.
        All other tensors (module buffers that forward changes in place, ...) are copied
        before this returns. So the snapshot cannot tear; see docs/reference/checkpoint-semantics.md.
        Commit it with :meth:`poll` (each step), :meth:`wait` or :meth:`close`.

        Args:
            step: The training step the state belongs to.
            state: The state to save, as for :meth:`save`.
        """
        step = check_step(step)
        optimizers = find_optimizers(state)
        for opt in optimizers:
            if opt not in self._hooked:
                opt.register_step_pre_hook(self._optimizer_pre_hook)
                self._hooked.add(opt)
        if not self._async.make_room():
            return "skipped"
        if self._before_save(step) == "skip":
            return "skipped"
        return self._async.start(step, state, guarded=guarded_ptrs(optimizers))

    def prepare_async(self, state: Mapping[str, Any]) -> int:
        """Collective, optional: get the host buffers of :meth:`save_async` ready ahead, so the
        first two-phase save does not stall for them. For a state on CUDA they are page-locked
        (seconds for gigabytes), in a background thread; the first save waits only for what is
        not done yet. Call it once the state has its final shapes (after the first
        ``optimizer.step()``), with no save in flight; returns the bytes reserved on this rank
        (0 when the state is in host memory). A state whose shapes changed since is still saved
        right (its buffers are allocated at the save, as without this call)."""
        if self._async.in_flight:
            self._async.wait()
        return self._async.prepare(state, guarded=guarded_ptrs(find_optimizers(state)))

    def _optimizer_pre_hook(self, *_: Any) -> None:
        self._async.wait_snapshot()

    def wait_snapshot(self) -> float:
        """Local: block until the in-flight snapshot copy is complete; returns seconds blocked."""
        return self._async.wait_snapshot()

    def poll(self) -> bool:
        """Collective, cheap: commit the background checkpoint if all ranks finished writing it."""
        return self._async.poll()

    def wait(self) -> None:
        """Collective: wait for the background persist and commit it (re-raising its errors)."""
        self._async.wait()

    def quiesce(self, timeout_s: float) -> bool:
        """Local, no MPI: wait up to ``timeout_s`` for this rank's background write to end (a
        peer is lost and the save will never commit). True when none is running any more."""
        return self._async.quiesce(timeout_s)

    @property
    def async_stats(self) -> dict[str, float]:
        """Times of the last background save, this rank: ``start_blocked_s`` (the call),
        ``snapshot_wait_s`` (optimizer steps waiting for the snapshot), ``snapshot_s`` and
        ``persist_s`` (from the call to the snapshot's and the write's end), ``manifest_s``; and
        the CPU seconds the persist used, ``persist_copy_cpu_s`` (snapshot copies in the
        background thread), ``persist_write_cpu_s``, ``persist_crc_cpu_s``: on cores the
        training keeps busy, roughly what the persist takes from it."""
        return dict(self._async.last_stats)

    @property
    def persist_in_flight(self) -> bool:
        return self._async.in_flight

    @property
    def persist_done(self) -> bool:
        """Local, no communication: this rank's part of the in-flight background save is written."""
        return self._async.persist_done

    # ------------------------------------------------------------------------- loading
    def load(self, step: int, state: Mapping[str, Any]) -> LoadResult:
        """Collective: load ``step`` into ``state`` in place (any world size can load it).

        A later save supersedes the committed steps newer than ``step`` (rollback).

        Args:
            step: The committed step to load; a damaged one raises ``CheckpointCorrupt``.
            state: The live state to load into, with the same names as when it was saved.

        Returns:
            A ``LoadResult`` (the step, and per-rank values that were missing).
        """
        t0 = time.perf_counter()
        self._async.wait()
        phases: dict[str, float] = {}
        result = recovery.load_step(self.comm, self.root, step,  # damage -> CheckpointCorrupt
                                    lambda s: load_into(self.comm, self.root, s, state, rng=self.rng,
                                                        stats=_fresh(phases)))
        self.load_stats = {"load_s": time.perf_counter() - t0, **phases}
        self._base = result.step
        self._say_per_rank(result)
        return result

    def load_latest(self, state: Mapping[str, Any]) -> LoadResult:
        """Collective: load the newest committed checkpoint that is intact (a damaged one is skipped
        with a loud warning); CheckpointNotFound if there is none, CheckpointCorrupt if all are bad.

        Args:
            state: The live state to load into, with the same names as when it was saved.

        Returns:
            A ``LoadResult`` (its ``step`` is the step loaded).
        """
        t0 = time.perf_counter()
        self._async.wait()
        phases: dict[str, float] = {}
        result = recovery.load_latest_intact(self.comm, self.root,  # damaged -> falls back, warns
                                             lambda s: load_into(self.comm, self.root, s, state, rng=self.rng,
                                                                 stats=_fresh(phases)),
                                             catalog=self._catalog if self._lock is not None else None)
        self.load_stats = {"load_s": time.perf_counter() - t0, **phases}
        self._base = result.step
        self._say_per_rank(result)
        return result

    def _say_per_rank(self, result: LoadResult) -> None:
        """Rank 0: say what became of ``PerRank`` state loaded on another number of ranks."""
        note = per_rank_note(result, self.comm.size) if self.comm.rank == 0 else None
        if note:
            print(f"coci_hpc: {note}", file=sys.stderr, flush=True)

    @property
    def catalog(self) -> StepCatalog:
        """Rank 0's step catalog of the root. A writer's (``lock=True``) lists the root once and
        is kept current by this manager; the restart's other questions (torn survivors' saves)
        ask it instead of listing the root again."""
        return self._catalog

    def latest_step(self) -> int | None:
        """Collective: the newest committed step (decided on rank 0), or None."""
        if self.comm.rank != 0:
            return self.comm.bcast(None)
        # The writer (it holds the lock) keeps the catalog; a reader looks afresh each time.
        return self.comm.bcast(self._catalog.latest() if self._lock is not None else cat.latest_step(self.root))

    def list(self) -> list[cat.CheckpointInfo]:
        """Local: committed checkpoints, oldest first."""
        return [c for c in cat.scan(self.root) if c.committed]

    def close(self) -> None:
        """Collective: finish and commit any background persist; release the directory lock and
        the sync save's staging buffers (:func:`~coci_hpc.checkpoint.rawio.release_staging`)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._async.close()
        finally:
            rawio.release_staging()
            if self._lock is not None:
                self._lock.release()

    def _close_at_exit(self) -> None:
        """Normal interpreter exit (see :mod:`.exitguard`): commit what is in flight, never silently fail."""
        try:
            self.close()
        except BaseException as exc:  # noqa: BLE001 - report any failure, never silently
            print(f"coci_hpc: background checkpoint failed at exit: {exc}", file=sys.stderr, flush=True)
            os._exit(1)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
