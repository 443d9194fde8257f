"""torch.distributed set-up from the launcher's environment, as submitit's
TorchDistributedEnvironment does: rank, world size, local rank and the rendezvous address.

Precedence (first that applies): a process group already initialised; ``RANK``/``WORLD_SIZE``
already set (torchrun, or the user); an MPI launch (mpiexec, ``srun --mpi=pmix``: rank 0 sends
its host name and the port of a socket it is already listening on over MPI, so nothing has to
resolve node names and no other process can take the port in between); a Slurm step
(``SLURM_PROCID``/``SLURM_NTASKS``, rendezvous on the first node of the job at a port derived
from the job id); else one process. Backend: NCCL when CUDA is available, else gloo.

A rank that never reaches the rendezvous leaves the others waiting up to the timeout; so while a
rank is inside :func:`init_distributed` a watchdog is armed that prints every thread's stack to
its stderr shortly before that timeout (the rank that hangs says where), and rank 0's error names
the ranks that did not arrive.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from coci_hpc import settings
from coci_hpc.comm import Comm
from coci_hpc.errors import CommError, UsageError
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


# Rank 0's listening sockets by port, from the MPI rendezvous to the store built on them.
_listeners: dict[int, socket.socket] = {}
ARRIVED_KEY = "coci/arrived/"        # + rank: each rank's "host pid" once it reached the store
WATCHDOG_LEAD_S = 10.0               # the stacks are printed this long before the rendezvous times out


def _listen() -> socket.socket:
    """A socket listening on a free port (dual stack where there is IPv6): bound before the port is
    published, unlike binding port 0, closing and binding again, where another process (or a TCP
    connection's local end) can take the port in between."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=1024)
        except OSError:
            pass
    return socket.create_server(("", 0), backlog=1024)


def rendezvous(comm: Comm | None = None, job: JobEnvironment | None = None,
               environ: Mapping[str, str] | None = None, listen: bool = False) -> tuple[dict[str, str], str]:
    """The env:// variables to use (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK) and their source.
    Collective under MPI.

    ``listen`` (init_distributed's): under MPI, rank 0 keeps the published port bound, listening,
    for the store :func:`init_distributed` builds on it. Without it the port is free again when
    this returns, for a caller that starts its own store there (``init_method="tcp://..."``)."""
    env = os.environ if environ is None else environ
    job = job if job is not None else JobEnvironment.from_env(env)
    comm = comm if comm is not None else Comm.world()
    if "RANK" in env and "WORLD_SIZE" in env:
        keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        return {k: env[k] for k in keys if k in env}, "env"
    if comm.is_mpi:
        mine = None
        if comm.rank == 0 and "MASTER_ADDR" in env and "MASTER_PORT" in env:
            mine = (str(env["MASTER_ADDR"]), int(env["MASTER_PORT"]), job.job_id)
        elif comm.rank == 0:
            sock = _listen()
            port = int(sock.getsockname()[1])
            if listen:
                _listeners[port] = sock
            else:
                sock.close()
            mine = (socket.gethostname(), port, job.job_id)
        host, port, job_id = comm.bcast(mine)
        if job_id != job.job_id:
            raise UsageError(f"rank {comm.rank} (Slurm job {job.job_id}) got its rendezvous address from rank 0 "
                             f"of job {job_id}: two jobs' ranks are talking over MPI",
                             hint="launch each job's ranks with their own srun/mpiexec")
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
    values, source = rendezvous(comm, listen=True)
    rank, world, local = int(values["RANK"]), int(values["WORLD_SIZE"]), int(values.get("LOCAL_RANK", 0))
    if "nccl" in backend:
        torch.cuda.set_device(local % max(1, torch.cuda.device_count()))
    if world == 1:
        # No rendezvous for one process: an in-memory store, no port to pick.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        timeout = timedelta(seconds=timeout_s)
        with _stack_watchdog(max(1.0, min(timeout_s - WATCHDOG_LEAD_S, 0.9 * timeout_s))):
            store = _store(values["MASTER_ADDR"], int(values["MASTER_PORT"]), rank, world, timeout_s)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
            teardown.install(owns_process_group=True)
            _all_joined(store, rank, world, timeout_s)
    teardown.install(owns_process_group=True)   # destroyed at exit, no gloo release left in flight
    return DistInfo(rank, world, local, backend, source)


@contextmanager
def _stack_watchdog(after_s: float) -> Iterator[None]:
    """While inside: after ``after_s`` seconds, every thread's stack to stderr (faulthandler's
    timer thread, so also when this rank is stuck in native code: MPI, a socket, an import).
    faulthandler has one such timer per process: this replaces one the script armed itself."""
    try:
        faulthandler.dump_traceback_later(after_s, exit=False, file=sys.stderr)
        armed = True
    except (ValueError, OSError, AttributeError):   # no usable stderr (a test's capture)
        armed = False
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def _store(host: str, port: int, rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, rank 0 serving it (on the socket the MPI rendezvous listened on, when
    there is one) as torch's ``tcp://`` and ``env://`` do, or torchrun's agent serving it
    (``TORCHELASTIC_USE_AGENT_STORE``: every rank a client); returns once every rank has reached
    it, or raises naming the ranks missing.

    Every rank returns only once rank 0 has seen all of them arrive: gloo's (and NCCL's) own
    handshake that follows has the same timeout, counted from each rank's start of it, so a rank
    that arrived early and went straight on would give up there (a bare ``DistStoreError``
    traceback, and its peers a "Connection closed by peer") whenever the last rank came more than
    the timeout after it (a slow start on a busy node or file system; seen in CI under load). Rank
    0 polls one counter; the others wait, server-side, for one verdict key. The verdict is
    written once (``compare_set``), by whoever decides first: rank 0's "ok" or its error naming
    the missing ranks, or a rank that gave up waiting for rank 0; every rank then acts on the
    same verdict (a rank 0 arriving after one gave up raises too, instead of meeting a peer that
    has gone inside gloo's handshake)."""
    timeout = timedelta(seconds=timeout_s)
    agent = _agent_store()
    arrived = _keys()
    count, verdict = f"{arrived}count", f"{arrived}verdict"
    hint = ("look at those ranks' output; a start-up that can take longer (slow imports, a busy file "
            f"system) needs a larger {settings.DIST_TIMEOUT.name}")
    try:
        if rank == 0 and not agent:
            sock = _listeners.pop(port, None)
            fd = sock.detach() if sock is not None else None      # the store owns (and closes) it now
            store = dist.TCPStore(host, port, world, True, timeout, wait_for_workers=False, multi_tenant=True,
                                  master_listen_fd=fd)
        else:
            store = dist.TCPStore(host, port, world, False, timeout)
    except RuntimeError as exc:   # DistNetworkError: nobody serves the address (or it is ours and taken)
        serves = "torchrun's agent" if agent else "rank 0"
        raise CommError(f"rank {rank} could not {'serve' if rank == 0 and not agent else 'reach'} the rendezvous "
                        f"store at {host}:{port} ({serves} serves it) within {timeout_s:g}s: "
                        f"{str(exc).splitlines()[0][:300]}",
                        hint=f"check that {serves} is running and that MASTER_ADDR/MASTER_PORT name it; "
                             f"a slow start needs a larger {settings.DIST_TIMEOUT.name}") from None
    store.set(f"{arrived}{rank}", f"{socket.gethostname()} pid {os.getpid()}")
    store.add(count, 1)
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        while store.add(count, 0) < world:
            if time.monotonic() > deadline:
                missing = [r for r in range(1, world) if not store.check([f"{arrived}{r}"])]
                message = (f"rank(s) {missing[:16]}{' ...' if len(missing) > 16 else ''} of {world} did not reach "
                           f"the rendezvous at {host}:{port} within {timeout_s:g}s: each such rank died or hung "
                           "before or inside init_distributed (its stack is in its stderr if it hung inside)")
                said = _decide(store, verdict, message)   # the ranks that did arrive raise it too
                _await_readers(store, f"{arrived}read", store.add(count, 0) - 1)
                raise CommError(message if said == message else f"{said} (and {message})", hint=hint)
            time.sleep(0.05)
        said = _decide(store, verdict, "ok")
        if said != "ok":
            raise CommError(f"rank 0 reached the rendezvous after another rank gave up: {said}", hint=hint)
        return store
    # Rank 0 gives the others up to the timeout from its own arrival, which may come after ours.
    # One blocking get (it waits for the key). Rank 0, which serves the store, waits (briefly) for
    # each arrived rank to count itself read before it raises and exits with its error.
    store.set_timeout(2 * timeout)
    try:
        said = store.get(verdict).decode()
    except RuntimeError as exc:   # DistStoreError (timeout), DistNetworkError (the server is gone)
        gave_up = (f"rank {rank} had no word from rank 0 at the rendezvous {host}:{port} within {2 * timeout_s:g}s "
                   f"of arriving ({str(exc).splitlines()[0][:200]}): rank 0 died, hung, or started far later than "
                   "this rank (its output says which)")
        try:
            said = _decide(store, verdict, gave_up)   # rank 0 may have said "ok" just now
        except RuntimeError:
            said = gave_up                            # the store itself is gone
    finally:
        store.set_timeout(timeout)
    if said != "ok":
        with contextlib.suppress(RuntimeError):   # rank 0 may exit once we have read its error
            store.add(f"{arrived}read", 1)
        mine = said.startswith(f"rank {rank} ")
        raise CommError(said if mine else f"rank 0's rendezvous failed: {said}",
                        hint=hint.replace("those ranks'", "rank 0's") if mine else hint)
    return store


def _agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _keys() -> str:
    """The prefix of this attempt's rendezvous keys: the agent's store outlives a restart of the
    workers, so under it each attempt (``TORCHELASTIC_RESTART_COUNT``) has its own."""
    return f"{ARRIVED_KEY}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/" if _agent_store() else ARRIVED_KEY


def _all_joined(store: dist.TCPStore, rank: int, world: int, timeout_s: float) -> None:
    """Return once every rank's ``init_process_group`` has returned. gloo's full-mesh handshake
    can return on one rank while a peer is still inside it: a rank 0 that then exits (a script
    that fails, or ends, right after starting) closed the connection under that peer, whose
    handshake failed with "Connection closed by peer" and a traceback (seen under load). Rank 0,
    which serves the store, leaves last: it waits (briefly) for the others to say they saw all."""
    joined, left = f"{_keys()}joined", f"{_keys()}left"
    store.set(f"{joined}/{rank}", "1")
    store.add(joined, 1)
    deadline = time.monotonic() + timeout_s
    try:
        while store.add(joined, 0) < world:
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if not store.check([f"{joined}/{r}"])]
                raise CommError(f"rank(s) {missing[:16]}{' ...' if len(missing) > 16 else ''} of {world} did not "
                                f"finish the process group's handshake within {timeout_s:g}s of this rank "
                                "(each such rank's output says why)",
                                hint="look at those ranks' output; a slow start needs a larger "
                                     f"{settings.DIST_TIMEOUT.name}")
            time.sleep(0.005)
    except RuntimeError as exc:   # DistNetworkError: the store's server (rank 0) has gone
        raise CommError(f"rank {rank} lost the rendezvous store while the ranks finished the process group's "
                        f"handshake: {str(exc).splitlines()[0][:200]}",
                        hint="rank 0 died or ended early: its output says why") from None
    if rank == 0:
        _await_readers(store, left, world - 1)
    else:
        with contextlib.suppress(RuntimeError):   # rank 0 may exit as soon as it has counted us
            store.add(left, 1)


def _await_readers(store: dist.TCPStore, key: str, readers: int, within_s: float = 5.0) -> None:
    """Rank 0, about to raise (and exit, taking the store it serves with it): wait, briefly,
    until the ``readers`` ranks that arrived have read its verdict (a blocking ``get`` is a wait
    and then a read; a server gone in between leaves the reader a bare "Connection reset")."""
    deadline = time.monotonic() + within_s
    while store.add(key, 0) < readers and time.monotonic() < deadline:
        time.sleep(0.02)


def _decide(store: dist.TCPStore, key: str, value: str) -> str:
    """Write ``value`` under ``key`` unless a verdict is there already; the verdict that holds."""
    return store.compare_set(key, "", value).decode()


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
