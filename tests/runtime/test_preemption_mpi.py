"""Under mpiexec -n 2: a signal seen by one rank stops every rank at the same step."""
from __future__ import annotations

import os
import signal

import pytest

from coci_hpc.comm import Comm
from coci_hpc.runtime.preemption import PreemptionGuard, SignalRecorder
from coci_hpc.slurm.env import JobEnvironment

pytestmark = pytest.mark.mpi


def test_one_rank_signalled_all_ranks_stop_at_the_same_step() -> None:
    comm = Comm.world()
    with PreemptionGuard(comm, JobEnvironment(), SignalRecorder([signal.SIGUSR1])) as guard:
        stopped_at = None
        for step in range(10):
            if step == 3 and comm.rank == comm.size - 1:  # only the last rank is signalled
                os.kill(os.getpid(), signal.SIGUSR1)
            if guard.stop_requested():
                stopped_at = step
                break
    assert comm.allgather(stopped_at) == [3] * comm.size


def test_schedule_decision_is_the_same_on_every_rank_although_their_clocks_differ() -> None:
    import math

    from coci_hpc.planner.failures import from_mtbf
    from coci_hpc.runtime.schedule import CheckpointSchedule

    comm = Comm.world()
    sched = CheckpointSchedule("young", from_mtbf(30.0), nodes=comm.size, horizon_s=600, comm=comm,
                               warmup_steps=5)
    decisions = []
    for step in range(1, 400):
        # Different step times and losses per rank: only rank 0's planner decides.
        sched.observe(step, math.exp(-step / 100) * (1 + comm.rank), 0.01 * (1 + comm.rank))
        if sched.due(step):
            sched.saved(step, 0.05 * (1 + comm.rank))
            decisions.append(step)
    assert len(decisions) >= 2
    assert comm.allgather(decisions) == [decisions] * comm.size
