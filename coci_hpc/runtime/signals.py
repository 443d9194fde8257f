"""Slurm's stop signals act on the training ranks only, never on the processes they start.

Slurm sends the job's ``--signal`` (without ``B:``) and, on preemption or ``scancel``, SIGTERM to
EVERY process of the job step: the ranks and whatever they started. A DataLoader worker keeps the
default action (a spawned or forkserver worker always; a forked one when it was forked before the
Session installed its handlers) and dies; torch then raises "DataLoader worker (pid N) is killed
by signal" in the training process, exactly when it should save.

The mechanism, :func:`shield` (run at ``import coci_hpc`` inside a Slurm job step, i.e. under
``srun``, where Slurm signals every process; ``COCI_SHIELD_SIGNALS=1`` turns it on elsewhere,
``=0`` off): start one idle thread that keeps
USR1, USR2 and SIGTERM unblocked, then block them in the main thread. A signal mask is inherited
by threads started later, by ``fork`` and across ``exec`` (CPython and multiprocessing's spawn and
forkserver leave it alone), so every worker started afterwards holds these signals pending forever
and never acts on them. In the training process the kernel delivers them to the idle thread:
CPython's C-level handler runs there and the main thread runs the Python handler (the Session's
recorder) at its next bytecode, as before; with no Python handler installed, the default action
still ends the whole process. Nothing changes for the ranks; only their children are deaf.

Why not ``--signal=B:...`` with a batch-shell trap that forwards to the ranks: the batch shell
runs on the first node only, so it would have to find and signal the rank processes on every
node (``scontrol listpids`` per node, or an ``srun`` per node inside the grace time), and a
coci-submit job or a user's own sbatch script would each need that trap.

What a user must know (docs/how-to/dataloader-workers.md): processes the training process starts (``subprocess``, workers)
do not react to SIGUSR1/SIGUSR2/SIGTERM; ``Popen.terminate()`` on them does nothing, use
``kill()`` or unblock in the child (``signal.pthread_sigmask(signal.SIG_UNBLOCK, ...)``). At exit
the training process kills its remaining daemonic multiprocessing children (multiprocessing's own
exit would ``terminate()`` and then wait for them forever). A Python program started by a
shielded process that imports coci_hpc (not a multiprocessing child) unblocks them and is a
shielded training process of its own.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Mapping

from coci_hpc import settings
from coci_hpc.slurm.env import JobEnvironment

SHIELDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
ENV = settings.SHIELD_SIGNALS.name

_receiver: threading.Thread | None = None


def _receive() -> None:
    # This thread exists to have the signals unblocked (it is started before the main thread
    # blocks them; unblocking here too covers a parent that blocked some of them).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED)
    threading.Event().wait()


def _multiprocessing_child() -> bool:
    """A worker of multiprocessing (spawned/forkserver workers import the script while
    ``_inheriting``; every child knows its parent process afterwards)."""
    import multiprocessing
    me = multiprocessing.current_process()
    return bool(getattr(me, "_inheriting", False)) or multiprocessing.parent_process() is not None


def shield(environ: Mapping[str, str] | None = None) -> str:
    """Make processes started from now on deaf to Slurm's stop signals (see the module doc).

    Returns what happened: "shielded", "already", "off" (outside a Slurm step without
    ``COCI_SHIELD_SIGNALS=1``, or with ``=0``), "not main thread", or "worker" (a multiprocessing
    child of a shielded process, e.g. a spawned DataLoader worker importing the script: it stays
    deaf)."""
    global _receiver
    env = os.environ if environ is None else environ
    if _receiver is not None:
        return "already"
    wanted = env.get(ENV, "").strip().lower()
    if wanted in ("0", "no", "false", "off"):
        return "off"
    if wanted not in ("1", "yes", "true", "on") and JobEnvironment.from_env(env).step_id is None:
        return "off"
    if threading.current_thread() is not threading.main_thread():
        return "not main thread"
    if set(SHIELDED) & set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) and _multiprocessing_child():
        signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
        return "worker"
    # Imported first so that its exit handler is registered before ours: exit handlers run in
    # reverse order, and ours must kill the deaf workers before it waits for them.
    import multiprocessing.util  # noqa: F401

    _receiver = threading.Thread(target=_receive, name="coci-signals", daemon=True)
    _receiver.start()
    signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    # multiprocessing starts its resource tracker (at the first spawn) with SIGINT/SIGTERM blocked
    # around the spawn and then UNBLOCKS them in the calling thread: started later, it would undo
    # the block, and every worker spawned after it would die of SIGTERM. Started now, after the
    # block (so the tracker itself is deaf and lives on: it is never started again), and the block
    # made again.
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    atexit.register(_kill_daemonic_children)
    return "shielded"


def is_shielded() -> bool:
    return _receiver is not None


def _kill_daemonic_children() -> None:
    """multiprocessing's exit handler ``terminate()``s daemonic children (DataLoader workers) and
    joins them: a shielded worker ignores SIGTERM, so it is killed instead."""
    import multiprocessing
    deaf = [p for p in multiprocessing.active_children() if p.daemon]
    if not deaf:
        return
    # torch's SIGCHLD handler would report each worker killed here as a failure of the run.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in deaf:
        try:
            p.kill()
        except (OSError, ValueError):
            pass


def after_session() -> None:
    """After a Session's loop: a signal whose handler is still a placeholder (coci-submit's runner
    holds USR1/USR2/SIGTERM for the Session until it starts, see submit/runner.py) gets its
    default action back, as in a script without coci_hpc. A user's own handler is left alone."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SHIELDED:
        if getattr(getattr(signal.getsignal(s), "__self__", None), "coci_placeholder", False):
            signal.signal(s, signal.SIG_DFL)
