"""The end of a process that used torch.distributed: nothing in flight when Python finalizes.

Why (issue 37): a gloo worker thread drops its reference to a collective's work item a moment
*after* the caller's ``wait()`` has returned. When that is the last reference to a tensor whose
Python object is already gone (DTensor's ``full_tensor()`` makes such tensors), the drop takes
the GIL; once the interpreter has begun to finalize, taking the GIL ends the thread inside C++
code and the whole process aborts (exit 134, "terminate called without an active exception")
after its work was done: Slurm records FAILED. ``destroy_process_group()`` does not prevent it:
it only drops the registry's references, and a ``DeviceMesh`` (held by torch's DTensor caches
for the life of the process, or by a live model) keeps the backend and its threads running.

So at exit, from an ``atexit`` function (after threading's shutdown hooks, where open checkpoint
managers finish their persist, and before mpi4py's ``MPI_Finalize``, registered earlier):

1. the process group that :func:`~coci_hpc.runtime.distributed.init_distributed` created is
   destroyed, unless the script did it (no "destroy_process_group() was not called" warning);
2. the main thread waits, the GIL released, until no other thread of the process is running or
   runnable in several samples in a row (a worker that still has a release to do is runnable,
   or waits for the GIL, which it then gets), at most :data:`QUIESCE_S` seconds.
"""
from __future__ import annotations

import atexit
import os
import threading
import time

QUIESCE_S = 2.0        # most time spent waiting for other threads at exit
SAMPLES = 3            # consecutive samples with no other thread running
INTERVAL_S = 0.002     # between samples (the GIL is free meanwhile)

_installed = False
_owned = False         # the default process group is init_distributed's to destroy


def install(owns_process_group: bool = False) -> None:
    """Register the exit hook once; ``owns_process_group``: init_distributed created the default
    group, so the hook destroys it (a group the user created is the user's)."""
    global _installed, _owned
    _owned = _owned or owns_process_group
    if not _installed:
        _installed = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    try:
        _destroy_owned()
    finally:
        quiesce()


def _destroy_owned() -> None:
    if not _owned:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _busy_threads() -> list[int] | None:
    """Ids of the other threads of this process that are running or runnable (state R); None
    where /proc cannot tell."""
    me = threading.get_native_id()
    busy = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:            # the thread ended meanwhile
            continue
        if stat[stat.rindex(")") + 2:][:1] == "R":
            busy.append(int(tid))
    return busy


def quiesce(limit_s: float = QUIESCE_S) -> bool:
    """Wait, the GIL released, until no other thread has run in :data:`SAMPLES` samples in a row
    (or ``limit_s`` passed). True when the process went quiet."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < SAMPLES:
        busy = _busy_threads()
        if busy is None:
            return False
        quiet = 0 if busy else quiet + 1
        if time.monotonic() > deadline:
            return False
        time.sleep(INTERVAL_S)
    return True
