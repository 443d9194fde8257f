"""Launching a training job under mpiexec and killing it the way a node failure does.

Open MPI gives each rank its own process group, so killing mpiexec's group does not reach the
ranks: :func:`job_pids` walks /proc for every descendant of the launcher, and the kill is by pid.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import ROOT, clean_env

TRAIN = str(ROOT / "examples" / "train_resumable.py")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def job_pids(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants (the launcher and every rank)."""
    kids, out, todo = _children(), [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
            return int(kv.split(b"=", 1)[1])
    return None


@dataclass
class Job:
    """A running ``train_resumable.py`` job; its stdout lines arrive on ``lines`` as they come."""

    proc: subprocess.Popen
    lines: queue.Queue = field(default_factory=queue.Queue)
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def wait_line(self, prefix: str, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.05)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    return None
                continue
            if line.startswith(prefix):
                return line
        return None

    def kill(self, *, only_rank: int | None = None) -> None:
        """SIGKILL every process of the job (ranks first), or one rank and then what is left."""
        pids = job_pids(self.proc.pid)
        ranks = [p for p in pids if rank_of(p) is not None]
        victims = [p for p in ranks if only_rank is None or rank_of(p) == only_rank]
        for pid in victims + ([] if only_rank is not None else [self.proc.pid]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if only_rank is not None:  # the launcher should take the job down; give it a moment
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            for pid in job_pids(self.proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=60)
        for pid in ranks:  # no rank may survive the job
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists() or _zombie(pid):
                    break
                time.sleep(0.05)

    def finish(self, timeout: float) -> tuple[int, str, str]:
        """Wait for the job to end by itself; returns (exit status, stdout, stderr)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return self.proc.returncode, *self.output()

    def output(self) -> tuple[str, str]:
        for t in self.readers:
            t.join(timeout=10)
        return "".join(self.out), "".join(self.err)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def start(ranks: int, ckpt_dir: Path, *args: str) -> Job:
    cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(ranks),
           sys.executable, "-m", "mpi4py", TRAIN, "--ckpt-dir", str(ckpt_dir), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=clean_env(OMP_NUM_THREADS="1"))
    job = Job(proc)

    def pump_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            job.out.append(line)
            job.lines.put(line)

    def pump_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            job.err.append(line)

    job.readers = [threading.Thread(target=f, daemon=True) for f in (pump_out, pump_err)]
    for t in job.readers:
        t.start()
    return job
