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
"""
from __future__ import annotations

import os
import struct
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from coci_hpc.errors import CociError, CommError

T = TypeVar("T")
_HEADER = struct.Struct("<Q")  # the length in front of each rank's bytes in igather_bytes

# Variables set by the MPI launchers we know (Open MPI, MPICH/Hydra, Slurm's PMIx launch).
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


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

    # collectives (no-ops on one process) ------------------------------------------------
    def barrier(self) -> None:
        if self.mpi_comm is not None:
            self.mpi_comm.Barrier()

    def bcast(self, obj: T | None, root: int = 0) -> T:
        # Typed for the usual call, ``bcast(value if rank == root else None)``: every rank gets
        # root's value; a root that sends None gets None, which callers check for themselves.
        if self.mpi_comm is None:
            return obj  # type: ignore[return-value]
        return self.mpi_comm.bcast(obj, root=root)

    def allgather(self, obj: T) -> list[T]:
        if self.mpi_comm is None:
            return [obj]
        return self.mpi_comm.allgather(obj)

    def gather(self, obj: T, root: int = 0) -> list[T] | None:
        if self.mpi_comm is None:
            return [obj]
        return self.mpi_comm.gather(obj, root=root)

    def scatter(self, objs: list[T] | None, root: int = 0) -> T:
        """Rank ``root`` passes one object per rank; each rank gets only its own."""
        if self.mpi_comm is None:
            assert objs is not None
            return objs[0]
        return self.mpi_comm.scatter(objs, root=root)

    def allreduce_min(self, value: float) -> float:
        if self.mpi_comm is None:
            return value
        from mpi4py import MPI

        return self.mpi_comm.allreduce(value, op=MPI.MIN)

    def allreduce_max(self, value: float) -> float:
        if self.mpi_comm is None:
            return value
        from mpi4py import MPI

        return self.mpi_comm.allreduce(value, op=MPI.MAX)

    def iallreduce_min(self, value: float) -> PendingMin:
        """Start a non-blocking MIN-allreduce; ``.wait()`` returns the result."""
        if self.mpi_comm is None:
            return PendingMin(None, value)
        import numpy as np
        from mpi4py import MPI

        send, recv = np.array([value], dtype=np.float64), np.empty(1, dtype=np.float64)
        req = self.mpi_comm.Iallreduce(send, recv, op=MPI.MIN)
        return PendingMin(req, recv, send)

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

        send = np.array(values, dtype=np.float64)
        recv = np.empty_like(send)
        req = self.mpi_comm.Iallreduce(send, recv, op=MPI.MIN)
        return Pending(req, lambda: [float(v) for v in recv], keep=send)

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
        return Pending(req, unpack, keep=send)

    def ibcast_floats(self, values: Sequence[float] | None, count: int, root: int = 0) -> Pending[list[float]]:
        """Start a broadcast of ``count`` floats from ``root`` (other ranks pass None)."""
        if self.mpi_comm is None:
            return Pending(None, lambda: list(self.bcast(None if values is None else list(values), root=root)))
        import numpy as np

        buf = np.array(values, dtype=np.float64) if self.rank == root else np.empty(count, dtype=np.float64)
        if buf.shape != (count,):
            raise ValueError(f"ibcast_floats: {buf.shape[0]} values, expected {count}")
        req = self.mpi_comm.Ibcast(buf, root=root)
        return Pending(req, lambda: [float(v) for v in buf], keep=buf)

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
            if os.environ.get("COCI_DEBUG"):
                traceback.print_exc()
        self.check(error, what)
        return result  # type: ignore[return-value]


class Pending(Generic[T]):
    """A non-blocking collective in flight (or, without MPI, done when ``wait`` runs it)."""

    def __init__(self, request: Any, finish: Callable[[], T], keep: Any = None) -> None:
        self._req, self._finish, self._keep = request, finish, keep
        self._done = False
        self._value: T | None = None

    def wait(self) -> T:
        """Complete it (blocks only if some rank has not started it yet) and return the result."""
        if not self._done:
            if self._req is not None:
                self._req.Wait()
                self._req = None
            self._value = self._finish()
            self._done = True
            self._keep = None
        return self._value  # type: ignore[return-value]


class PendingMin:
    """A MIN-allreduce in flight (or already known, without MPI)."""

    def __init__(self, request: Any, result: Any, keep: Any = None) -> None:
        self._req, self._result, self._keep = request, result, keep

    def wait(self) -> float:
        if self._req is not None:
            self._req.Wait()
            self._req = None
            return float(self._result[0])
        return float(self._result)
