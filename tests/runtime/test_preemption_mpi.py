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
