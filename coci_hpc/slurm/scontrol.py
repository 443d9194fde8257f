"""``scontrol show job|partition|config``: the command lines and pure parsers of their output.

Slurm's own record of a job is what tells a preemption from a cancellation when all the job got is
SIGTERM (sites without ``preempt_send_user_signal``): during the grace time of a preemption
``scontrol show job`` reports ``PreemptTime=<when>`` (``JobState=SIGNALING``, ``EndTime`` = that
time + the partition's GraceTime); after ``scancel`` it reports ``JobState=COMPLETING`` and
``PreemptTime=None``; after ``scontrol requeue`` ``Restarts`` is already one higher than the
attempt's ``SLURM_RESTART_COUNT``. Recorded output of each: tests/fixtures/slurm/scontrol_*.txt
(capture_scontrol.sh re-creates them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from coci_hpc.slurm.commands import Runner, run_command
from coci_hpc.slurm.timefmt import parse_time, printed_s

DEFAULT_KILL_WAIT_S = 30.0     # Slurm's default KillWait, when the config cannot be read

_PAIR = re.compile(r"(\S+?)=(\S*)")


def show_job_argv(job_id: str) -> list[str]:
    return ["scontrol", "show", "job", job_id]


def show_partition_argv(partition: str) -> list[str]:
    return ["scontrol", "show", "partition", partition]


def show_config_argv() -> list[str]:
    return ["scontrol", "show", "config"]


def parse_pairs(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol show job|partition`` record (the first value wins)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        for k, v in _PAIR.findall(line):
            out.setdefault(k, v)
    return out


@dataclass(frozen=True)
class JobState:
    """What ``scontrol show job`` says about the job at the moment it is asked."""

    state: str                  # RUNNING, SIGNALING, COMPLETING, ...
    reason: str
    restarts: int
    preempt_time: float | None  # unix seconds; None when the job is not being preempted
    end_time: float | None      # the time limit, or the end of the grace time of a preemption
    partition: str | None

    @property
    def preempted(self) -> bool:
        return self.preempt_time is not None


def _time(text: str | None) -> float | None:
    if text is None or text in ("None", "Unknown", "(null)", ""):
        return None
    try:
        return parse_time(text)
    except ValueError:
        return None


def parse_job(text: str) -> JobState:
    """One ``scontrol show job`` record; a missing PreemptTime (after a requeue) reads as None."""
    kv = parse_pairs(text)
    if "JobState" not in kv:
        raise ValueError(f"not an `scontrol show job` record: {text[:200]!r}")
    try:
        restarts = int(kv.get("Restarts", "0"))
    except ValueError:
        restarts = 0
    return JobState(state=kv["JobState"], reason=kv.get("Reason", ""), restarts=restarts,
                    preempt_time=_time(kv.get("PreemptTime")), end_time=_time(kv.get("EndTime")),
                    partition=kv.get("Partition") or None)


def parse_grace_time(text: str) -> float:
    """``GraceTime`` of an ``scontrol show partition`` record, in seconds (Slurm prints seconds)."""
    kv = parse_pairs(text)
    raw = kv.get("GraceTime")
    if raw is None:
        raise ValueError(f"no GraceTime in `scontrol show partition` output: {text[:200]!r}")
    if raw.isdigit():
        return float(raw)
    secs = printed_s(raw)
    return 0.0 if secs is None else secs


def parse_kill_wait(text: str) -> float:
    """``KillWait = 30 sec`` of ``scontrol show config``, in seconds."""
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "KillWait":
            m = re.match(r"\s*(\d+)", value)
            if m:
                return float(m.group(1))
    raise ValueError("no KillWait in `scontrol show config` output")


def show_job(job_id: str, runner: Runner = run_command) -> JobState:
    return parse_job(runner(show_job_argv(job_id)))


def grace_time_s(partition: str, runner: Runner = run_command) -> float:
    return parse_grace_time(runner(show_partition_argv(partition)))


def kill_wait_s(runner: Runner = run_command) -> float:
    return parse_kill_wait(runner(show_config_argv()))
