"""A communicator wrapper that works with and without MPI.

``Comm.world()`` wraps ``mpi4py.MPI.COMM_WORLD`` when mpi4py imports and the process was started
by an MPI launcher; otherwise it is a single-process communicator whose collectives are no-ops.
mpi4py is imported lazily so that users without MPI keep the serial path.

``Comm.run_step(fn)`` runs a per-rank step on every rank and turns per-rank failures into ONE
:class:`~coci_hpc.errors.CommError`, raised on every rank and naming the failed ranks with their
messages (an allgather of ok/err). Without it, one rank's exception leaves the others blocked in
the next collective forever.

Subclassing: a communicator over another transport (e.g. torch.distributed for DDP-only jobs)
subclasses :class:`Comm`, sets ``rank``/``size`` and overrides the collectives (``barrier``,
``bcast``, ``allgather``, ``gather``, ``scatter``, ``allreduce_min``/``max``, ``iallreduce_min``, ``abort``;
the other non-blocking ones fall back to the blocking methods when ``mpi_comm`` is None);
``is_mpi`` stays False unless ``mpi_comm`` is an mpi4py communicator. Everything else
(``check``, ``run_step``) is built on those methods.

A deadline on a dead peer (``peer_deadline_s``, set by the Session for a scope: :meth:`Comm.watch`
for its loop, :meth:`Comm.deadline` for one longer wait; both restore what was there): a peer rank that vanished
(SIGKILL, its node gone) never joins a collective, and under ``srun --mpi=pmix`` nothing tells the
others (Open MPI does not abort them; ../shared/slurm-on-one-machine.md). A blocking MPI call then
waits forever, and a checkpoint save is a dozen collectives. With ``peer_deadline_s`` set, every
collective here is started non-blocking (``Ibarrier``, ``Iallreduce``, and the object collectives
as a length round plus a byte round of ``Ibcast`` / ``Iallgatherv`` / ``Igatherv`` /
``Iscatterv`` over pickled bytes) and polled against that deadline; a miss raises
:class:`~coci_hpc.errors.PeerLost` and marks the communicator ``lost`` (every later collective
raises at once: the abandoned requests can never complete). ``None`` (the default, a
``CheckpointManager`` used on its own) keeps the blocking calls. MPI calls that cannot be polled
(MPI-IO inside ``write_mpiio``) run under :meth:`Comm.guard`, a timer thread that hands the
lost peer to ``on_stuck`` (the Session's survivors' save, which ends the process).
"""
from __future__ import annotations

import os
import pickle
import struct
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from coci_hpc import settings
from coci_hpc.errors import CociError, CommError, PeerLost

T = TypeVar("T")
_HEADER = struct.Struct("<Q")  # the length in front of each rank's bytes in igather_bytes

# Variables set by the MPI launchers we know (Open MPI, MPICH/Hydra, Slurm's PMIx launch).
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


SPIN_S = 0.002          # busy-poll this long before sleeping between tests (peers are usually close)
POLL_SLEEP_S = 0.0005


def poll_until_done(test: Callable[[], bool], limit: float, notice: Callable[[float], str | None] | None,
                    missed: Callable[[float], str], noticed: Callable[[float, str], str]) -> None:
    """Poll ``test`` until it returns True; raise PeerLost after ``limit`` seconds, or at once when
    ``notice`` (the relaunch loop's peer notice) reports a peer gone.

    One loop for :meth:`Comm.wait_requests` and the session's step agreement, so that both detect a
    lost peer the same way; they differ only in the texts: ``missed(limit)`` words the deadline's
    miss and ``noticed(waited, why)`` the notice. Callers mark themselves lost on PeerLost, since
    their requests can then never complete. The first ``SPIN_S`` busy-polls without asking
    ``notice`` (a file stat): peers are usually microseconds away.
    """
    if test():
        return
    t0 = time.monotonic()
    spin_until, end = t0 + SPIN_S, t0 + limit
    while not test():
        now = time.monotonic()
        if now > end:
            raise PeerLost(missed(limit), hint="the survivors save from their own state; see the event log")
        why = notice(now) if notice is not None and now > spin_until else None
        if why is not None:
            raise PeerLost(noticed(now - t0, why), hint="the survivors save from their own state; see the event log")
        if now > spin_until:
            time.sleep(POLL_SLEEP_S)


def _mpi_launched() -> bool:
    return any(v in os.environ for v in _LAUNCHER_VARS)


class Comm:
    """Rank, size and the few collectives coci_hpc needs, on mpi4py or on one process.

    ``mpi_comm`` is the wrapped mpi4py communicator, or ``None`` for the serial case.
    """

    def __init__(self, mpi_comm: Any = None) -> None:
        self.mpi_comm = mpi_comm
        if mpi_comm is None:
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        # See the module docstring: None blocks as MPI does; a number bounds every wait on a peer.
        self.peer_deadline_s: float | None = None
        self.lost = False                  # a deadline was missed: no collective can complete any more
        # Called from a timer thread when a guarded call (one that cannot be polled) overruns the
        # deadline; it must not return (the Session's survivors' save ends the process).
        self.on_stuck: Callable[[str], None] | None = None
        # Another sign that a peer is gone, looked at while a collective waits (the relaunch
        # loop's notice, runtime/peernotice.py): returns why, or None. Set by the Session.
        self.peer_notice: Callable[[float], str | None] | None = None

    # construction -----------------------------------------------------------------------
    @classmethod
    def world(cls) -> Comm:
        """COMM_WORLD when launched by MPI (or mpi4py is already initialised), else serial."""
        import sys

        if "mpi4py.MPI" in sys.modules or _mpi_launched():
            try:
                from mpi4py import MPI
            except ImportError:
                return cls(None)
            return cls(MPI.COMM_WORLD)
        return cls(None)

    @classmethod
    def serial(cls) -> Comm:
        return cls(None)

    @classmethod
    def wrap(cls, comm: Comm | Any | None) -> Comm:
        """Accept a Comm, an mpi4py communicator, or None (= ``world()``)."""
        if comm is None:
            return cls.world()
        if isinstance(comm, Comm):
            return comm
        return cls(comm)

    @property
    def is_mpi(self) -> bool:
        return self.mpi_comm is not None

    # the deadline on a dead peer, for a scope ---------------------------------------------
    @contextmanager
    def deadline(self, seconds: float | None) -> Iterator[None]:
        """Bound every wait on a peer by ``seconds`` (None: block) inside the ``with``; the previous
        deadline comes back on the way out, also when the body raises."""
        previous, self.peer_deadline_s = self.peer_deadline_s, seconds
        try:
            yield
        finally:
            self.peer_deadline_s = previous

    @contextmanager
    def watch(self, deadline_s: float, on_stuck: Callable[[str], None] | None = None,
              peer_notice: Callable[[float], str | None] | None = None) -> Iterator[None]:
        """A loop's watch on its peers: the deadline, the handler of a stuck guarded call and the
        relaunch loop's notice, set inside the ``with`` and restored on the way out (also on an
        exception). Inside it the deadline may follow the step time (``peer_deadline_s = ...``)."""
        saved = (self.peer_deadline_s, self.on_stuck, self.peer_notice)
        self.peer_deadline_s, self.on_stuck = deadline_s, on_stuck
        if peer_notice is not None:
            self.peer_notice = peer_notice
        try:
            yield
        finally:
            self.peer_deadline_s, self.on_stuck, self.peer_notice = saved

    # collectives (no-ops on one process) ------------------------------------------------
    @property
    def _bounded(self) -> bool:
        return self.mpi_comm is not None and self.peer_deadline_s is not None and self.size > 1

    def wait_requests(self, reqs: list[Any], what: str) -> None:
        """Complete MPI requests, polled against ``peer_deadline_s`` (blocking when it is None)."""
        from mpi4py import MPI

        if self.lost:
            raise PeerLost(f"{what}: a peer rank was already lost, no collective can complete")
        if self.peer_deadline_s is None:
            MPI.Request.Waitall(reqs)
            return
        try:
            poll_until_done(
                lambda: bool(MPI.Request.Testall(reqs)), float(self.peer_deadline_s), self.peer_notice,
                lambda limit: (f"{what} did not complete within {limit:.1f}s: a peer rank is gone (crashed, "
                               f"killed, or its node failed)"),
                lambda waited, why: (f"{what}: a peer rank is gone after {waited:.2f}s of waiting (the relaunch "
                                     f"loop saw it end: {why})"))
        except PeerLost:
            self.lost = True      # the abandoned requests can never complete: later collectives fail at once
            raise

    def _check_lost(self, what: str) -> None:
        if self.lost:
            raise PeerLost(f"{what}: a peer rank was already lost, no collective can complete")

    def barrier(self) -> None:
        if self.mpi_comm is None:
            return
        if not self._bounded:
            self.mpi_comm.Barrier()
            return
        self._check_lost("barrier")
        self.wait_requests([self.mpi_comm.Ibarrier()], "a barrier")

    def bcast(self, obj: T | None, root: int = 0) -> T:
        # Typed for the usual call, ``bcast(value if rank == root else None)``: every rank gets
        # root's value; a root that sends None gets None, which callers check for themselves.
        if self.mpi_comm is None:
            return obj  # type: ignore[return-value]
        if not self._bounded:
            return self.mpi_comm.bcast(obj, root=root)
        import numpy as np

        self._check_lost("bcast")
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        n = np.array([len(data)], dtype=np.int64)
        self.wait_requests([self.mpi_comm.Ibcast(n, root=root)], "a broadcast (size)")
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root else np.empty(int(n[0]), np.uint8)
        self.wait_requests([self.mpi_comm.Ibcast(buf, root=root)], "a broadcast")
        return obj if self.rank == root else pickle.loads(buf.tobytes())  # type: ignore[return-value]

    def _sizes_and_bytes(self, obj: Any) -> tuple[Any, Any]:
        import numpy as np

        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return np.array([len(data)], dtype=np.int64), np.frombuffer(data, dtype=np.uint8)

    def allgather(self, obj: T) -> list[T]:
        if self.mpi_comm is None:
            return [obj]
        if not self._bounded:
            return self.mpi_comm.allgather(obj)
        import numpy as np

        self._check_lost("allgather")
        n, data = self._sizes_and_bytes(obj)
        sizes = np.empty(self.size, dtype=np.int64)
        self.wait_requests([self.mpi_comm.Iallgather(n, sizes)], "an allgather (sizes)")
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.wait_requests([self.mpi_comm.Iallgatherv(data, [out, sizes])], "an allgather")
        return _unpickle_parts(out, sizes)

    def gather(self, obj: T, root: int = 0) -> list[T] | None:
        if self.mpi_comm is None:
            return [obj]
        if not self._bounded:
            return self.mpi_comm.gather(obj, root=root)
        import numpy as np

        self._check_lost("gather")
        n, data = self._sizes_and_bytes(obj)
        sizes = np.empty(self.size, dtype=np.int64)
        self.wait_requests([self.mpi_comm.Igather(n, sizes, root=root)], "a gather (sizes)")
        out = np.empty(int(sizes.sum()) if self.rank == root else 0, dtype=np.uint8)
        self.wait_requests([self.mpi_comm.Igatherv(data, [out, sizes] if self.rank == root else None, root=root)],
                           "a gather")
        return _unpickle_parts(out, sizes) if self.rank == root else None

    def scatter(self, objs: list[T] | None, root: int = 0) -> T:
        """Rank ``root`` passes one object per rank; each rank gets only its own."""
        if self.mpi_comm is None:
            assert objs is not None
            return objs[0]
        if not self._bounded:
            return self.mpi_comm.scatter(objs, root=root)
        import numpy as np

        self._check_lost("scatter")
        sizes = np.zeros(self.size, dtype=np.int64)
        send = np.empty(0, dtype=np.uint8)
        if self.rank == root:
            assert objs is not None and len(objs) == self.size
            parts = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objs]
            sizes[:] = [len(p) for p in parts]
            send = np.frombuffer(b"".join(parts), dtype=np.uint8)
        n = np.empty(1, dtype=np.int64)
        self.wait_requests([self.mpi_comm.Iscatter(sizes, n, root=root)], "a scatter (sizes)")
        buf = np.empty(int(n[0]), dtype=np.uint8)
        self.wait_requests([self.mpi_comm.Iscatterv([send, sizes] if self.rank == root else None, buf, root=root)],
                           "a scatter")
        return pickle.loads(buf.tobytes())

    def _allreduce(self, value: float, op_name: str) -> float:
        from mpi4py import MPI

        op = getattr(MPI, op_name)
        if not self._bounded:
            return self.mpi_comm.allreduce(value, op=op)
        import numpy as np

        self._check_lost("allreduce")
        send, recv = np.array([value], dtype=np.float64), np.empty(1, dtype=np.float64)
        self.wait_requests([self.mpi_comm.Iallreduce(send, recv, op=op)], "an allreduce")
        return float(recv[0])

    def allreduce_min(self, value: float) -> float:
        if self.mpi_comm is None:
            return value
        return self._allreduce(value, "MIN")

    def allreduce_max(self, value: float) -> float:
        if self.mpi_comm is None:
            return value
        return self._allreduce(value, "MAX")

    def iallreduce_min(self, value: float) -> PendingMin:
        """Start a non-blocking MIN-allreduce; ``.wait()`` returns the result."""
        if self.mpi_comm is None:
            return PendingMin(None, value)
        import numpy as np
        from mpi4py import MPI

        self._check_lost("allreduce")
        send, recv = np.array([value], dtype=np.float64), np.empty(1, dtype=np.float64)
        req = self.mpi_comm.Iallreduce(send, recv, op=MPI.MIN)
        return PendingMin(req, recv, send, comm=self)

    @contextmanager
    def guard(self, what: str, allow_s: float = 0.0) -> Iterator[None]:
        """Around an MPI call that cannot be polled (collective MPI-IO): if it has not returned
        within ``peer_deadline_s`` (+ ``allow_s`` for the work it does itself), a timer thread
        calls ``on_stuck(what)`` (mpi4py releases the GIL while it waits, so the thread runs; an
        h5py call holds it, which is why the parallel writer creates its file on rank 0 alone).
        Nothing is armed without a deadline or a handler."""
        if not self._bounded or self.on_stuck is None:
            yield
            return
        self._check_lost(what)
        handler = self.on_stuck

        def fire() -> None:
            self.lost = True
            handler(f"{what} did not return within {limit:.1f}s")
        limit = float(self.peer_deadline_s or 0.0) + allow_s
        timer = threading.Timer(limit, fire)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    # Non-blocking collectives for a commit spread over several calls (the two-phase saver's
    # poll): started at one call, completed (``.wait()``) at a later one, in the same order on
    # every rank. Without MPI they complete at once through the blocking methods above, so a
    # subclass on another transport that overrides those is correct (just not overlapped).
    def iallreduce_min_array(self, values: Sequence[float]) -> Pending[list[float]]:
        """Start an element-wise MIN-allreduce of a few floats; ``.wait()`` returns the list."""
        if self.mpi_comm is None:
            return Pending(None, lambda: [self.allreduce_min(float(v)) for v in values])
        import numpy as np
        from mpi4py import MPI

        self._check_lost("allreduce")
        send = np.array(values, dtype=np.float64)
        recv = np.empty_like(send)
        req = self.mpi_comm.Iallreduce(send, recv, op=MPI.MIN)
        return Pending(req, lambda: [float(v) for v in recv], keep=send, comm=self)

    def igather_bytes(self, data: bytes, size: int, root: int = 0) -> Pending[list[bytes] | None]:
        """Start a gather of every rank's ``data`` (at most ``size`` bytes, the same ``size`` on
        every rank) to ``root``; ``.wait()`` returns the list on ``root``, None elsewhere."""
        if len(data) > size:
            raise ValueError(f"igather_bytes: {len(data)} bytes do not fit in {size}")
        if self.mpi_comm is None:
            return Pending(None, lambda: self.gather(data, root=root))
        import numpy as np

        framed = _HEADER.pack(len(data)) + data
        slot = _HEADER.size + size
        send = np.zeros(slot, dtype=np.uint8)
        send[:len(framed)] = np.frombuffer(framed, dtype=np.uint8)
        recv = np.empty(slot * self.size, dtype=np.uint8) if self.rank == root else None
        self._check_lost("gather")
        req = self.mpi_comm.Igather(send, recv, root=root)

        def unpack() -> list[bytes] | None:
            if recv is None:
                return None
            out = []
            for r in range(self.size):
                chunk = recv[r * slot:(r + 1) * slot].tobytes()
                (n,) = _HEADER.unpack_from(chunk)
                out.append(chunk[_HEADER.size:_HEADER.size + n])
            return out
        return Pending(req, unpack, keep=send, comm=self)

    def ibcast_floats(self, values: Sequence[float] | None, count: int, root: int = 0) -> Pending[list[float]]:
        """Start a broadcast of ``count`` floats from ``root`` (other ranks pass None)."""
        if self.mpi_comm is None:
            return Pending(None, lambda: list(self.bcast(None if values is None else list(values), root=root)))
        import numpy as np

        buf = np.array(values, dtype=np.float64) if self.rank == root else np.empty(count, dtype=np.float64)
        if buf.shape != (count,):
            raise ValueError(f"ibcast_floats: {buf.shape[0]} values, expected {count}")
        self._check_lost("bcast")
        req = self.mpi_comm.Ibcast(buf, root=root)
        return Pending(req, lambda: [float(v) for v in buf], keep=buf, comm=self)

    def abort(self, code: int = 1) -> None:
        """End the whole job now, without any collective (``MPI_Abort`` under MPI).

        Used after an uncaught exception or a hung rank: the other ranks may sit in a
        collective this rank will never join, so only an abort ends them promptly.
        """
        import sys

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
                pass
        if self.mpi_comm is not None:
            self.mpi_comm.Abort(code)
        os._exit(code)

    # failure agreement --------------------------------------------------------------------
    def check(self, error: BaseException | None, what: str) -> None:
        """Collective: raise one error on every rank if ``error`` is set on any rank.

        That is a CommError naming the failed ranks and their messages, except when every rank
        failed with the same coci error, which is then raised unchanged everywhere.
        """
        if isinstance(error, PeerLost):
            raise error                    # no agreement is possible without the lost peer
        msg = None if error is None else f"{type(error).__name__}: {error}"
        # One 8-byte allreduce when every rank succeeded (the common case): an allgather of N
        # empty messages would hand every rank O(N) bytes at each step of every save.
        if self.size > 1 and self.allreduce_max(0.0 if error is None else 1.0) == 0.0:
            return
        results = self.allgather(msg)
        failed = {r: m for r, m in enumerate(results) if m is not None}
        if failed and error is not None and len(failed) == self.size and \
                len(set(failed.values())) == 1 and isinstance(error, CociError):
            # Every rank hit the same coci error (e.g. a bad argument): raise it as it is.
            raise error
        if failed:
            names = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
            exc = CommError(f"{what} failed on rank(s) {sorted(failed)}: {names}",
                            failed_ranks=failed,
                            hint="see the message of the lowest failed rank; the other ranks "
                                 "stopped cleanly because of it")
            if error is not None:
                raise exc from error
            raise exc

    def run_step(self, fn: Callable[[], T], what: str = "step") -> T:
        """Run ``fn()`` on every rank; if any rank raises, every rank raises one CommError."""
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - every failure must reach the agreement below
            error = exc
            if settings.DEBUG.raw():
                traceback.print_exc()
        self.check(error, what)
        return result  # type: ignore[return-value]


def _unpickle_parts(buf: Any, sizes: Any) -> list[Any]:
    out, pos = [], 0
    raw = buf.tobytes()
    for n in sizes.tolist():
        out.append(pickle.loads(raw[pos:pos + n]))
        pos += n
    return out


class Pending(Generic[T]):
    """A non-blocking collective in flight (or, without MPI, done when ``wait`` runs it).
    With ``comm``, the wait is polled against its peer deadline (:meth:`Comm.wait_requests`)."""

    def __init__(self, request: Any, finish: Callable[[], T], keep: Any = None, comm: Comm | None = None) -> None:
        self._req, self._finish, self._keep, self._comm = request, finish, keep, comm
        self._done = False
        self._value: T | None = None

    def wait(self) -> T:
        """Complete it (blocks only if some rank has not started it yet) and return the result."""
        if not self._done:
            if self._req is not None:
                if self._comm is not None:
                    self._comm.wait_requests([self._req], "a checkpoint commit's collective")
                else:
                    self._req.Wait()
                self._req = None
            self._value = self._finish()
            self._done = True
            self._keep = None
        return self._value  # type: ignore[return-value]

    def test(self) -> None:
        """Let MPI move it on without waiting (``MPI_Test``): a rank that relays the others'
        data (the root of a tree) does its part now, not when it next waits."""
        if not self._done and self._req is not None:
            self._req.Test()


class PendingMin:
    """A MIN-allreduce in flight (or already known, without MPI)."""

    def __init__(self, request: Any, result: Any, keep: Any = None, comm: Comm | None = None) -> None:
        self._req, self._result, self._keep, self._comm = request, result, keep, comm

    def wait(self) -> float:
        if self._req is not None:
            if self._comm is not None:
                self._comm.wait_requests([self._req], "an allreduce")
            else:
                self._req.Wait()
            self._req = None
            return float(self._result[0])
        return float(self._result)
