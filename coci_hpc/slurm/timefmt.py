"""Slurm's duration formats, each named for where it appears. The one place that reads them.

Slurm writes and reads durations in two grammars that look alike but differ on a bare number:

* :func:`printed_s`, what Slurm *prints* (``squeue %L``, ``sacct`` Elapsed/Timelimit, ``scontrol``
  RunTime/TimeLimit/GraceTime): ``[D-]HH:MM:SS``, ``MM:SS``, a bare number of **seconds**, and the
  day forms ``D-HH`` and ``D-HH:MM`` (the fields after the day are hours first: ``1-12`` is 1 day
  12 hours, not 1 day 12 seconds); ``UNLIMITED``/``INVALID``/``NOT_SET`` mean no value.
* :func:`limit_min`, what ``sbatch --time`` *takes*: a bare number is **minutes** (``MM``),
  ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``; ``INFINITE``/``UNLIMITED`` mean no
  limit; seconds round up to a minute, as slurmctld does.

Durations that people type (``coci-submit --time``, ``coci-plan --horizon`` and
``--time-since-failure``) have ONE grammar, :func:`read_duration`: Slurm's own ``--time`` forms
(``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``) plus units (``2h``, ``90m``,
``1d12h``, ``1h30m``, ``45s``, ``1.5h``). A bare number is minutes, as ``sbatch --time`` reads it;
a tool where that would change what an old command meant (``coci-plan --horizon 3600`` was seconds)
refuses the bare number and asks for a unit. Every error says how the value was read, since ``1:30``
(1 min 30 s) and ``1:30:00`` look alike.

Timestamps are here too: :func:`parse_time` reads what Slurm prints for a point in time (sacct
Start/End, scontrol's times: local ISO ``2026-11-22T04:19:11``), :func:`parse_since` what people
type for a window bound (``coci-plan --since``).
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from datetime import datetime

from coci_hpc.errors import UsageError

LIMIT_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
_NO_VALUE = ("UNLIMITED", "INVALID", "NOT_SET", "INFINITE")
_DAY = re.compile(r"(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?")


def printed_s(text: str) -> float | None:
    """A duration as Slurm prints it -> seconds; None for UNLIMITED and the like (or empty).

    Raises ValueError on anything else.
    """
    t = text.strip()
    if not t or t.upper() in _NO_VALUE:
        return None
    m = _DAY.fullmatch(t)
    if m:
        days, hours, mins, secs = (int(g) if g is not None else 0 for g in m.groups())
        return float(((days * 24 + hours) * 60 + mins) * 60 + secs)
    parts = t.split(":")
    if len(parts) > 3:
        raise ValueError(f"not a Slurm duration: {text!r}")
    nums = [float(p) for p in parts]   # [[HH:]MM:]SS
    while len(nums) < 3:
        nums.insert(0, 0.0)
    h, mi, s = nums
    return h * 3600 + mi * 60 + s


DURATION_FORMATS = ("a unit (2h, 90m, 1d12h, 1h30m, 45s) or Slurm's MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                    "D-HH:MM:SS")
LIMIT_FORMATS = DURATION_FORMATS
_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_UNIT_FORM = re.compile(r"(?:\d+(?:\.\d+)?[dhms])+")
_UNIT_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")


def human(seconds: float) -> str:
    """``5400`` -> ``1 h 30 min``: how a duration was understood, in words."""
    left = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size} {unit}")
            left %= size
    return " ".join(parts) or "0 s"


@dataclass(frozen=True)
class Duration:
    """A typed duration and how it was read (``form``); ``seconds`` None means no limit."""

    text: str
    seconds: float | None
    form: str

    def reading(self) -> str:
        """``'1:30' read as MM:SS = 1 min 30 s``: for messages about the value."""
        if self.seconds is None:
            return f"{self.text.strip()!r} read as no limit"
        return f"{self.text.strip()!r} read as {self.form} = {human(self.seconds)}"


def read_duration(text: str, *, flag: str, bare: str | None = "minutes", unlimited: bool = False) -> Duration:
    """A duration typed on the command line, in the one grammar of every coci tool.

    ``bare``: what a bare number means for this flag ("minutes", as ``sbatch --time``), or None to
    refuse it. ``unlimited``: whether ``INFINITE``/``UNLIMITED`` (no limit) are allowed.
    A UsageError names the flag, the value and the formats.
    """
    t = str(text).strip()
    bad = UsageError(f"{flag} {text!r} is not a duration",
                     hint=f"write {DURATION_FORMATS} (e.g. {flag} 2h or {flag} 2:00:00)")
    if unlimited and t.upper() in ("INFINITE", "UNLIMITED"):
        return Duration(t, None, "no limit")
    if _UNIT_FORM.fullmatch(t):
        parts = _UNIT_PART.findall(t)
        units = [u for _, u in parts]
        if len(set(units)) != len(units) or units != sorted(units, key="dhms".index):
            raise bad                   # 30m2h, 1h1h: a slip, not a duration
        return Duration(t, sum(float(v) * _UNIT_S[u] for v, u in parts), "units")
    m = _DAY.fullmatch(t)
    if m:
        days, hours, mins, secs = (int(g) if g is not None else 0 for g in m.groups())
        if hours > 23 or mins > 59 or secs > 59:
            raise bad
        form = ("D-HH", "D-HH:MM", "D-HH:MM:SS")[sum(g is not None for g in m.groups()[2:])]
        return Duration(t, float(((days * 24 + hours) * 60 + mins) * 60 + secs), form)
    parts_s = t.split(":")
    if not t or not all(p.isdigit() for p in parts_s) or len(parts_s) > 3:
        raise bad
    nums = [int(p) for p in parts_s]
    if len(nums) == 1:
        if bare is None:
            raise UsageError(f"{flag} {text!r} has no unit",
                             hint=f"write the unit: {t}s, {t}m or {t}h (a bare number is minutes in "
                                  f"sbatch --time and was seconds in {flag}, so coci asks)")
        return Duration(t, nums[0] * 60.0, "MM (minutes, as sbatch reads a bare number)")
    if len(nums) == 2:
        mins, secs = nums
        if secs > 59:
            raise bad
        return Duration(t, mins * 60.0 + secs, "MM:SS")
    hours, mins, secs = nums
    if mins > 59 or secs > 59:
        raise bad
    return Duration(t, hours * 3600.0 + mins * 60.0 + secs, "HH:MM:SS")


def read_limit(text: str, flag: str = "--time") -> Duration:
    """A job time limit (``coci-submit --time``): :func:`read_duration`, bare number = minutes,
    INFINITE/UNLIMITED allowed, zero refused."""
    d = read_duration(text, flag=flag, bare="minutes", unlimited=True)
    if d.seconds is not None and d.seconds <= 0:
        raise UsageError(f"{flag} {text!r} is zero ({d.reading()})", hint=f"give a positive limit: {DURATION_FORMATS}")
    return d


def limit_min(text: str, flag: str = "--time") -> int | None:
    """A job time limit -> whole minutes for ``sbatch --time`` (None = no limit); seconds round
    up to a minute, as slurmctld does."""
    d = read_limit(text, flag)
    return None if d.seconds is None else math.ceil(d.seconds / 60)


_UNKNOWN_TIMES = {"", "unknown", "none", "n/a"}


def parse_time(text: str) -> float | None:
    """Slurm's ISO local time ``2026-11-22T04:19:11`` -> epoch seconds; Unknown/None -> None."""
    t = text.strip()
    if t.lower() in _UNKNOWN_TIMES:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d"):
        try:
            return time.mktime(datetime.strptime(t, fmt).timetuple())
        except ValueError:
            continue
    raise ValueError(f"unrecognised time {text!r}")


def parse_since(text: str, flag: str = "--since") -> float:
    """A window bound: ``YYYY-MM-DD`` or ``YYYY-MM-DDTHH:MM[:SS]`` (local time) -> epoch seconds."""
    try:
        t = parse_time(text)
    except ValueError:
        t = None
    if t is None:
        raise UsageError(f"{flag} {text!r} is not a time",
                         hint="use YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS (local time)")
    return t
