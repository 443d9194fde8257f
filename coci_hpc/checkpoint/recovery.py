"""Choosing what to load when checkpoints may be damaged: verify, fall back, warn loudly.

Every load checks the manifest's own checksum and the CRC of every shard it reads (see
:class:`~coci_hpc.checkpoint.h5read.DatasetReader`). What happens on damage depends on the call:

* ``load_latest``: the newest committed checkpoint that loads intact wins. A damaged one is
  skipped with a warning (``logging`` and stderr, naming the step, the shard and the problem)
  and the previous committed one is tried; if every one is damaged, CheckpointCorrupt lists
  them all (a job never silently starts from scratch).
* ``load(step)``: an explicit step is never swapped for another: damage raises CheckpointCorrupt.

All ranks take the same decision: rank 0 lists the steps (one broadcast), every load attempt is
collective and ends on every rank together, and "was it damage?" is agreed with one allgather,
so no rank can load a different step from the others. A mismatch between the checkpoint and the
state passed in (another model, other sizes) is not damage: it is raised as it is, since an
older checkpoint would not fit either.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointCorrupt, CheckpointNotFound, CociError, CommError

log = logging.getLogger("coci_hpc.checkpoint")
T = TypeVar("T")

# Local failures that mean "the files are damaged" (not "the state does not fit").
_DAMAGE = (CheckpointCorrupt, OSError, EOFError)
_RESCANS = 3  # a concurrent writer's retention may retire steps while we look at them


def is_damage(exc: BaseException | None) -> bool:
    """True when ``exc`` (or the local error behind a CommError) says a checkpoint is damaged."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, CheckpointNotFound):
            return False  # gone, not damaged: handled by the caller
        if isinstance(exc, _DAMAGE):
            return True
        if isinstance(exc, CociError) and not isinstance(exc, CommError):
            return False  # a state mismatch, a usage error: not about the bytes
        if not isinstance(exc, CommError):
            return False  # h5py's errors on damaged files arrive wrapped as CheckpointCorrupt
        exc, seen = exc.__cause__, seen + 1  # CommError on the failed rank: its local error
    return False


def warn(message: str) -> None:
    """Loud on purpose: a fallback loses training progress and the user must know why.

    Always on stderr; also to ``logging`` when the application configured a handler (without
    one, logging's last-resort handler would print the same line to stderr a second time).
    """
    if log.hasHandlers():
        log.warning(message)
    print(f"coci_hpc: WARNING: {message}", file=sys.stderr, flush=True)


def _agree_damage(comm: Comm, exc: BaseException) -> bool:
    """Collective: did the failed load fail because of damage on any rank?"""
    return any(comm.allgather(is_damage(exc)))


def _gone(comm: Comm, root: Path, step: int) -> bool:
    """Collective: rank 0 looks whether ``step`` is still committed."""
    gone = not cat.is_committed(root, step) if comm.rank == 0 else None
    return bool(comm.bcast(gone))


def load_step(comm: Comm, root: str | os.PathLike, step: int, load: Callable[[int], T]) -> T:
    """Collective: ``load(step)``; damage of that step raises CheckpointCorrupt on every rank."""
    try:
        return load(step)
    except CheckpointCorrupt:
        raise
    except BaseException as exc:
        if not isinstance(exc, Exception) or not _agree_damage(comm, exc):
            raise
        raise CheckpointCorrupt(f"checkpoint step {step} under {root} is damaged: {exc}",
                                hint="`coci-ckpt verify DIR STEP` names the bad shards; load an older "
                                     "step, or use load_latest, which falls back by itself") from exc


def _committed(root: Path, catalog: cat.StepCatalog | None, again: bool) -> list[int]:
    """Rank 0: the committed steps, from the writer's catalog (its one listing of the root) or,
    for a reader or on a rescan, from a fresh listing."""
    if catalog is None:
        return cat.committed_steps(root)
    if again:
        catalog.refresh()
    return catalog.committed()


def load_latest_intact(comm: Comm, root: str | os.PathLike, load: Callable[[int], T],
                       catalog: cat.StepCatalog | None = None) -> T:
    """Collective: ``load(step)`` for the newest committed step that loads intact (see above).
    ``catalog``: rank 0's catalog of a writer that holds the directory lock (no fresh listing)."""
    root = Path(root)
    bad: dict[int, str] = {}
    for attempt in range(_RESCANS):
        steps = comm.bcast(_committed(root, catalog, attempt > 0) if comm.rank == 0 else None)
        candidates = [s for s in reversed(steps) if s not in bad]
        if not candidates and not bad:
            raise CheckpointNotFound(f"no committed checkpoint under {root}",
                                     hint="save one first, or check the directory")
        rescan = False
        for step in candidates:
            try:
                result = load(step)
            except Exception as exc:  # noqa: BLE001 - classified below, re-raised unless damage
                if _gone(comm, root, step):
                    rescan = True  # retired by a newer commit meanwhile: look again
                    break
                if not _agree_damage(comm, exc):
                    raise
                reason = exc.message if isinstance(exc, CociError) else f"{type(exc).__name__}: {exc}"
                bad[step] = reason
                if comm.rank == 0:
                    older = [s for s in candidates if s < step]
                    then = (f"falling back to step {older[0]}" if older else
                            "no older committed checkpoint is left")
                    warn(f"checkpoint step {step} in {root} is damaged and was NOT loaded: {reason}; {then}")
                continue
            if bad and comm.rank == 0:
                warn(f"resumed from checkpoint step {step}, not from the newer damaged step(s) "
                     f"{sorted(bad, reverse=True)}: training progress since step {step} is repeated")
            return result
        if not rescan:
            break
    listing = "; ".join(f"step {s}: {r}" for s, r in sorted(bad.items(), reverse=True))
    raise CheckpointCorrupt(f"every committed checkpoint under {root} is damaged ({len(bad)}): {listing}",
                            hint="nothing was loaded; restore the directory from a copy, or move it "
                                 "aside to start from scratch on purpose")

