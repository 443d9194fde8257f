"""The writer lock of a checkpoint directory: one training run writes it at a time.

Two runs saving into one directory committed checkpoints holding bytes of both and deleted
each other's unfinished steps. So a writer takes ``ROOT/.coci-writer.lock`` first; it names
the holder (Slurm job id when there is one, host, pid and the pid's start time, since when)
and a second live writer is refused up front with an error naming that holder. Readers
(``coci-ckpt list/verify``, ``CheckpointManager(..., lock=False)``) take no lock.

A lock is *stale*, and taken over, only when its holder's process is gone (:func:`is_stale`, pure):

* its holder ran on this host and that process is gone (or the pid now belongs to another
  process: the start time differs). The same Slurm job id is not enough: two ``srun &`` in one
  allocation, or two shells under ``salloc``, are two live writers of one job;
* its holder ran on another host under the same job id in an earlier attempt (a smaller
  ``SLURM_RESTART_COUNT``): Slurm starts a requeued job only after every process of the previous
  attempt ended;
* its holder ran on another host in a step of this same attempt that ``squeue --steps`` no
  longer lists;
* its holder's Slurm job (another one) is known to Slurm as no longer running (asked with
  ``squeue``, only for a holder on another host).

If Slurm cannot answer, a holder on another host counts as live.

Acquisition is atomic without relying on ``flock`` (not available on every Lustre or NFS
mount): the holder record is written to a temporary file and hard-linked to the lock name,
which fails if the name exists. A stale lock is renamed away (only one taker's rename of that
file succeeds), checked to be the record that was judged stale, and the link retried.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from coci_hpc.errors import CheckpointLocked
from coci_hpc.slurm.env import JobEnvironment

LOCK_FILE = ".coci-writer.lock"
__all__ = ["LOCK_FILE", "CheckpointLocked", "DirectoryLock", "Holder", "is_stale"]


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    pid_start: str | None
    job_id: str | None
    since: float
    token: str
    restart_count: int | None = None  # SLURM_RESTART_COUNT of the holder's attempt
    step_id: str | None = None        # its SLURM_STEP_ID

    def describe(self) -> str:
        who = f"Slurm job {self.job_id} " if self.job_id else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{who}(pid {self.pid} on {self.host}, since {when})"


def process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def pid_alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` still runs on this host and is the same process (same start time)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = process_start(pid)
    return start is None or now is None or now == start


def me(job: JobEnvironment | None = None) -> Holder:
    job = job if job is not None else JobEnvironment.from_env()
    pid = os.getpid()
    return Holder(socket.gethostname(), pid, process_start(pid), job.job_id, time.time(), uuid.uuid4().hex,
                  job.restart_count if job.job_id is not None else None, job.step_id)


def is_stale(holder: Holder, mine: Holder, alive: Callable[[int, str | None], bool],
             job_active: Callable[[str], bool | None],
             step_active: Callable[[str, str], bool | None] = lambda job, step: None) -> bool:
    """Whether the lock of ``holder`` may be taken over by ``mine`` (see the module doc)."""
    if holder.host == mine.host:
        return not alive(holder.pid, holder.pid_start)
    if holder.job_id is None:
        return False
    if holder.job_id == mine.job_id:
        if holder.restart_count is not None and mine.restart_count is not None \
                and holder.restart_count < mine.restart_count:
            return True
        return holder.step_id is not None and step_active(holder.job_id, holder.step_id) is False
    return job_active(holder.job_id) is False


def same_process(holder: Holder, mine: Holder) -> bool:
    return holder.host == mine.host and holder.pid == mine.pid and holder.pid_start == mine.pid_start


def _slurm_job_active(job_id: str) -> bool | None:
    from coci_hpc.slurm.commands import job_active

    try:
        return job_active(job_id)
    except Exception:  # noqa: BLE001 - no Slurm here: unknown, so the lock counts as live
        return None


def _slurm_step_active(job_id: str, step_id: str) -> bool | None:
    from coci_hpc.slurm.commands import step_active

    try:
        return step_active(job_id, step_id)
    except Exception:  # noqa: BLE001 - no Slurm here: unknown, so the lock counts as live
        return None


def _read(path: Path) -> Holder | None:
    try:
        raw = json.loads(path.read_text())
        restarts = raw.get("restart_count")
        return Holder(str(raw["host"]), int(raw["pid"]), raw.get("pid_start"), raw.get("job_id"),
                      float(raw["since"]), str(raw["token"]),
                      None if restarts is None else int(restarts), raw.get("step_id"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # A torn or foreign file: nobody can be named as holder, so it cannot be live.
        return Holder("?", -1, None, None, 0.0, "unreadable")


class DirectoryLock:
    """The lock as held by this process (re-entrant: several managers of one process share it)."""

    _held: dict[Path, tuple[Holder, int]] = {}

    def __init__(self, root: Path, holder: Holder) -> None:
        self.root, self.holder = root, holder
        self.released = False

    @property
    def path(self) -> Path:
        return self.root / LOCK_FILE

    @classmethod
    def acquire(cls, root: str | os.PathLike, *, job: JobEnvironment | None = None,
                alive: Callable[[int, str | None], bool] = pid_alive,
                job_active: Callable[[str], bool | None] = _slurm_job_active,
                step_active: Callable[[str, str], bool | None] = _slurm_step_active) -> DirectoryLock:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        key = root.resolve()
        if key in cls._held:
            holder, count = cls._held[key]
            if _read(root / LOCK_FILE) == holder:
                cls._held[key] = (holder, count + 1)
                return cls(root, holder)
            del cls._held[key]  # taken over or removed by hand meanwhile: acquire afresh
        mine = me(job)
        path = root / LOCK_FILE
        tmp = root / f".coci-writer.lock.{mine.token}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, json.dumps(asdict(mine)).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            for _ in range(5):
                try:
                    os.link(tmp, path)
                    cls._held[key] = (mine, 1)
                    return cls(root, mine)
                except FileExistsError:
                    pass
                found = _read(path)
                if found is None:
                    continue  # released meanwhile: try again
                if not is_stale(found, mine, alive, job_active, step_active) and not same_process(found, mine):
                    raise CheckpointLocked(
                        f"checkpoint directory {root} is in use by another writer: "
                        f"{found.describe()}",
                        hint=f"point this run at another directory, wait for that run to end, or, "
                             f"if it is certainly gone, delete {path}")
                grave = root / f".coci-writer.lock.stale-{mine.token}"
                try:
                    os.rename(path, grave)
                except FileNotFoundError:
                    continue
                if _read(grave) != found:
                    # Another taker was quicker and this is ITS fresh lock: give it back.
                    try:
                        os.link(grave, path)
                    except FileExistsError:
                        pass
                    os.unlink(grave)
                    continue
                os.unlink(grave)
            raise CheckpointLocked(f"could not take the writer lock {path} (it keeps changing hands)",
                                   hint="another process is taking it at the same time; run one writer")
        finally:
            os.unlink(tmp)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        key = self.root.resolve()
        holder, count = self._held.get(key, (None, 0))
        if holder != self.holder:
            return
        if count > 1:
            self._held[key] = (holder, count - 1)
            return
        del self._held[key]
        if _read(self.path) == self.holder:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def still_held(self) -> bool:
        """Whether the lock file still names us (someone may have deleted or taken it over)."""
        return not self.released and _read(self.path) == self.holder
