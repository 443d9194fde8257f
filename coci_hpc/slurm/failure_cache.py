"""The partition's failure model for a job, cheaply: cached, refreshed off the restart's path.

Reading the failure history is a 90-day ``sacct -a`` over the partition plus ``sacctmgr`` and
``sinfo``: seconds to minutes on a busy cluster. Done by every attempt of every array task,
synchronously while the other ranks wait, it lengthens every restart. Here:

- no job or no partition (a local run): nothing is asked; the caller plans with its default;
- one JSON file per (partition, window) under ``$COCI_CACHE_DIR`` or ``$XDG_CACHE_HOME/coci_hpc``
  (``~/.cache/coci_hpc``), shared by a job's attempts, the tasks of an array and later jobs,
  refreshed at most once a day (:data:`MAX_AGE_S`);
- a missing or stale cache is refreshed by a background thread (rank 0); the attempt starts at
  once with the stale model or the caller's default, and the caller switches to the fresh model
  when the thread is done (:meth:`Pending.result`); a lock file keeps simultaneous array tasks
  from all asking at once;
- ``PrivateData=jobs`` (``scontrol show config``): an unprivileged user's ``sacct -a`` lists only
  their own jobs, so job-based evidence is partial; the summary says so (``partial``).
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from coci_hpc import settings
from coci_hpc.durable import write_atomic
from coci_hpc.errors import CociError
from coci_hpc.planner.failures import FailureModel
from coci_hpc.slurm import scontrol
from coci_hpc.slurm.accounting import failure_model_from_cluster
from coci_hpc.slurm.commands import Runner, run_command
from coci_hpc.slurm.env import JobEnvironment

MAX_AGE_S = 86400.0            # refreshed at most daily
REFRESH_LOCK_S = 600.0         # another process's refresh younger than this is waited for, not repeated
VERSION = 1


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    own = settings.CACHE_DIR.raw(env)
    if own:
        return Path(own)
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "coci_hpc"


def cache_path(partition: str, window_days: float, environ: Mapping[str, str] | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", partition)
    return cache_dir(environ) / f"failure-model-{safe}-{window_days:g}d.json"


def private_jobs(config_text: str) -> bool:
    """``PrivateData`` of ``scontrol show config`` names ``jobs`` (or ``all``)."""
    for line in config_text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "PrivateData":
            return bool({"jobs", "all"} & {v.strip().lower() for v in value.split(",")})
    return False


def _model_to_dict(m: FailureModel) -> dict[str, Any]:
    d = asdict(m)
    d.pop("events", None)       # the raw records are not needed to plan
    return d


def _model_from_dict(d: Mapping[str, Any]) -> FailureModel:
    names = {f.name for f in fields(FailureModel)} - {"events"}
    return FailureModel(**{k: v for k, v in d.items() if k in names})


@dataclass
class Cached:
    model: FailureModel
    summary: dict[str, Any]
    age_s: float


def load(path: Path, now: float | None = None) -> Cached | None:
    """The cached model (any age) or None when there is none or it does not parse."""
    try:
        d = json.loads(path.read_text())
        if d.get("version") != VERSION:
            return None
        return Cached(_model_from_dict(d["model"]), dict(d.get("summary") or {}),
                      (time.time() if now is None else now) - float(d["written"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(path: Path, model: FailureModel, summary: Mapping[str, Any]) -> None:
    """Durably (:func:`coci_hpc.durable.write_atomic`): a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"version": VERSION, "written": time.time(), "model": _model_to_dict(model),
                                   "summary": summary}, default=str))


def read_cluster(partition: str, window_days: float, runner: Runner) -> tuple[FailureModel, dict[str, Any]]:
    """Ask the cluster (sacct, sacctmgr, sinfo, scontrol show config)."""
    model, summary = failure_model_from_cluster(partition, window_days=window_days, runner=runner)
    try:
        partial = private_jobs(runner(scontrol.show_config_argv()))
    except (CociError, OSError):
        partial = False
    summary["partial"] = partial
    if partial:
        summary["partial_reason"] = ("PrivateData=jobs: sacct lists only this user's jobs, so the job "
                                     "records (NODE_FAIL ends, job exposure) are partial")
    return model, summary


class Pending:
    """A refresh running in a background thread; :meth:`result` is None until it is done."""

    def __init__(self, target: Any) -> None:
        self._out: tuple[FailureModel, dict[str, Any]] | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(target,), name="coci-failure-history",
                                        daemon=True)
        self._thread.start()

    def _run(self, target: Any) -> None:
        try:
            self._out = target()
        except (CociError, OSError, ValueError) as exc:
            self.error = str(exc)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> tuple[FailureModel, dict[str, Any]] | None:
        return self._out if self.done() else None

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def failure_model_for_job(job: JobEnvironment, default: FailureModel, *, window_days: float,
                          runner: Runner | None = None, environ: Mapping[str, str] | None = None,
                          now: float | None = None) -> tuple[FailureModel, str, Pending | None]:
    """(the model to start with, a line saying where it came from, a refresh in flight or None)."""
    if not job.in_slurm_job or not job.partition:
        return default, "not in a Slurm job with a partition: no cluster history asked", None
    run = runner or run_command
    path = cache_path(job.partition, window_days, environ)
    cached = load(path, now)
    if cached is not None and cached.age_s < MAX_AGE_S:
        return cached.model, _describe(job.partition, cached.summary, f"cached {cached.age_s / 3600:.1f} h ago"), None
    lock = path.with_name(path.name + ".refreshing")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
    except FileExistsError:
        try:
            fresh_lock = time.time() - lock.stat().st_mtime < REFRESH_LOCK_S
        except OSError:
            fresh_lock = False
        if fresh_lock:   # another attempt or array task is asking right now
            start = cached.model if cached is not None else default
            return start, (f"failure history of partition {job.partition}: being read by another process; "
                           f"starting with the {'stale cached' if cached else 'default'} model"), None
        lock.touch()
    except OSError as exc:
        return (cached.model if cached else default,
                f"failure history cache {path} unusable ({exc.strerror}); not asked", None)

    def refresh() -> tuple[FailureModel, dict[str, Any]]:
        try:
            model, summary = read_cluster(job.partition or "", window_days, run)
            store(path, model, summary)
            return model, summary
        finally:
            try:
                lock.unlink()
            except OSError:
                pass
    start = cached.model if cached is not None else default
    return start, (f"failure history of partition {job.partition}: reading it in the background "
                   f"({'stale cache' if cached else 'no cache'} at {path}); starting with the "
                   f"{'stale cached' if cached else 'default'} model"), Pending(refresh)


def describe(partition: str, summary: Mapping[str, Any]) -> str:
    return _describe(partition, summary, "read now")


def _describe(partition: str, summary: Mapping[str, Any], when: str) -> str:
    text = (f"failure history of partition {partition} ({when}): {summary.get('records')} unannounced "
            f"end(s), {summary.get('incidents')} incident(s) after declustering")
    if summary.get("partial"):
        text += f"; PARTIAL: {summary.get('partial_reason')}"
    return text
