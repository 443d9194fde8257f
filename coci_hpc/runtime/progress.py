"""Each rank's progress record: the last step it finished, so the next attempt knows it after any end.

The event log lags a crash: rank 0 flushes its losses at most every 5 s (with checkpoints and
stops), so a run SIGKILLed 13 steps past its checkpoint reported 2 steps to repeat. The record
does not lag: at every step boundary each rank overwrites one fixed-size record in its own file,
``<ckpt_dir>/.progress/rank-<r>``, with ``os.pwrite`` (no fsync, no allocation: the same 32 bytes
of an existing file's first page). What the write leaves in the page cache is the file, for any
reader, as soon as ``pwrite`` returns, and it survives the end of the process however it ends
(SIGKILL, the OOM killer, ``scancel``, a crash in C code): the kernel writes it back later. The
next attempt's ranks read their own file before writing theirs, rank 0 gathers them and takes
the newest step of the previous attempt (:meth:`ProgressRecord.last_finished`): the steps to
repeat are that step minus the checkpoint resumed from, and the restart latency runs from when
that step finished.

A power loss (or a kernel panic, a node lost with its page cache) loses what was not written
back yet: Linux writes dirty pages back after ``dirty_expire_centisecs`` (30 s by default), so
the record on disk may be up to about 30 s old, or, if none of this attempt's records reached
the disk, from an earlier attempt (its attempt number says so and it is not used). The count
is the newer of the records and the event log, fsync'd with every losses record (at most every
5 s + one step): after a power loss of every node it may be short by at most the steps of those
seconds, and the ``attempt_start`` record says so (``steps_lost_exact: false``) where no record
of the attempt, or only one older than the log, survived.

Each file holds two 32-byte slots written alternately (step parity), each with a CRC32, so a
write torn by a power loss leaves the other slot, one step older, readable. A record that
cannot be opened or written (a read-only directory, an I/O error) turns the record off with one
warning: training never stops for it, steps lost falls back to the event log.
"""
from __future__ import annotations

import os
import re
import struct
import sys
import time
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIRNAME = ".progress"
MAGIC = b"CPRG"
VERSION = 1
_FMT = struct.Struct("<4sHHIqd")        # magic, version, reserved, attempt, step, wall
SLOT = _FMT.size + 4                     # + CRC32 of the fields: 32 bytes
_NAME_RE = re.compile(r"^rank-(\d+)$")


@dataclass(frozen=True, order=True)
class Mark:
    """One rank's newest record: ``step`` finished (or resumed from, at an attempt's start) in
    ``attempt`` at ``wall`` (unix seconds)."""

    attempt: int
    step: int
    wall: float


def encode(attempt: int, step: int, wall: float) -> bytes:
    body = _FMT.pack(MAGIC, VERSION, 0, attempt, step, wall)
    return body + struct.pack("<I", zlib.crc32(body))


def decode(data: bytes) -> Mark | None:
    """The newest whole record of a file's bytes (two slots); None when neither is whole."""
    best = None
    for off in (0, SLOT):
        raw = data[off:off + SLOT]
        if len(raw) < SLOT or struct.unpack("<I", raw[-4:])[0] != zlib.crc32(raw[:-4]):
            continue
        magic, version, _, attempt, step, wall = _FMT.unpack(raw[:-4])
        if magic != MAGIC or version != VERSION:
            continue
        m = Mark(attempt, step, wall)
        best = m if best is None or m > best else best
    return best


def rank_path(root: Path, rank: int) -> Path:
    return Path(root) / DIRNAME / f"rank-{rank:05d}"


def read_mark(path: Path) -> Mark | None:
    try:
        with open(path, "rb") as f:
            return decode(f.read(2 * SLOT))
    except OSError:
        return None


def _say(msg: str) -> None:
    print(f"coci: {msg}", file=sys.stderr, flush=True)


class ProgressRecord:
    """This rank's record file. Created at ``Session()`` on every rank (collective: the ranks'
    previous records are gathered on rank 0), started by :meth:`begin` with the attempt's number,
    written by :meth:`mark` at each step boundary."""

    def __init__(self, root: Path, comm: Any) -> None:
        self.path = rank_path(root, comm.rank)
        self._fd: int | None = None
        self._attempt = 0
        own = None
        try:
            self.path.parent.mkdir(exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            weakref.finalize(self, os.close, self._fd)
            own = decode(os.pread(self._fd, 2 * SLOT, 0))
        except OSError as exc:
            self._off(exc)
        gathered = comm.gather(None if own is None else (own.attempt, own.step, own.wall))
        # rank 0: every rank's newest record, and those of ranks this attempt no longer has (fewer nodes)
        self.previous: list[Mark] = [Mark(*m) for m in gathered or [] if m is not None]
        if comm.rank == 0:
            self.previous += _stale(Path(root) / DIRNAME, comm.size)

    def _off(self, exc: OSError) -> None:
        if self._fd is not None:
            self._fd = None          # the finalizer closes it
        _say(f"progress record off ({self.path}: {exc}); steps lost after a crash will be a lower bound")

    def begin(self, attempt: int, step: int) -> None:
        """This attempt starts from ``step`` (the restored one): recorded at once, so a crash before
        the first boundary repeats nothing of this attempt's."""
        self._attempt = attempt
        self.mark(step)

    def mark(self, step: int) -> None:
        """``step`` steps are done on this rank: one pwrite into the slot of the step's parity."""
        fd = self._fd
        if fd is None:
            return
        try:
            os.pwrite(fd, encode(self._attempt, step, time.time()), (step & 1) * SLOT)
        except OSError as exc:       # never stops training: the count falls back to the event log
            self._off(exc)

    def last_finished(self, attempt: int) -> Mark | None:
        """Rank 0: the newest step any rank finished in ``attempt`` (its latest wall), or None when
        no rank's record of that attempt survived."""
        ours = [m for m in self.previous if m.attempt == attempt]
        if not ours:
            return None
        return Mark(attempt, max(m.step for m in ours), max(m.wall for m in ours))


def _stale(directory: Path, size: int) -> list[Mark]:
    """Records of ranks at or past ``size`` (an earlier attempt ran on more ranks)."""
    out: list[Mark] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) >= size:
            mark = read_mark(directory / name)
            if mark is not None:
                out.append(mark)
    return out
