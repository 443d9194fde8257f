"""Refuse a multi-process launch that the checkpoint communicator does not cover.

Under ``torchrun`` or ``srun`` without ``--mpi``, no MPI launcher variables are set, so every
process saw itself as rank 0 of 1, wrote the same step directory and could delete a directory
another process was still writing. The launcher still says how many processes it started:
``SLURM_STEP_NUM_TASKS`` for an ``srun`` step (read through
:class:`~coci_hpc.slurm.env.JobEnvironment`; ``SLURM_NTASKS`` is also set in the batch script
itself, which is one process, so it cannot tell) and ``WORLD_SIZE`` for torchrun / torch
elastic. A communicator of one process where the launcher started several is refused before
anything is written. A caller's own communicator covering all processes (any :class:`Comm`
subclass with ``size`` > 1) is accepted.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from coci_hpc.comm import Comm
from coci_hpc.errors import UsageError
from coci_hpc.slurm.env import JobEnvironment


def launched_processes(job: JobEnvironment, environ: Mapping[str, str]) -> tuple[int, str] | None:
    """(processes the launcher started, which launcher said so), or None when it says nothing."""
    if job.step_num_tasks is not None and job.step_num_tasks > 1:
        return job.step_num_tasks, "srun (SLURM_STEP_NUM_TASKS)"
    raw = environ.get("WORLD_SIZE", "")
    if raw.isdigit() and int(raw) > 1:
        return int(raw), "torchrun (WORLD_SIZE)"
    return None


def check_launch(comm: Comm, job: JobEnvironment | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
    """Raise UsageError when ``comm`` has one process but the launcher started several."""
    if comm.size > 1:
        return
    job = job if job is not None else JobEnvironment.from_env()
    found = launched_processes(job, os.environ if environ is None else environ)
    if found is None:
        return
    n, source = found
    raise UsageError(
        f"{source} started {n} processes but the checkpoint communicator has only this one: every "
        f"process would write the same checkpoint as rank 0 of 1",
        hint=f"launch the ranks through MPI (`srun --mpi=pmix python -m mpi4py train.py` or "
             f"`mpiexec -n {n} python -m mpi4py train.py`), or pass comm= a communicator that "
             f"covers all {n} processes")
