"""The run's append-only event log, ``<ckpt_dir>/events.jsonl``: one JSON object per line.

Written by rank 0 only. Each record is one ``os.write`` on an ``O_APPEND`` descriptor followed by
``fsync``, so a record is either whole on disk or, if the process died inside the write, a torn
last line. The writer starts a fresh line when it finds the file not ending in a newline, and
:func:`read_events` skips lines that do not parse, so one torn record never hides the others.

Every record has ``v`` (format version, 1), ``event``, ``wall`` (unix seconds), ``attempt``
(1-based, counted in this log) and ``job_id`` (Slurm's, or null). The events and their fields are
listed in docs/reference/event-log.md (attempt_start, resumed, checkpoint, losses, stop, end, peer_lost).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

VERSION = 1
FILENAME = "events.jsonl"
EVENTS = ("attempt_start", "resumed", "checkpoint", "losses", "stop", "end", "lead_warning", "peer_lost",
          "relaunch")  # relaunch: written by coci-submit's relaunch loop (submit/relaunch.py), not the Session
PREV_END_REASONS = ("time_limit", "preemption", "node_failure", "rank_failure", "requeue_by_hand", "cancelled",
                    "terminated", "crash", "none")


def _clean(x: Any) -> Any:
    """JSON has no NaN/inf: they become null, so every line stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


class EventLog:
    """Appends records for one attempt. ``enabled=False`` (ranks other than 0) makes it a no-op."""

    def __init__(self, path: str | os.PathLike, *, attempt: int, job_id: str | None,
                 enabled: bool = True) -> None:
        self.path = Path(path)
        self.attempt, self.job_id, self.enabled = int(attempt), job_id, enabled
        self._checked_tail = False

    def write(self, event: str, **fields: Any) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        if event not in EVENTS:
            raise ValueError(f"unknown event {event!r}")
        rec = {"v": VERSION, "event": event, "wall": time.time(), "attempt": self.attempt,
               "job_id": self.job_id, **fields}
        line = json.dumps(_clean(rec), separators=(",", ":"), allow_nan=False) + "\n"
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if not self._checked_tail:
                self._checked_tail = True
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    line = "\n" + line  # the previous writer died mid-record: start a fresh line
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return rec


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All whole records, in order; a torn or foreign line is skipped. A missing file is empty."""
    return read_events_counted(path)[0]


def read_events_counted(path: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """:func:`read_events` and how many non-empty lines it skipped (torn, foreign, or a record
    without a valid attempt number), so a reader can say that some were."""
    p = Path(path)
    if p.is_dir():
        p = p / FILENAME
    try:
        text = p.read_text(errors="replace")
    except FileNotFoundError:
        return [], 0
    out, skipped = [], 0
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(rec, dict) and rec.get("v") == VERSION and "event" in rec and _attempt_ok(rec.get("attempt")):
            out.append(rec)
        else:
            skipped += 1
    return out, skipped


def _attempt_ok(a: Any) -> bool:
    # Every writer numbers attempts from 1; a record without one (a damaged line that still
    # parses) would otherwise become a bogus "attempt 0".
    return isinstance(a, int) and not isinstance(a, bool) and a >= 1


def last_attempt(events: list[dict[str, Any]]) -> int:
    return max((int(e.get("attempt") or 0) for e in events), default=0)
