"""Moving step directories out of the live set: rollback, partial leftovers, and space.

Only the holder of the directory lock (:mod:`.lock`) calls these, on rank 0, inside a save.

* **Rollback** (:func:`retire_abandoned`): after a load of step S, the first save moves every
  committed step newer than S into ``ROOT/abandoned/`` (renamed, never deleted: nothing is
  destroyed silently). "latest" is then the newest step of the live branch, retention counts
  only live steps, and a crash resumes the live branch, not the abandoned one.
* **Partial steps** (:func:`remove_partial`): a step directory without a manifest is a save
  that never committed (a crash, a full disk); it is deleted at the next save.
* **Space** (:func:`retire_oldest`): with ``on_no_space="retire_oldest"``, a save that hit a
  full disk deletes abandoned checkpoints, then the oldest committed ones (never the newest),
  and is retried once.
"""
from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

from coci_hpc.checkpoint import manifest as mf

ABANDONED = "abandoned"
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "errno = 28", "errno 28",
                  "disk full")  # rawio reports short writes as "(disk full?)"


def retire_abandoned(root: Path, base: int) -> list[int]:
    """Move committed steps newer than ``base`` to ``ROOT/abandoned/``; return their steps."""
    moved = []
    for c in mf.scan(root):
        if c.step <= base:
            continue
        if not c.committed:
            shutil.rmtree(c.path, ignore_errors=True)
            continue
        dest_dir = root / ABANDONED
        dest_dir.mkdir(exist_ok=True)
        dest = dest_dir / c.path.name
        if dest.exists():  # abandoned twice (two rollbacks past the same step): keep both
            dest = dest_dir / f"{c.path.name}.{time.strftime('%Y%m%dT%H%M%S')}.{os.getpid()}"
        os.rename(c.path, dest)
        moved.append(c.step)
    if moved:
        mf.fsync_dir(root)
    return moved


def remove_partial(root: Path) -> list[int]:
    """Delete uncommitted step directories (saves that never committed)."""
    removed = []
    for c in mf.scan(root):
        if not c.committed:
            shutil.rmtree(c.path, ignore_errors=True)
            removed.append(c.step)
    return removed


def retire_oldest(root: Path) -> list[str]:
    """Free space for a retry: all abandoned checkpoints, then every committed one but the newest."""
    freed = []
    abandoned = root / ABANDONED
    if abandoned.is_dir():
        for p in sorted(abandoned.iterdir()):
            shutil.rmtree(p, ignore_errors=True)
            freed.append(f"{ABANDONED}/{p.name}")
    committed = [c for c in mf.scan(root) if c.committed]
    for c in committed[:-1]:
        (c.path / mf.MANIFEST).unlink(missing_ok=True)  # uncommitted first: a crash midway is safe
        shutil.rmtree(c.path, ignore_errors=True)
        freed.append(c.path.name)
    for p in root.glob(".trash-*"):  # retention's background deletions not finished yet
        shutil.rmtree(p, ignore_errors=True)
    return freed


def is_no_space(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it wraps, or a rank's message in a CommError) is a full disk."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return True
        if any(t in str(exc) for t in _NO_SPACE_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
