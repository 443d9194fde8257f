"""When this process was started (exec'd), as a wall-clock time: the restart latency's split needs
the moment the launcher (srun) had the training process running, before the interpreter, the
imports and torch/MPI set-up, which a timestamp taken by Python code can only see after them."""
from __future__ import annotations

import os
import time

# Clock ticks per second of /proc/<pid>/stat's start time.
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_start_wall(pid: int | str = "self") -> float | None:
    """Wall time at which process ``pid`` started (10 ms resolution); None off Linux.

    /proc/<pid>/stat field 22 is the start in clock ticks since boot; CLOCK_BOOTTIME is the same
    clock, so the age is exact (unlike /proc/stat's btime, which is rounded to a second)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
        fields = stat[stat.rindex(b")") + 2:].split()
        started = int(fields[19]) / _TICKS
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None
