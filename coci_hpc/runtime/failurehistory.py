"""The failure model the planner starts an attempt with, and the fresher one read meanwhile: the
partition's history from Slurm's accounting, cached per partition and window and refreshed in the
background (:mod:`coci_hpc.slurm.failure_cache`); nothing is asked outside a job, and only rank 0
plans."""
from __future__ import annotations

import sys
from collections.abc import Mapping

from coci_hpc.planner.failures import FailureModel, from_mtbf
from coci_hpc.runtime.schedule import Schedule
from coci_hpc.slurm import commands
from coci_hpc.slurm.env import JobEnvironment
from coci_hpc.slurm.failure_cache import Pending, failure_model_for_job
from coci_hpc.slurm.failure_cache import describe as describe_history

DEFAULT_MTBF_H = 70.0       # per-node MTBF when the partition's history cannot be read
HISTORY_DAYS = 90


def _say(msg: str) -> None:
    print(f"coci: {msg}", file=sys.stderr, flush=True)


class PartitionHistory:
    """``model()`` at the start of an attempt, ``poll()`` at each step boundary."""

    def __init__(self, job: JobEnvironment, runner: commands.Runner, environ: Mapping[str, str] | None,
                 rank: int) -> None:
        self.job, self._runner, self._environ, self.rank = job, runner, environ, rank
        self.pending: Pending | None = None      # the background read, while in flight

    def model(self) -> FailureModel:
        """Rank 0: the partition's failure model (the default elsewhere and when it cannot be read)."""
        default = from_mtbf(DEFAULT_MTBF_H * 3600)
        if self.rank != 0:
            return default                    # only rank 0 plans
        model, line, self.pending = failure_model_for_job(self.job, default, window_days=HISTORY_DAYS,
                                                          runner=self._runner, environ=self._environ)
        _say(line + ("" if model is not default else f" (per-node MTBF {DEFAULT_MTBF_H:g} h)"))
        return model

    def poll(self, schedule: Schedule) -> None:
        """Rank 0, at a step boundary: when the background read of the history finished, use it."""
        if self.pending is None or not self.pending.done():
            return
        pending, self.pending = self.pending, None
        got = pending.result()
        if got is None:
            _say(f"failure history of partition {self.job.partition} unavailable "
                 f"({pending.error}); keeping the model the attempt started with")
            return
        model, summary = got
        if hasattr(schedule, "use_failure_model"):
            schedule.use_failure_model(model)
        _say(describe_history(self.job.partition or "", summary) + "; the plan now uses it")
