"""torch.distributed set-up from the launcher's environment, as submitit's
TorchDistributedEnvironment does: rank, world size, local rank and the rendezvous address.

Precedence (first that applies): a process group already initialised; ``RANK``/``WORLD_SIZE``
already set (torchrun, or the user); an MPI launch (mpiexec, ``srun --mpi=pmix``: rank 0 sends
its host name and a free port over MPI, so nothing has to resolve node names); a Slurm step
(``SLURM_PROCID``/``SLURM_NTASKS``, rendezvous on the first node of the job at a port derived
from the job id); else one process. Backend: NCCL when CUDA is available, else gloo.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from coci_hpc import settings
from coci_hpc.comm import Comm
from coci_hpc.errors import UsageError
from coci_hpc.runtime import errorexit, teardown
from coci_hpc.slurm.env import JobEnvironment
from coci_hpc.slurm.hostlist import expand_hostlist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    source: str   # "initialized" | "env" | "mpi" | "slurm" | "single"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def rendezvous(comm: Comm | None = None, job: JobEnvironment | None = None,
               environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The env:// variables to use (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK) and their source.
    Collective under MPI."""
    env = os.environ if environ is None else environ
    job = job if job is not None else JobEnvironment.from_env(env)
    comm = comm if comm is not None else Comm.world()
    if "RANK" in env and "WORLD_SIZE" in env:
        keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        return {k: env[k] for k in keys if k in env}, "env"
    if comm.is_mpi:
        mine = (socket.gethostname(), _free_port()) if comm.rank == 0 else None
        host, port = comm.bcast(mine)
        local = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or (str(job.localid) if job.localid is not None else "0")
        return {"MASTER_ADDR": str(env.get("MASTER_ADDR", host)), "MASTER_PORT": str(env.get("MASTER_PORT", port)),
                "RANK": str(comm.rank), "WORLD_SIZE": str(comm.size), "LOCAL_RANK": str(local)}, "mpi"
    if job.in_slurm_job and job.procid is not None and job.ntasks is not None:
        first = expand_hostlist(job.nodelist or "")[:1] or [socket.gethostname()]
        port = 20000 + int("".join(c for c in (job.job_id or "0") if c.isdigit()) or 0) % 20000
        return {"MASTER_ADDR": str(env.get("MASTER_ADDR", first[0])), "MASTER_PORT": str(env.get("MASTER_PORT", port)),
                "RANK": str(job.procid), "WORLD_SIZE": str(job.ntasks),
                "LOCAL_RANK": str(job.localid or 0)}, "slurm"
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "single"


DEFAULT_TIMEOUT_S = settings.DIST_TIMEOUT_S
# NCCL for CUDA tensors, gloo beside it for CPU ones: DCP's async save refuses a group without a
# CPU backend, and control paths on host tensors then never wait behind a hung NCCL collective.
NCCL_WITH_CPU = "cpu:gloo,cuda:nccl"


def init_distributed(backend: str | None = None, comm: Comm | None = None,
                     timeout_s: float | None = None) -> DistInfo:
    """Initialise the default process group (also for one process, so DDP works unchanged).

    The rendezvous comes from, in this order: a group already initialised; ``RANK`` /
    ``WORLD_SIZE`` (torchrun); an MPI launch (rank 0 sends its host and a free port over MPI); a
    Slurm step (``SLURM_PROCID`` / ``SLURM_NTASKS``, the job's first node); else one process.

    Args:
        backend: any torch.distributed backend string; default ``"cpu:gloo,cuda:nccl"`` (NCCL for
            CUDA tensors, gloo for CPU ones) when CUDA is available, else ``"gloo"``.
        comm: The MPI communicator to rendezvous over (default: MPI's world when launched by MPI).
        timeout_s: Bound on every gloo/NCCL collective (default ``COCI_DIST_TIMEOUT_S`` or 120 s):
            between separate hosts a dead peer sends no reset, and torch's default (30 min for
            gloo) would keep the survivors waiting far past Slurm's kill window.

    Returns:
        A ``DistInfo``: rank, world size, local rank, backend and where the rendezvous came from.

    A group this call created is destroyed at exit (no ``destroy_process_group()`` needed), and
    the exit waits until no gloo thread still releases a collective's tensors (:mod:`.teardown`).
    """
    errorexit.install()            # a CociError out of the script: one line and its exit code
    if timeout_s is None:
        timeout_s = float(settings.DIST_TIMEOUT.raw() or DEFAULT_TIMEOUT_S)
    if dist.is_initialized():
        teardown.install()         # someone else's group: not ours to destroy, but quiet at exit
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                        dist.get_backend(), "initialized")
    backend = backend or (NCCL_WITH_CPU if torch.cuda.is_available() else "gloo")
    values, source = rendezvous(comm)
    rank, world, local = int(values["RANK"]), int(values["WORLD_SIZE"]), int(values.get("LOCAL_RANK", 0))
    if "nccl" in backend:
        torch.cuda.set_device(local % max(1, torch.cuda.device_count()))
    if world == 1:
        # No rendezvous for one process: an in-memory store, no port to pick.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{values['MASTER_ADDR']}:{values['MASTER_PORT']}",
                                rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    teardown.install(owns_process_group=True)   # destroyed at exit, no gloo release left in flight
    return DistInfo(rank, world, local, backend, source)


def default_comm(environ: Mapping[str, str] | None = None) -> Comm:
    """The world the Session runs in: MPI's when launched by MPI; a torch.distributed group of 2+
    ranks (DDP without MPI); else one process.

    The launcher's own ``WORLD_SIZE`` (torchrun) wins over a one-rank MPI world: a script that
    imports mpi4py under torchrun gets a singleton MPI world of 1 on every process, and each of
    them would take itself for the only rank."""
    env = os.environ if environ is None else environ
    world = Comm.world()
    try:
        launcher_size = int(env.get("WORLD_SIZE") or 0)
    except ValueError:
        launcher_size = 0
    if world.is_mpi and not (world.size == 1 and launcher_size > 1):
        return world
    from coci_hpc.comm_torch import TorchComm
    group = TorchComm.if_distributed()
    if group is not None:
        teardown.install()         # its gloo collectives: none in flight at exit
        return group
    if launcher_size > 1:
        raise UsageError(f"WORLD_SIZE={launcher_size} (torchrun or your launcher) but this process sees a "
                         f"world of 1 ({'MPI singleton' if world.is_mpi else 'no MPI'}) and no torch.distributed "
                         f"process group",
                         hint="call coci_hpc.init_distributed() (or torch.distributed.init_process_group) "
                              "before Session(), or launch with srun/mpiexec")
    return world
