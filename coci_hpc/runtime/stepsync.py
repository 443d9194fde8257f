"""The session's one collective per step: stop flag, checkpoint decision and persist state in one
MAX-allreduce of three numbers, into buffers allocated once.

- ``stop``: the stop level this rank's signals ask for (0 none, 1 leave, 2 stop-save-requeue; the
  MAX means any rank's signal stops every rank at this step);
- ``save``: rank 0's planner decided to checkpoint after this step (other ranks send 0);
- ``busy``: this rank's background persist is still writing (the commit waits for the slowest).

Folding them replaces the guard's allreduce, the schedule's broadcast and the two-phase saver's
``poll`` (an Iallreduce) with one small blocking call, which costs about one latency per step.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from coci_hpc.comm import Comm


class StepSync:
    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._send = np.zeros(3, dtype=np.float64)
        self._recv = np.zeros(3, dtype=np.float64)
        self._mpi_max: Any = None
        if comm.mpi_comm is not None:
            from mpi4py import MPI

            self._mpi_max = MPI.MAX

    def exchange(self, stop: int, save: bool, busy: bool) -> tuple[int, bool, bool]:
        send, recv = self._send, self._recv
        send[0], send[1], send[2] = stop, save, busy
        reduce = getattr(self.comm, "allreduce_max_array", None)
        if reduce is not None:          # a Comm subclass with its own backend (torch.distributed)
            reduce(send, recv)
        elif self.comm.mpi_comm is not None:
            self.comm.mpi_comm.Allreduce(send, recv, op=self._mpi_max)
        else:
            recv[:] = send
        return int(recv[0]), bool(recv[1] > 0), bool(recv[2] > 0)
