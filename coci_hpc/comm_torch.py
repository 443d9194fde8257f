"""A :class:`~coci_hpc.comm.Comm` on torch.distributed, for DDP jobs started without MPI (torchrun,
``srun`` without ``--mpi``, submitit's TorchDistributedEnvironment).

Without it, every process of such a job would see a one-rank world and all of them would write
the same checkpoint as "rank 0". The collectives run on a gloo group of their own (object
collectives need CPU tensors, which NCCL does not take), so they never interleave with the
training's NCCL collectives. The checkpoint store then uses its serial HDF5 writer (rank 0 creates
the file, every rank ``pwrite``s its pieces), the same file format as the MPI-IO writer.
"""
from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from coci_hpc.comm import Comm, PendingMin
from coci_hpc.errors import UsageError

T = TypeVar("T")


class TorchComm(Comm):
    def __init__(self, group: Any = None) -> None:
        if not dist.is_initialized():
            raise UsageError("TorchComm needs an initialised torch.distributed process group",
                             hint="call coci_hpc.init_distributed() (or init_process_group) first")
        super().__init__(None)
        self.group = group if group is not None else (
            dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self._views: dict[int, torch.Tensor] = {}

    @classmethod
    def if_distributed(cls) -> TorchComm | None:
        """A TorchComm when a process group of more than one rank exists, else None."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls()
        return None

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def bcast(self, obj: T | None, root: int = 0) -> T:
        box = [obj]
        dist.broadcast_object_list(box, src=root, group=self.group)
        return box[0]  # type: ignore[return-value]  # root's value (see Comm.bcast)

    def allgather(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: T, root: int = 0) -> list[T] | None:
        everyone = self.allgather(obj)
        return everyone if self.rank == root else None

    def scatter(self, objs: list[T] | None, root: int = 0) -> T:
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.rank == root else None, src=root, group=self.group)
        return out[0]

    def _reduce(self, value: float, op: Any) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return float(t[0])

    def allreduce_min(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.MIN)

    def allreduce_max(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.MAX)

    def iallreduce_min(self, value: float) -> PendingMin:
        # Completed at once: the two-phase saver only needs the result by its next call.
        return PendingMin(None, self.allreduce_min(value))

    def iallreduce_max_array(self, send: np.ndarray, recv: np.ndarray) -> Any:
        """The session's per-step allreduce, started now and completed by the handle's ``wait()``
        into ``recv`` (a tensor view of it is made once per buffer: no allocation per step)."""
        view = self._views.get(id(recv))
        if view is None:
            view = self._views[id(recv)] = torch.from_numpy(recv)
        recv[:] = send
        return dist.all_reduce(view, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
