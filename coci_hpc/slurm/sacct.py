"""``sacct`` for one job's attempts: the command line and what its rows mean.

(The partition-wide history query for the failure model lives with its parsing in
:mod:`coci_hpc.slurm.accounting`.)
"""
from __future__ import annotations

from dataclasses import dataclass

from coci_hpc.slurm.commands import Runner, run_command
from coci_hpc.slurm.timefmt import parse_time

SACCT_FIELDS = ("JobID", "State", "Start", "End", "NodeList")


@dataclass(frozen=True)
class SlurmAttempt:
    state: str
    start: float | None
    end: float | None
    nodes: str


def job_attempts_argv(job_id: str) -> list[str]:
    return ["sacct", "-X", "-D", "-P", "-n", "-j", job_id, "--format=" + ",".join(SACCT_FIELDS)]


def parse_job_attempts(text: str, job_id: str) -> list[SlurmAttempt]:
    """``sacct -X -D -P -n`` rows of one job, oldest attempt first (array tasks: ``A_T`` ids)."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < len(SACCT_FIELDS) or parts[0] != job_id:
            continue
        state = parts[1].split()[0] if parts[1] else ""   # "CANCELLED by 0" -> CANCELLED
        try:
            start, end = parse_time(parts[2]), parse_time(parts[3])
        except ValueError:
            start, end = None, None
        rows.append(SlurmAttempt(state, start, end, parts[4]))
    rows.sort(key=lambda r: (r.start is None, r.start or 0.0))
    return rows


def job_attempts(job_id: str, runner: Runner = run_command) -> list[SlurmAttempt]:
    """Every attempt Slurm records of ``job_id`` (a requeued job has one row per attempt)."""
    return parse_job_attempts(runner(job_attempts_argv(job_id)), job_id)
