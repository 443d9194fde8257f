"""Each rank's progress record (runtime/progress.py): the last step finished survives SIGKILL, a
torn slot leaves the other one, records of other attempts are not taken for this one's."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from coci_hpc.comm import Comm
from coci_hpc.runtime import progress
from coci_hpc.runtime.progress import SLOT, Mark, ProgressRecord, decode, encode, rank_path

ROOT = Path(__file__).resolve().parents[2]


def test_a_record_is_32_bytes_and_decodes_to_what_was_encoded() -> None:
    raw = encode(7, 123456789012, 1.5e9)
    assert len(raw) == SLOT == 32
    assert decode(raw + bytes(SLOT)) == Mark(7, 123456789012, 1.5e9)     # the other slot empty
    assert decode(b"") is None and decode(bytes(2 * SLOT)) is None


def test_the_newest_whole_slot_wins_and_a_torn_one_leaves_the_other() -> None:
    older, newer = encode(2, 40, 10.0), encode(2, 41, 11.0)
    assert decode(older + newer) == Mark(2, 41, 11.0) == decode(newer + older)
    torn = bytearray(newer)
    torn[12] ^= 0xFF                                   # a power loss inside the write: CRC fails
    assert decode(older + bytes(torn)) == Mark(2, 40, 10.0)
    assert decode(encode(3, 0, 12.0) + newer) == Mark(3, 0, 12.0)        # a newer attempt's start wins
    other = bytearray(newer)
    other[4] = 9                                       # another version of the format: not read
    other[-4:] = zlib.crc32(bytes(other[:-4])).to_bytes(4, "little")
    assert decode(older + bytes(other)) == Mark(2, 40, 10.0)


def test_begin_and_marks_are_read_back_by_the_next_attempt(tmp_path: Path) -> None:
    rec = ProgressRecord(tmp_path, Comm.serial())
    assert rec.previous == [] and rec.last_finished(1) is None
    rec.begin(1, 50)
    for step in range(51, 64):
        rec.mark(step)
    assert (tmp_path / ".progress" / "rank-00000").stat().st_size == 2 * SLOT   # overwritten in place
    nxt = ProgressRecord(tmp_path, Comm.serial())
    got = nxt.last_finished(1)
    assert got is not None and got.step == 63 and got.attempt == 1
    assert nxt.last_finished(2) is None                # no record of another attempt is taken for it
    nxt.begin(2, 50)                                   # attempt 2 starts from 50 and dies at once
    assert ProgressRecord(tmp_path, Comm.serial()).last_finished(2) == Mark(2, 50, read(tmp_path).wall)


def read(root: Path, rank: int = 0) -> Mark:
    m = progress.read_mark(rank_path(root, rank))
    assert m is not None
    return m


def test_ranks_gone_since_still_count(tmp_path: Path) -> None:
    """Attempt 4 ran on 4 ranks, this one on 1: rank 3 had finished one more step than rank 0."""
    rec = ProgressRecord(tmp_path, Comm.serial())
    rec.begin(4, 10)
    rec.mark(11)
    d = tmp_path / ".progress"
    w = read(tmp_path).wall                            # rank 0's step 11
    (d / "rank-00003").write_bytes(encode(4, 12, w + 1.0) + encode(4, 11, w))
    (d / "rank-00002").write_bytes(encode(3, 30, 50.0))      # an older attempt's: not this one's
    (d / "notes.txt").write_text("not a record")
    nxt = ProgressRecord(tmp_path, Comm.serial())
    assert nxt.last_finished(4) == Mark(4, 12, w + 1.0)   # the newest step, and when it finished
    assert nxt.last_finished(3) == Mark(3, 30, 50.0)


def test_a_record_that_cannot_be_written_turns_itself_off_and_never_stops_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / ".progress").write_text("a file where the directory goes")
    rec = ProgressRecord(tmp_path, Comm.serial())
    rec.begin(1, 0)
    rec.mark(1)                                        # a no-op
    assert "progress record off" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    ok = ProgressRecord(tmp_path / "b", Comm.serial())
    assert ok._fd is not None
    ok._fd = 2**20                                     # the descriptor goes bad under it: EBADF
    ok.begin(1, 0)
    ok.mark(1)
    err = capsys.readouterr().err
    assert err.count("progress record off") == 1 and ok._fd is None


CHILD = textwrap.dedent("""
    import os, signal, sys
    from coci_hpc.comm import Comm
    from coci_hpc.runtime.progress import ProgressRecord
    root, attempt, start, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rec = ProgressRecord(root, Comm.serial())
    rec.begin(attempt, start)
    for step in range(start + 1, 10**9):
        rec.mark(step)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
""")


def test_sigkill_at_a_random_step_leaves_that_step(tmp_path: Path) -> None:
    """What a SIGKILLed process wrote with pwrite is in the page cache: the next reader sees it."""
    rng = random.Random()
    start = 0
    for attempt in (1, 2, 3):
        kill_at = start + rng.randint(1, 5000)
        p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(attempt), str(start), str(kill_at)],
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
        assert p.returncode == -signal.SIGKILL, p.stderr
        got = ProgressRecord(tmp_path, Comm.serial()).last_finished(attempt)
        assert got is not None and got.step == kill_at, (attempt, kill_at, got)
        start = kill_at - rng.randint(0, 100)          # the next attempt resumes a bit before
