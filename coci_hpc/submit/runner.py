"""The callable coci-submit hands to submitit: run the user's script in this process, on every rank.

submitit pickles a :class:`ScriptRunner`, and ``python -m submitit.core._submit`` runs it in each
task that ``srun`` starts (again after every requeue: the script resumes from its checkpoint
directory by itself). In-process (``runpy``), not a subprocess, so that the Session inside the
script owns the signals Slurm sends to the task.

submitit installs its own handlers before calling us: USR2 checkpoints and ``scontrol requeue``s
inside the handler (guessing timeout vs preemption from elapsed time), SIGTERM/SIGCONT are logged and
ignored. :func:`hold_signals` replaces them with record-only handlers (the runtime's one
record-only signal class, ``SignalRecorder(hand_over=True)``) for the seconds before the script's
Session installs its own, and hands a signal that came in that window on to the Session.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path

from coci_hpc.runtime.entry import DEFAULT_SIGNALS, SignalRecorder
from coci_hpc.slurm.env import JobEnvironment

# The signals the Session owns (USR2: coci-submit's --signal, USR1, SIGTERM), held until it starts.
# SIGCONT keeps submitit's harmless logging handler.
OWNED_SIGNALS = DEFAULT_SIGNALS


def hold_signals() -> SignalRecorder:
    """Record-only handlers for the gap between submitit's set-up and the Session's: the runtime's
    one record-only signal class as a placeholder (``hand_over``). A signal received here is
    delivered again, once, to this process as soon as the Session has installed its handler, so
    a preemption a few seconds after start still stops the run at its first step boundary."""
    return SignalRecorder(OWNED_SIGNALS, hand_over=True, label="coci-submit").install()


ARRAY_TASK = "%a"


def task_arguments(args: tuple[str, ...], job: JobEnvironment) -> tuple[str, ...]:
    """The script's arguments for this array task: every ``%a`` becomes its task id.

    As in Slurm's file names and ``slurm/templates/train_array.sbatch``; outside an array job the
    arguments pass untouched (a literal ``%a`` included).
    """
    if job.array_task_id is None:
        return args
    return tuple(a.replace(ARRAY_TASK, job.array_task_id) for a in args)


class ScriptRunner:
    """``python SCRIPT ARGS...`` inside this process, with the COCI_* environment set.

    In an array job every ``%a`` in ARGS is replaced by the task id (:func:`task_arguments`).
    """

    def __init__(self, script: str, args: tuple[str, ...], env: Mapping[str, str]) -> None:
        self.script = script
        self.args = tuple(args)
        self.env = dict(env)

    def __call__(self) -> int:
        hold_signals()
        clear_stale_result()
        os.environ.update(self.env)
        sys.argv = [self.script, *task_arguments(self.args, JobEnvironment.from_env())]
        sys.path.insert(0, str(Path(self.script).parent))
        try:
            runpy.run_path(self.script, run_name="__main__")
        except SystemExit as exc:
            if exc.code in (None, 0):
                return 0
            raise
        except BaseException as exc:
            _record_uncaught(exc)
            _abort_other_ranks()
            raise
        return 0

    def __repr__(self) -> str:
        return f"ScriptRunner({self.script!r}, args={list(self.args)!r})"


def clear_stale_result() -> None:
    """Remove this task's half-written result file left by an earlier attempt of the same job.

    submitit writes the callable's result through ``<result>.save_tmp`` and refuses to begin that
    write when the file exists. A stop that requeues (preemption, the time limit, a node failure)
    ends the tasks at once, sometimes while rank 0 is inside that write (seen in the demo): the
    next attempt then trained to the end and failed in submitit's assertion, FAILED in sacct.
    Only this process writes this task's result in this attempt, so a leftover is never live."""
    try:
        import submitit

        paths = submitit.JobEnvironment().paths
    except Exception:  # not under submitit (a test, a plain srun): nothing of ours to clear
        return
    result = paths.result_pickle
    result.with_suffix(result.suffix + ".save_tmp").unlink(missing_ok=True)


def _record_uncaught(exc: BaseException) -> None:
    """The script's exception is the attempt's end in the event log (submitit catches it, so
    sys.excepthook never sees it). Only when the script started a Session."""
    session = sys.modules.get("coci_hpc.session")
    if session is not None:
        session.record_uncaught(exc)


def _abort_other_ranks() -> None:
    """After an uncaught exception on one rank, end every rank instead of leaving them in a collective."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    try:
        world = mpi.COMM_WORLD
        if mpi.Is_initialized() and not mpi.Is_finalized() and world.Get_size() > 1:
            traceback.print_exc()
            sys.stderr.flush()
            world.Abort(1)
    except Exception:  # the original exception matters more than a failed abort
        pass
