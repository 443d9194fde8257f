"""The staged survivors' save, one protocol for both tiers: each survivor posts what it holds into
a staging directory of the step catalog, the first to claim it waits for a step whose every
rank's state was posted and hands the pieces to the save transaction
(:func:`coci_hpc.checkpoint.transaction.save_whole`); the others leave at once.

Run by :func:`coci_hpc.runtime.survivors.save` (the per-rank states of the last step boundary,
:class:`~coci_hpc.checkpoint.catalog.Staging`) and :func:`coci_hpc.runtime.memtier.survivors_save`
(the memory tier's copies, of several steps, :class:`~coci_hpc.checkpoint.catalog.TierStaging`);
what differs between them is a :class:`Source`::

    1. post          every survivor: what it holds (durable files, never pickle)
    2. claim         every survivor: the first to create ``claim`` (O_EXCL) writes; the others
                     return "another survivor writes"
    3. known step    the writer: a step fixed beforehand (the boundary) that the regular save had
                     committed is the checkpoint: nothing to write
    4. refuse        the writer: state that cannot be saved this way (held in parts) falls back
    5. wait          the writer, up to the window: the step every rank's state is posted for
    6. found step    committed already (the memory tier's step, found only now): nothing to write
    7. write         the writer: the posted pieces decoded, then the transaction (abort on
                     failure: nothing committed)
    8. drop posted   after a commit: the posted states go, the claim stays until the next
                     attempt sweeps the staging (a late rank must not write the step again)
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from coci_hpc.checkpoint import catalog as cat


class Outcome(Protocol):
    """What the save did (both tiers' outcome classes have these fields)."""

    committed: bool
    writer: bool
    reason: str
    lost: list[int]
    write_s: float
    path: Path | None


class Source(Protocol):
    """What one tier's survivors' save posts, waits for and writes."""

    @property
    def staging(self) -> cat.Staging:
        """Where this tier's survivors post and claim (the step catalog's names)."""

    @property
    def size(self) -> int:
        """The ranks of the world being saved."""

    def post(self) -> None:
        """1. Post what this survivor holds."""

    def known_step(self) -> int | None:
        """3. The step to save when fixed before waiting (None: found by :meth:`wait`)."""

    def refusal(self) -> str:
        """4. Why this state cannot be saved by the survivors ("" when it can)."""

    def wait(self) -> tuple[int | None, str]:
        """5. (the step to write, "") or (None, why none is whole), after up to the window."""

    def gather(self, step: int) -> None:
        """7. Decode the posted pieces of ``step`` (its errors are not a failed write)."""

    def write(self, step: int) -> Path:
        """7. Write ``step`` through the save transaction; OSError, ValueError or KeyError:
        nothing was committed (the transaction aborted)."""

    def already(self, step: int) -> None:
        """3./6. ``step`` was committed by the regular save: note it in the outcome."""

    def wrote(self, step: int) -> None:
        """7. ``step`` was committed by this survivor: note it in the outcome."""


def run(source: Source, out: Outcome, root: Path) -> None:
    """This survivor's part of the staged save; fills ``out``."""
    t0 = time.monotonic()
    source.post()                                                   # 1.
    if not source.staging.claim():                                  # 2.
        out.reason = "another survivor writes"
        return
    out.writer = True
    known = source.known_step()
    if known is not None and cat.is_committed(root, known):        # 3.
        source.staging.drop_posted()
        source.already(known)
        out.write_s = time.monotonic() - t0
        return
    reason = source.refusal()                                       # 4.
    if reason:
        out.reason = reason
        return
    step, reason = source.wait()                                    # 5.
    out.lost = source.staging.absent(source.size)
    if step is None:
        out.reason = reason
        return
    if known is None and cat.is_committed(root, step):              # 6.
        source.already(step)
        source.staging.drop_posted()
        return
    source.gather(step)
    try:
        out.path = source.write(step)                               # 7.
    except (OSError, ValueError, KeyError) as exc:  # the transaction discarded the step directory
        out.reason = str(exc)
        return
    source.staging.drop_posted()                                    # 8.
    out.committed = True
    source.wrote(step)
    out.write_s = time.monotonic() - t0
