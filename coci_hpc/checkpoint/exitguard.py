"""What happens to live checkpoint managers when the process ends.

* **Normal end** (no uncaught exception): a background persist still in flight is finished and
  committed; every rank ends normally at the same point, so the commit's collectives match.
  This runs from threading's shutdown hooks, which Python calls before it stops the
  ``concurrent.futures`` pools (the CRC helper) and before any ``atexit`` function, so also
  before mpi4py's ``MPI_Finalize`` (an ``atexit`` hook ran too late: the CRC pool was already
  shut down and the persist failed with "cannot schedule new futures after shutdown").
* **Uncaught exception**: nothing collective may run any more: the other ranks may sit in a
  training collective this rank will never join. With more than one rank the job is aborted
  at once from ``sys.excepthook`` (after the traceback is printed): ``MPI_Abort``, status 1.
  With one rank the in-flight save is abandoned (never committed; the next save removes its
  directory) and Python exits with status 1 as usual.
"""
from __future__ import annotations

import os
import sys
import threading
import weakref
from types import TracebackType
from typing import Any, Protocol


class _Closable(Protocol):
    comm: Any

    def _close_at_exit(self) -> None: ...

    @property
    def closed(self) -> bool: ...


# Creation order, the same on every rank: closing at exit runs collectives manager by manager.
_managers: list[weakref.ref[Any]] = []
_failed = False
_installed = False
_previous_hook = sys.excepthook


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker forked after the manager was made) runs threading's
    # exit hooks when it ends: it must not close, and so release the lock of, its parent's managers.
    _managers.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def register(mgr: _Closable) -> None:
    """Track ``mgr``; install the process-wide hooks on first use."""
    global _installed, _previous_hook
    _managers[:] = [r for r in _managers if r() is not None]
    _managers.append(weakref.ref(mgr))
    if _installed:
        return
    _installed = True
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook
    register_shutdown = getattr(threading, "_register_atexit", None)
    if register_shutdown is not None:
        try:
            register_shutdown(_at_shutdown)
            return
        except RuntimeError:  # interpreter already shutting down
            pass
    import atexit

    atexit.register(_at_shutdown)


def exception_seen() -> bool:
    """True once an exception went uncaught (the process is ending because of it)."""
    return _failed or getattr(sys, "last_value", None) is not None


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    global _failed
    _failed = True
    _previous_hook(exc_type, exc, tb)
    multi = [m for m in _live() if not m.closed and m.comm.size > 1]
    if multi:
        comm = multi[0].comm
        print(f"coci_hpc: uncaught {exc_type.__name__} on rank {comm.rank}: aborting all "
              f"{comm.size} ranks (no checkpoint collective may run after an error; the "
              f"in-flight checkpoint, if any, is not committed)", file=sys.stderr, flush=True)
        comm.abort(1)


def _at_shutdown() -> None:
    if exception_seen():
        return
    for mgr in _live():
        if not mgr.closed:
            mgr._close_at_exit()


def _live() -> list[Any]:
    return [m for m in (r() for r in list(_managers)) if m is not None]
