"""Slurm's stop signals: the one record-only handler class, and the shield of the processes the ranks start.

:class:`SignalRecorder` is the only class that installs handlers for USR1, USR2 and SIGTERM
(:data:`DEFAULT_SIGNALS`). Its handlers only record which signal came and when: a handler runs
between two bytecodes of whatever the program does (mid-step, a collective half done on one rank),
so the owner of the loop acts on the record at its next step boundary. Three owners install one:
the Session (and :class:`~coci_hpc.runtime.preemption.PreemptionGuard` for a loop of one's own),
the relaunch loop in the batch shell, and coci-submit's runner, whose recorder is a *placeholder*
(``hand_over=True``) for the seconds between submitit's set-up and the Session's: a signal recorded
there is delivered again, once, to the process as soon as another handler (the Session's) owns it.

The rest of this module: Slurm's stop signals act on the training ranks only, never on the
processes they start.

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
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from coci_hpc import settings
from coci_hpc.slurm.env import JobEnvironment

# What the runtime owns while a loop runs: submitit and coci-submit ask Slurm for USR2, scripts and
# templates for USR1 or USR2, and SIGTERM comes at the end of the grace time / on scancel.
DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
SHIELDED = DEFAULT_SIGNALS


@dataclass(frozen=True)
class Received:
    signum: int
    monotonic: float

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class SignalRecorder:
    """Installs handlers that only record which signal came, and when (``received``, ``first``).

    It composes with handlers already installed: with ``chain=True`` a previous Python handler is
    still called after recording; with ``chain=False`` (the Session, the relaunch loop) the previous
    handlers are replaced while installed: submitit's USR2 handler checkpoints and requeues inside
    the handler and exits, it must not run. :meth:`uninstall` restores exactly what was there.

    ``hand_over=True`` (coci-submit's runner, before the script's Session exists; never chains): a
    recorded signal is delivered again, once, to this process as soon as someone else has installed
    a handler for it, so a preemption a few seconds after start still stops the run at its first
    step boundary; ``label`` names who holds it in the note printed then. Without a Session the
    signal stays recorded and nothing else happens (the script ends or Slurm ends it), and
    :func:`after_session` gives a signal the default action back from such a placeholder.
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS, *, chain: bool = True,
                 hand_over: bool = False, label: str = "coci", poll_s: float = 0.05) -> None:
        self.signals = tuple(signals)
        self.chain = chain and not hand_over
        self.hand_over, self.label, self.poll_s = hand_over, label, poll_s
        self.received: list[Received] = []
        self._previous: dict[int, Any] = {}
        self._forwarder: threading.Thread | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.hand_over and signal.getsignal(signum) != self._handle:
            # Called by a later handler (a Session's that chains) which replaced us: it has the signal.
            return
        self.received.append(Received(signum, time.monotonic()))
        if self.hand_over:
            print(f"{self.label}: {signal.Signals(signum).name} received while no training session runs; "
                  f"held for the session if one starts", file=sys.stderr, flush=True)
            if self._forwarder is None:
                self._forwarder = threading.Thread(target=self._forward, daemon=True, name="coci-early-signals")
                self._forwarder.start()
            return
        prev = self._previous.get(signum)
        if self.chain and callable(prev):
            prev(signum, frame)

    def install(self) -> SignalRecorder:
        for s in self.signals:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def take_back(self) -> dict[int, Any]:
        """Put this recorder's handler back where a later handler replaced it (a framework that
        installs its own after ours: Lightning's SIGTERM handler); the chained handlers stay those
        found at :meth:`install`. Returns them ({signal: handler}), for the framework to restore."""
        for s in self.signals:
            if s in self._previous and signal.getsignal(s) != self._handle:
                signal.signal(s, self._handle)
        return dict(self._previous)

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def first(self) -> Received | None:
        return self.received[0] if self.received else None

    def sigterm_at(self) -> float | None:
        """``time.monotonic()`` of the first SIGTERM (Slurm ending the step; SIGKILL follows), else None."""
        return next((r.monotonic for r in self.received if r.signum == signal.SIGTERM), None)

    def _forward(self) -> None:
        """``hand_over``: deliver each recorded signal again, once, when another handler owns it.
        Reads ``received`` by index (no lock: a lock taken inside a handler could deadlock against
        a second signal); the handler appends, this thread only reads."""
        done = 0
        pending: list[int] = []
        while True:
            while done < len(self.received):
                pending.append(self.received[done].signum)
                done += 1
            for s in list(pending):
                handler = signal.getsignal(s)
                if handler != self._handle and callable(handler):
                    pending.remove(s)
                    os.kill(os.getpid(), s)
            if not pending and done == len(self.received) \
                    and all(signal.getsignal(s) != self._handle for s in self.signals):
                return  # everything handed on and someone else owns the signals: nothing left to do
            time.sleep(self.poll_s)
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


STACKS_SIGNAL = signal.SIGQUIT


def stacks_on_request(environ: Mapping[str, str] | None = None) -> bool:
    """Inside a Slurm job step: on SIGQUIT, every thread's Python stack goes to stderr and the
    process goes on (faulthandler's C handler: it works while the main thread is stuck inside a
    C call, an MPI or gloo wait, where no Python handler would run). A rank that hangs can then
    say where: ``scancel --signal=QUIT JOB`` (every rank of the job's steps), the stacks in each
    rank's log. Slurm itself never sends SIGQUIT. Not done outside a step, off the main thread,
    or when the program has its own SIGQUIT handler. True when registered (now or before)."""
    import faulthandler

    env = os.environ if environ is None else environ
    if JobEnvironment.from_env(env).step_id is None or threading.current_thread() is not threading.main_thread():
        return False
    global _stacks_registered
    if _stacks_registered:
        return True
    if signal.getsignal(STACKS_SIGNAL) not in (signal.SIG_DFL, None):
        return False
    try:
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, OSError, RuntimeError, ValueError):
        # no stderr with a file descriptor (a notebook kernel's stream, stderr closed): `import
        # coci_hpc` must still work, without this diagnostic
        return False
    _stacks_registered = True
    return True


_stacks_registered = False


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


# Slurm's warning signals (``--signal``): after a loop that finished its work, one that arrives
# late is ignored rather than ending the process (see after_session).
LATE_WARNINGS = (signal.SIGUSR1, signal.SIGUSR2)


def after_session(completed: bool = False) -> None:
    """After a Session's loop: a signal whose handler is still a placeholder (a ``hand_over``
    :class:`SignalRecorder`: coci-submit's runner holds USR1/USR2/SIGTERM for the Session until it
    starts, see submit/runner.py) gets its
    default action back, as in a script without coci_hpc. A user's own handler is left alone.

    ``completed``: the loop ran every step and wrote its final checkpoint. Then USR1/USR2 left at
    their default action (which ends the process) are ignored from now on: Slurm's time-limit or
    preemption warning can arrive while the finished run is still exiting (its lead time reached
    just as the last step ended), and dying of it would make Slurm record the completed job as
    FAILED. SIGTERM keeps its default action."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SHIELDED:
        handler = signal.getsignal(s)
        owner = getattr(handler, "__self__", None)
        if isinstance(owner, SignalRecorder) and owner.hand_over:
            signal.signal(s, signal.SIG_DFL)
            handler = signal.SIG_DFL
        if completed and s in LATE_WARNINGS and handler == signal.SIG_DFL:
            signal.signal(s, signal.SIG_IGN)
