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
"""
from __future__ import annotations

import atexit
import numbers
import os
import sys
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from coci_hpc.checkpoint import engine, h5_parallel, recovery
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.h5_serial import SerialH5Writer
from coci_hpc.checkpoint.lustre import IOTuning, LustrePolicy, tuning_for
from coci_hpc.checkpoint.protocol import StorageWriter
from coci_hpc.checkpoint.state import collect
from coci_hpc.checkpoint.twophase import TwoPhaseSaver
from coci_hpc.comm import Comm
from coci_hpc.errors import UsageError

BACKENDS = ("auto", "parallel", "serial")
LoadResult = engine.LoadResult


def make_writer(comm: Comm, backend: str) -> StorageWriter:
    if backend not in BACKENDS:
        raise UsageError(f"backend={backend!r} is not one of {BACKENDS}",
                         hint="'auto' picks parallel HDF5 under MPI with an MPI-enabled h5py")
    if backend == "parallel" or (backend == "auto" and h5_parallel.available(comm)):
        return h5_parallel.ParallelH5Writer(comm)
    return SerialH5Writer(comm)


class CheckpointManager:
    """Save, load and list checkpoints under one directory.

    ``keep``: committed checkpoints to retain (older ones are deleted after a newer commit).
    ``backend``: "auto" | "parallel" (h5py mpio + MPI-IO) | "serial" (same format, no MPI-IO).
    ``on_busy`` / ``overlap``: two-phase save behaviour, see :mod:`coci_hpc.checkpoint.twophase`.
    ``rng``: also save/restore every rank's RNG states (python, numpy, torch, CUDA).
    """

    def __init__(self, directory: str | os.PathLike, comm: Any = None, *, keep: int = 2,
                 backend: str = "auto", lustre: LustrePolicy | None = None, on_busy: str = "wait",
                 overlap: bool = True, rng: bool = True) -> None:
        if not isinstance(keep, numbers.Integral) or keep < 1:
            raise UsageError(f"keep={keep!r} must be an integer of at least 1", hint="keep=2 keeps the last two")
        self.root = Path(directory)
        self.comm = Comm.wrap(comm)
        self.keep = keep
        self.rng = rng
        self.lustre = lustre or LustrePolicy()
        self.writer = make_writer(self.comm, backend)
        self._tuning: IOTuning | None = None
        self._async = TwoPhaseSaver(self.comm, self.root, self.writer, self.tuning, keep=keep,
                                    on_busy=on_busy, overlap=overlap, rng=rng)
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.stats: dict[str, float] = {}
        self._closed = False
        # Registered after Comm.wrap imported mpi4py, so it runs BEFORE mpi4py's MPI_Finalize.
        atexit.register(_close_at_exit, weakref.ref(self))

    def tuning(self) -> IOTuning:
        """Filesystem decisions (Lustre or not), made once on rank 0 and shared."""
        if self._tuning is None:
            local = tuning_for(self.root, self.lustre, self.comm.size) if self.comm.rank == 0 else None
            self._tuning = self.comm.bcast(local)
        return self._tuning

    # -------------------------------------------------------------------------- saving
    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Collective, synchronous: write, fsync and commit ``step``; returns its directory."""
        t0 = time.perf_counter()
        self._async.wait()
        skeletons, leaves = collect(state, rng=self.rng)
        prepared = engine.prepare(self.comm, self.root, step, skeletons, leaves, self.writer, self.tuning())
        # Agree that every rank has its data before any collective write starts.
        items = self.comm.run_step(lambda: prepared.items(self.comm.rank),
                                   f"collecting the data of step {step}")
        crcs, error = None, None
        try:
            crcs = engine.write_items(prepared, items, self.writer)
        except Exception as exc:  # noqa: BLE001 - agreed on in commit
            error = exc
        engine.commit(self.comm, prepared, crcs, error, self.keep)
        self.stats = {"save_s": time.perf_counter() - t0}
        return prepared.directory

    def save_async(self, step: int, state: Mapping[str, Any]) -> str:
        """Collective: two-phase save. Returns "started" or "skipped" (on_busy="skip").

        Large tensors are copied while training continues; every optimizer in ``state`` gets a
        step pre-hook that waits for that copy, so in-place updates cannot tear the snapshot.
        Modify other large tensors in place only after :meth:`wait_snapshot`.
        """
        for value in state.values():
            if isinstance(value, torch.optim.Optimizer) and value not in self._hooked:
                value.register_step_pre_hook(self._optimizer_pre_hook)
                self._hooked.add(value)
        return self._async.start(step, state)

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

    @property
    def async_stats(self) -> dict[str, float]:
        return dict(self._async.last_stats)

    @property
    def persist_in_flight(self) -> bool:
        return self._async.in_flight

    # ------------------------------------------------------------------------- loading
    def load(self, step: int, state: Mapping[str, Any]) -> engine.LoadResult:
        """Collective: load ``step`` into ``state`` in place (any world size can load it)."""
        self._async.wait()
        return recovery.load_step(self.comm, self.root, step,  # damage -> CheckpointCorrupt
                                  lambda s: engine.load(self.comm, self.root, s, state, rng=self.rng))

    def load_latest(self, state: Mapping[str, Any]) -> engine.LoadResult:
        """Collective: load the newest committed checkpoint that is intact (a damaged one is skipped
        with a loud warning); CheckpointNotFound if there is none, CheckpointCorrupt if all are bad."""
        self._async.wait()
        return recovery.load_latest_intact(self.comm, self.root,  # damaged -> falls back, warns
                                           lambda s: engine.load(self.comm, self.root, s, state, rng=self.rng))

    def latest_step(self) -> int | None:
        """Collective: the newest committed step (decided on rank 0), or None."""
        return self.comm.bcast(mf.latest_step(self.root) if self.comm.rank == 0 else None)

    def list(self) -> list[mf.CheckpointInfo]:
        """Local: committed checkpoints, oldest first."""
        return [c for c in mf.scan(self.root) if c.committed]

    def close(self) -> None:
        """Collective: finish and commit any background persist."""
        if self._closed:
            return
        self._closed = True
        self._async.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()


def _close_at_exit(ref: weakref.ref[CheckpointManager]) -> None:
    """A persist still in flight at exit is finished and committed; a failure is never silent."""
    mgr = ref()
    if mgr is None or mgr._closed:
        return
    try:
        mgr.close()
    except BaseException as exc:  # noqa: BLE001 - report any failure, never silently
        print(f"coci_hpc: background checkpoint failed at exit: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
