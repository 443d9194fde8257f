"""Plan once, on the coordinator, and cache it.

Every rank describes its leaves (name, dtype, shape, kind, size) and keeps a digest of that
description (:func:`~coci_hpc.checkpoint.layout.signature`) with the part of the layout it got
last time (:class:`LayoutCache`). A save then costs:

* unchanged state (the common case): ONE allreduce of a flag ("my digest changed?"); each rank
  reuses its cached pieces. Nothing proportional to the number of ranks is sent or received.
* changed state (first save, a tensor changed shape, a rank's per-rank state changed size):
  rank 0 gathers the descriptions, builds the :class:`~coci_hpc.checkpoint.layout.Layout` and
  scatters to each rank only its pieces (plus the dataset list where HDF5 file creation is
  collective, which grows with the leaves, not the ranks).
* first save of a requeued job (no cache yet): rank 0 reads the layout of the last manifest,
  scatters each rank the digest it was made for, and if every rank's leaves still match, scatters
  the pieces of that layout: no gather of descriptions, no planning.

Only rank 0 keeps the whole layout (it writes the manifest). Pieces that come from a cache or a
manifest are checked against the rank's own leaves before any byte is written.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from coci_hpc.checkpoint.layout import (
    Layout,
    LeafDesc,
    RankLayout,
    check_pieces,
    layout_from_manifest,
    make_layout,
    signature,
)
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError, CociError

# What the one agreement allreduce carries (the maximum over ranks wins).
_SAME, _CHANGED, _NO_CACHE = 0.0, 1.0, 2.0


@dataclass
class LayoutCache:
    """This rank's part of the last layout agreed on, kept between saves of one manager."""

    signature: str | None = None
    mine: RankLayout | None = None
    full: Layout | None = None            # rank 0 only
    offsets: dict[int, int] | None = None  # file offsets of the datasets this rank writes (rank 0: all)
    last: dict[str, Any] = field(default_factory=dict)  # how the last save got its layout


def agree(comm: Comm, descs: Sequence[LeafDesc], align: int, cache: LayoutCache, *, with_datasets: bool,
          last_manifest: Callable[[], Mapping[str, Any] | None]) -> tuple[RankLayout, Layout | None]:
    """Collective: this rank's layout for a save of ``descs`` (and the whole layout on rank 0).

    ``with_datasets``: every rank takes part in creating the file, so every rank needs the
    dataset list. ``last_manifest``: rank 0 only, the newest committed manifest or None.
    Updates ``cache``; ``cache.last`` records the source ("cached", "manifest", "planned").
    """
    t0 = time.perf_counter()
    sig = signature(descs, align, comm.size)
    mine_state = _NO_CACHE if cache.signature is None or cache.mine is None else \
        _SAME if cache.signature == sig and _fits(cache.mine, descs) else _CHANGED
    agreed = comm.allreduce_max(mine_state)
    source = "cached"
    mine, full = cache.mine, cache.full
    if agreed != _SAME:
        got = _from_manifest(comm, sig, descs, align, with_datasets, last_manifest) \
            if agreed == _NO_CACHE else None
        if got is not None:
            source, (mine, full) = "manifest", got
        else:
            source = "planned"
            mine, full = _plan(comm, descs, align, with_datasets)
        cache.signature, cache.mine, cache.full, cache.offsets = sig, mine, full, None
    assert mine is not None
    cache.last = {"source": source, "plan_s": time.perf_counter() - t0}
    return mine, full


def _fits(mine: RankLayout, descs: Sequence[LeafDesc]) -> bool:
    """The cached pieces fit this rank's leaves (O(own pieces)); a cache that does not, whatever
    the reason, is never used: the layout is planned again."""
    try:
        check_pieces(mine.pieces, descs)
    except CheckpointError:
        return False
    return True


def _plan(comm: Comm, descs: Sequence[LeafDesc], align: int, with_datasets: bool
          ) -> tuple[RankLayout, Layout | None]:
    gathered = comm.gather(list(descs))
    full: Layout | None = None
    payload: list[Any] | None = None
    error: BaseException | None = None
    if comm.rank == 0:
        assert gathered is not None
        try:
            full = replace(make_layout(gathered, align=align),
                           signatures=tuple(signature(g, align, comm.size) for g in gathered))
            payload = [full.for_rank(r, with_datasets) for r in range(comm.size)]
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it (the scatter carries it)
            error = exc
            hint = exc.hint if isinstance(exc, CociError) else None
            payload = [("error", str(exc.message if isinstance(exc, CociError) else exc), hint)] * comm.size
    mine = comm.scatter(payload)
    if error is not None:
        raise error
    if isinstance(mine, tuple):  # the coordinator's error, raised as the same error everywhere
        raise CheckpointError(mine[1], hint=mine[2])
    return mine, full


def _from_manifest(comm: Comm, sig: str, descs: Sequence[LeafDesc], align: int, with_datasets: bool,
                   last_manifest: Callable[[], Mapping[str, Any] | None]) -> tuple[RankLayout, Layout | None] | None:
    """The layout of the last manifest if every rank's leaves are the ones it was made for."""
    prior: Layout | None = None
    if comm.rank == 0:
        try:
            m = last_manifest()
            if m is not None and int(m["world_size"]) == comm.size and \
                    m.get("layout", {}).get("align") == align:
                prior = layout_from_manifest(m)
                if len(prior.signatures) != comm.size:
                    prior = None
        except (CociError, OSError, KeyError, TypeError, ValueError):
            prior = None  # an unreadable or old manifest: plan from the state instead
    sigs: list[str | None] = list(prior.signatures) if prior is not None else [None] * comm.size
    saved = comm.scatter(sigs)
    if comm.allreduce_min(1.0 if saved == sig else 0.0) < 1.0:
        return None
    mine = comm.scatter([prior.for_rank(r, with_datasets) for r in range(comm.size)]
                        if prior is not None else None)
    comm.run_step(lambda: check_pieces(mine.pieces, descs), "checking the reused checkpoint layout")
    return mine, prior

