"""A coci_hpc error that escapes the user's script ends it the way the coci-* tools end: one
``prog: error: ...`` line (and ``prog: hint: ...``), no traceback, and the error's documented exit
code (:mod:`coci_hpc.errors`: 5 for a checkpoint directory of another run, 2 for bad usage, ...).

Installed by ``Session()`` and ``init_distributed()``. Only :class:`~coci_hpc.errors.CociError`
is handled; any other exception goes to the hook that was there before (the usual traceback).
Hooks installed later (the event log's record of the attempt's end, the checkpoint exit guard)
chain to this one, so they still run first.

Python gives an uncaught exception exit status 1 and offers no way to change it; so the status
is set at the very end: an ``atexit`` function registered at install time (it runs after those
registered later: torch's, the checkpoint manager's) ends the process with the error's code.
In an MPI world of more than one rank the status stays 1: finalizing there could wait on a rank
that is still training, and the MPI launcher reports the failed rank anyway.
"""
from __future__ import annotations

import atexit
import os
import sys
import weakref
from types import TracebackType
from typing import Any

from coci_hpc.errors import CociError, report_error

_installed = False
_code: int | None = None


def prog() -> str:
    """The name the user ran (``train.py``), as the tools' ``prog: error:`` lines use theirs."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and name not in ("-c", "-m") else "python"


def install() -> None:
    """Install once per process; idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(tp: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        global _code
        if not isinstance(exc, CociError):
            previous(tp, exc, tb)
            return
        report_error(prog(), exc)          # the tools' own format (one place: errors.report_error)
        sys.stderr.flush()
        _code = int(exc.exit_code)
    sys.excepthook = hook
    atexit.register(_exit_with_code)


def _mpi_world_size() -> int:
    mpi: Any = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return 0
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return 0
        return int(mpi.COMM_WORLD.Get_size())
    except Exception:        # an MPI that cannot answer any more: leave the exit as Python does it
        return -1


def _exit_with_code() -> None:
    if _code is None:
        return
    size = _mpi_world_size()
    if size > 1 or size < 0:
        return
    if size == 1:
        sys.modules["mpi4py.MPI"].Finalize()
    if "logging" in sys.modules:          # its own atexit flush may be one this exit skips
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_code)


# -- the attempt's end in the event log when the user's code lets an exception out of the loop ------
_active: list[weakref.ref[Any]] = []
_hooked = False


def watch_uncaught(session: Any) -> None:
    """An exception the user's code lets out of the loop ends the attempt: it is written to the
    event log as the attempt's end (status "error"), so coci-status does not show it running.
    sys.excepthook sees it under python/srun; coci-submit's runner calls :func:`record_uncaught`.
    ``session`` is the process's :class:`coci_hpc.Session` (held weakly; the newest one counts)."""
    global _hooked
    _active[:] = [weakref.ref(session)]
    if _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def hook(tp: type[BaseException], exc: BaseException, tb: Any) -> None:
        record_uncaught(exc)
        previous(tp, exc, tb)
    sys.excepthook = hook


def record_uncaught(exc: BaseException) -> None:
    """Write ``end`` status "error" for the session of this process whose loop did not end."""
    from coci_hpc.runtime.events import End, EndStatus, Stop, read_records

    session = _active[0]() if _active else None
    if session is None or isinstance(exc, SystemExit) or session.rank != 0 or not hasattr(session, "log"):
        return
    try:
        mine = [e for e in read_records(session.events_path) if e.attempt == session.log.attempt]
        if mine and isinstance(mine[-1], (End, Stop)):
            return                          # the session recorded how it ended (gave up, stopped, ...)
        session.log.write(End(step=session.step, status=EndStatus.ERROR,
                              message=f"{type(exc).__name__}: {exc}"[:2000]))
    except OSError:                         # the log's directory is gone: nothing to record into
        pass
