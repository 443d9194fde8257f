"""Test helpers for the steps-lost ledger: kill a run's ranks at a random moment inside a step, and
read from a run's own output which steps it finished (the truth the event log is checked against).

examples/train.py prints ``step=<n>`` at the end of step n's body, a few microseconds before the
Session's boundary records step n as finished (runtime/progress.py). A SIGKILL inside those
microseconds ends a step whose work is done but whose boundary never came: the record says n-1,
the output n. :func:`kill_inside_a_step` never lands there: it stops the processes (SIGSTOP) at a
random moment and kills them only when every one is inside ``clock_nanosleep`` (the step's
``--step-time`` work, or the session's own waits and an injected save pause, all past the last
boundary); otherwise it lets them go on and tries again a little later.
"""
from __future__ import annotations

import os
import platform
import random
import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path

# clock_nanosleep: what time.sleep is blocked in (/proc/PID/syscall's first field).
SLEEP_SYSCALL = {"x86_64": "230", "aarch64": "115"}.get(platform.machine(), "230")
STEP_RE = re.compile(r"^step=(\d+) ", re.M)


def steps_printed(out: str) -> list[int]:
    return [int(s) for s in STEP_RE.findall(out)]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_inside_a_step(pids: Sequence[int], rng: random.Random, timeout: float = 60.0) -> int:
    """SIGKILL every one of ``pids`` (rank processes) together, at a random moment when each is
    blocked in ``clock_nanosleep``; returns the tries it took. Fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    tries = 0
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.0, 0.06))
        tries += 1
        _signal(pids, signal.SIGSTOP)
        stop_by = time.monotonic() + 5.0
        while any(_state(p) not in ("T", "t", "Z", "gone") for p in pids) and time.monotonic() < stop_by:
            time.sleep(0.001)
        try:
            calls = [Path(f"/proc/{p}/syscall").read_text().split()[0] for p in pids]
        except OSError:
            calls = []
        if calls and all(c == SLEEP_SYSCALL for c in calls):
            _signal(pids, signal.SIGKILL)
            _signal(pids, signal.SIGCONT)     # a stopped process dies at once anyway; never leave one stopped
            return tries
        _signal(pids, signal.SIGCONT)
    _signal(pids, signal.SIGKILL)
    raise AssertionError(f"no moment with every rank inside a step in {timeout:g}s ({tries} tries)")
