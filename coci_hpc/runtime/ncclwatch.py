"""A lost peer under NCCL: a watcher thread that notices it while the main thread waits on the
device, and the abort that ends that wait.

With gloo a dead peer makes the survivors' next collective raise, and the session saves. Under
NCCL nothing raises on the host: the collective hangs on the GPU, and the first host call that
waits for the stream (``loss.item()``, a ``.cpu()`` at the boundary) blocks for good, until NCCL's
watchdog tears the process down at the collective's timeout (``COCI_DIST_TIMEOUT_S``), perhaps
before any save. So under a backend that hangs (:func:`backend_hangs`: the default group's
backend names NCCL):

1. :class:`NcclWatch`, a thread, runs its own agreement over MPI (independent of NCCL): a
   MAX-allreduce of one number on a duplicate of the session's communicator every
   ``HEARTBEAT_S``, each round polled like the step agreement. Every rank's watcher answers
   whatever its main thread does, so a round that stays incomplete means a peer process is gone
   or frozen. The step agreement alone cannot tell: it completes at the boundary before the step
   whose collective hangs (every rank reached that boundary), and the stuck main thread never
   sends the next one. The watcher declares the peer lost once a round has been incomplete for
   the peer deadline (``StepSync.deadline_s``: max(5 s, 10 typical steps)) *and* the main thread
   has passed no step boundary for as long (a main thread that keeps reaching boundaries detects
   a loss itself, in the step agreement); the relaunch loop's peer notice and Slurm's SIGTERM end
   the wait sooner, as they end the step agreement's.
2. The peer-loss path (:meth:`coci_hpc.runtime.peerloss.PeerLoss.handle`) then aborts every
   process group (:func:`abort_groups`): the hung kernels return and the watchdog has nothing left
   to time out; the main thread's wait returns or raises.
3. The survivors save from host copies only, never from device memory (after the abort the stream
   may have run what the main thread enqueued after the hung collective): the memory tier's slots
   (:mod:`.memtier`, on for every state under NCCL) through the staged survivors' transaction.

A main thread that comes back from the wait is held at its next boundary (:meth:`NcclWatch.boundary`)
until the save ends the process. docs/explanation/gpu.md, "The survivors' save under NCCL".
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

HEARTBEAT_S = 0.25     # between two rounds of the watcher's agreement: detection is this + the deadline
POLL_S = 0.02          # between two tests of a round in flight
ABORT_WAIT_S = 10.0    # what the abort may take before the save goes on without it (ncclCommAbort can block)


def backend_hangs(group: Any = None) -> bool:
    """Whether a lost peer makes this process's collectives hang rather than raise: the process
    group's backend names NCCL (``"nccl"``, ``"cpu:gloo,cuda:nccl"``). False without a group."""
    try:
        import torch.distributed as dist
    except ImportError:                     # pragma: no cover - torch is a dependency
        return False
    if not dist.is_available() or not dist.is_initialized():
        return False
    return "nccl" in str(dist.get_backend(group)).lower()


@dataclass
class Abort:
    """What :func:`abort_groups` did: it returned (``done``) after ``seconds``, or raised (``error``)."""

    done: bool
    seconds: float
    error: str = ""

    def describe(self) -> str:
        if self.error:
            return f"aborting the process groups failed after {self.seconds:.2f}s ({self.error})"
        if not self.done:
            return f"the process groups' abort had not returned after {self.seconds:.1f}s (left running)"
        return f"process groups aborted in {self.seconds:.2f}s"


def _abort_all() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    abort = getattr(c10d, "_abort_process_group", None)
    if abort is not None:
        # Every group, the NCCL communicators inside one ncclGroupStart/End (torch's own order, so
        # that aborting one communicator does not wait on another: pytorch issue 119797).
        abort(None)
        return
    for pg in list(c10d._world.pg_names):       # an older torch: each group's own abort
        pg.abort()


def abort_groups(timeout_s: float = ABORT_WAIT_S, abort: Callable[[], None] = _abort_all) -> Abort:
    """Abort torch.distributed's process groups (all of them: the default one and every subgroup,
    e.g. a DeviceMesh's), from any thread. The abort runs in a thread of its own and is waited for
    at most ``timeout_s``: the survivors' save needs none of NCCL, so it goes on regardless."""
    t0 = time.monotonic()
    err: list[str] = []

    def run() -> None:
        try:
            abort()
        except Exception as exc:  # noqa: BLE001 - reported, the save goes on
            err.append(f"{type(exc).__name__}: {exc}")

    th = threading.Thread(target=run, name="coci-nccl-abort", daemon=True)
    th.start()
    th.join(timeout_s)
    return Abort(not th.is_alive() and not err, time.monotonic() - t0, err[0] if err else "")


class NcclWatch:
    """The watcher (module docstring, 1.). ``mpi_comm``: a duplicate of the session's MPI
    communicator, for the watcher alone; ``deadline``: the peer deadline now (it follows the step
    time); ``early``: given when the silence began, a check that names an earlier end (the relaunch
    loop's notice, SIGTERM) or returns None (``StepSync``'s); ``on_lost(how, t_fail)``: the
    peer-loss path, called on the watcher thread (it saves and ends the process).

    Rounds are matched across ranks by their order, so the watchers stop together: a rank that
    stops (:meth:`stop`, at the end of the loop) sends 1, and every watcher leaves after the round
    whose MAX is 1."""

    def __init__(self, mpi_comm: Any, deadline: Callable[[], float],
                 early: Callable[[float], Callable[[float], str | None] | None] | None = None,
                 heartbeat_s: float = HEARTBEAT_S, poll_s: float = POLL_S) -> None:
        self.comm = mpi_comm
        self.deadline = deadline
        self.early = early
        self.heartbeat_s, self.poll_s = heartbeat_s, poll_s
        self.fired = threading.Event()      # a peer was declared lost (or on_lost was called)
        self.how = ""
        self.rounds = 0                     # rounds completed (tests, figures)
        self._send = np.zeros(1, dtype=np.float64)
        self._recv = np.zeros(1, dtype=np.float64)
        self._last_boundary = time.monotonic()
        self._stopping = threading.Event()
        self._release = threading.Event()   # never set by coci: a held main thread waits for the exit
        self._thread: threading.Thread | None = None
        self._on_lost: Callable[[str, float], None] | None = None
        # Imported here, on the main thread (where the session initialised MPI), never first in the watcher.
        from mpi4py import MPI

        self._max = MPI.MAX

    # -- the main thread -----------------------------------------------------------------------
    def start(self, on_lost: Callable[[str, float], None]) -> None:
        """Start the thread (every rank, at the same point: its rounds pair with the peers')."""
        self._on_lost = on_lost
        self._last_boundary = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="coci-nccl-watch", daemon=True)
        self._thread.start()

    def boundary(self) -> None:
        """At each step boundary, first thing: the main thread is not stuck; and once a peer was
        declared lost, it waits here for the survivors' save to end the process (after the abort
        its device state may be a half-finished step: nothing may copy or save it)."""
        if self.fired.is_set():
            self._release.wait()
        self._last_boundary = time.monotonic()

    def stop(self, timeout_s: float | None = None) -> bool:
        """Leave together with the peers' watchers (they stop at the same boundary); False when
        they did not answer within ``timeout_s`` (default: the deadline), the thread then left behind."""
        th = self._thread
        if th is None:
            return True
        self._stopping.set()
        th.join(self.deadline() + 2 * self.heartbeat_s if timeout_s is None else timeout_s)
        self._thread = None
        return not th.is_alive()

    @contextmanager
    def running(self, on_lost: Callable[[str, float], None]) -> Iterator[NcclWatch]:
        self.start(on_lost)
        try:
            yield self
        finally:
            self.stop()

    # -- the watcher thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._send[0] = 1.0 if self._stopping.is_set() else 0.0
            req = self.comm.Iallreduce(self._send, self._recv, op=self._max)
            t_round = time.monotonic()
            check = None
            while not req.Test():
                now = time.monotonic()
                since = max(t_round, self._last_boundary)
                if self._stopping.is_set():
                    if now - t_round > self.deadline() + self.heartbeat_s:
                        return          # the peers stopped answering at the end: nothing to declare
                elif now - since > self.deadline():
                    self._declare(f"the NCCL watcher's agreement over MPI did not complete within "
                                  f"{self.deadline():.1f}s while the main thread waited {now - self._last_boundary:.1f}s "
                                  f"inside a step: a peer rank is gone (crashed, killed, or its node failed)", since)
                    return
                else:
                    if check is None and self.early is not None:
                        check = self.early(t_round)
                    why = check(now) if check is not None else None
                    if why is not None:
                        self._declare(f"the NCCL watcher's agreement over MPI is waiting on a peer: {why}", since)
                        return
                time.sleep(self.poll_s)
            self.rounds += 1
            if self._recv[0] > 0:
                return                  # every rank leaves after this same round
            self._stopping.wait(self.heartbeat_s)

    def _declare(self, how: str, t_fail_mono: float) -> None:
        self.how = how
        self.fired.set()
        assert self._on_lost is not None
        t_fail = time.time() - (time.monotonic() - t_fail_mono)   # when the silence began, wall clock
        self._on_lost(how, t_fail)


def for_session(comm: Any, sync: Any, say: Callable[[str], None]) -> NcclWatch | None:
    """The Session's watcher, or None: only under a backend that hangs (:func:`backend_hangs`),
    with MPI and 2+ ranks (the watcher's agreement, like the host copies, travels over MPI).
    Collective under MPI (a communicator duplicate). Without MPI rank 0 says what that costs."""
    if comm.size < 2 or not backend_hangs():
        return None
    if not comm.is_mpi:
        if comm.rank == 0:
            say("NCCL without MPI: a lost peer makes the survivors' collectives hang until NCCL's timeout "
                "(COCI_DIST_TIMEOUT_S), and no survivors' save is possible (it needs MPI); launch with "
                "srun --mpi=pmix or mpiexec for both")
        return None
    return NcclWatch(comm.mpi_comm.Dup(), lambda: sync.deadline_s, sync.early_exits)
