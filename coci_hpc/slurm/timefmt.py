"""Slurm's duration formats, each named for where it appears. The one place that reads them.

Slurm writes and reads durations in two grammars that look alike but differ on a bare number:

* :func:`printed_s`, what Slurm *prints* (``squeue %L``, ``sacct`` Elapsed/Timelimit, ``scontrol``
  RunTime/TimeLimit/GraceTime): ``[D-]HH:MM:SS``, ``MM:SS``, a bare number of **seconds**, and the
  day forms ``D-HH`` and ``D-HH:MM`` (the fields after the day are hours first: ``1-12`` is 1 day
  12 hours, not 1 day 12 seconds); ``UNLIMITED``/``INVALID``/``NOT_SET`` mean no value.
* :func:`limit_min`, what ``sbatch --time`` *takes*: a bare number is **minutes** (``MM``),
  ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``; ``INFINITE``/``UNLIMITED`` mean no
  limit; seconds round up to a minute, as slurmctld does.

And coci's own :func:`span_s` for durations on the command line (``coci-plan --horizon``): a number
of seconds with an optional unit (``3600``, ``90m``, ``24h``, ``2d``) or Slurm's printed form.
"""
from __future__ import annotations

import math
import re

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


def limit_min(text: str) -> int | None:
    """``sbatch --time`` -> whole minutes (None = no limit); a UsageError names the formats."""
    s = text.strip()
    if s.upper() in ("INFINITE", "UNLIMITED"):
        return None
    m = _DAY.fullmatch(s)
    if m:
        days, hours, mins, secs = (int(g) if g is not None else 0 for g in m.groups())
        if hours > 23 or mins > 59 or secs > 59:
            raise _bad_limit(text)
    else:
        parts = s.split(":")
        if not all(p.isdigit() for p in parts) or len(parts) > 3:
            raise _bad_limit(text)
        nums = [int(p) for p in parts]
        days = 0
        if len(nums) == 1:             # a bare number is minutes here, seconds in printed_s
            hours, mins, secs = 0, nums[0], 0
        elif len(nums) == 2:
            hours, (mins, secs) = 0, nums
            if secs > 59:
                raise _bad_limit(text)
        else:
            hours, mins, secs = nums
            if mins > 59 or secs > 59:
                raise _bad_limit(text)
    total_s = ((days * 24 + hours) * 60 + mins) * 60 + secs
    if total_s <= 0:
        raise UsageError(f"--time {text!r} is zero", hint=f"give a positive limit ({LIMIT_FORMATS})")
    return math.ceil(total_s / 60)


def _bad_limit(text: str) -> UsageError:
    return UsageError(f"--time {text!r} is not a Slurm time",
                      hint=f"use one of Slurm's formats: {LIMIT_FORMATS} (e.g. --time 2:00:00)")


_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def span_s(text: str) -> float:
    """A command-line duration: ``3600``, ``90m``, ``24h``, ``2d`` or Slurm's printed ``[D-]HH:MM:SS``
    -> seconds. Raises ValueError when it is none of them."""
    t = str(text).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([smhd]?)", t)
    v = float(m.group(1)) * _UNITS[m.group(2)] if m else printed_s(t)
    if v is None or not math.isfinite(v):
        raise ValueError(f"not a duration: {text!r}")
    return v
