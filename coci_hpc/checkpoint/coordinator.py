"""Plan once, on the coordinator, and cache it.

Every rank describes its leaves (name, dtype, shape, kind, size) and keeps that description
with the part of the layout it got last time (:class:`LayoutCache`). A save then costs:

* unchanged state (the common case): ONE allreduce of a flag ("my leaves changed?"); each rank
  compares its leaves' rows with the cached ones (rows built and compared in C, no digest, no
  per-leaf Python call) and reuses its cached pieces. Nothing proportional to the number of ranks is sent or received.
* changed state (first save, a tensor changed shape, a rank's per-rank state changed size):
  rank 0 gathers the descriptions, builds the :class:`~coci_hpc.checkpoint.layout.Layout` and
  scatters to each rank only its pieces (plus the dataset list where HDF5 file creation is
  collective, which grows with the leaves, not the ranks).
* first save of a requeued job (no cache yet): rank 0 reads the layout of the last manifest,
  scatters each rank the digest it was made for, and if every rank's leaves still match, scatters
  the pieces of that layout: no gather of descriptions, no planning.

Whenever the layout is made again (the last two cases) the replicated leaves are also compared
across ranks by checksum (:mod:`.replicas`), since each rank writes a part of them from its own
copy; the cached save does not read the leaves' bytes.

Only rank 0 keeps the whole layout (it writes the manifest). Pieces that come from a manifest
are checked against the rank's own leaves before any byte is written; cached pieces are reused
only for descriptions equal to the ones they were made for and only while their hash is the one
taken then (a cache changed behind the manager's back is planned again, never written). The
digest of the descriptions (:func:`~coci_hpc.checkpoint.layout.signature`) is what the manifest
records for a requeued job; it is computed only when the layout is made again.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from coci_hpc.checkpoint import replicas
from coci_hpc.checkpoint.layout import (
    Layout,
    LeafDesc,
    RankLayout,
    check_pieces,
    describe,
    layout_from_manifest,
    leaf_rows,
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
    # What ``mine`` was made for or checked against: (align, world, this rank's descriptions),
    # and the hash of ``mine.pieces`` then. A save whose descriptions equal ``key`` (one C-level
    # tuple comparison, no digest of the leaves) and whose pieces still hash to ``fingerprint``
    # reuses them without checking them against the leaves again.
    key: tuple[Any, ...] | None = None
    fingerprint: int | None = None
    # The commit's per-rank skeletons: each rank sends its own only when it differs from the
    # one it sent last (``sent_skeleton``, as JSON text: 1, 1.0 and True differ); rank 0 keeps the
    # last one of every rank (``skeletons``), so an unchanged save sends rank 0 O(1) per rank.
    sent_skeleton: bytes | None = None
    skeletons: dict[int, Any] = field(default_factory=dict)

    def remember(self, key: tuple[Any, ...], sig: str, mine: RankLayout, full: Layout | None) -> None:
        self.key, self.signature, self.mine, self.full, self.offsets = key, sig, mine, full, None
        self.fingerprint = hash(mine.pieces)

    def reusable(self, key: tuple[Any, ...]) -> bool:
        """The cached pieces are the ones made for exactly these leaves, unchanged since."""
        return self.mine is not None and self.key == key and hash(self.mine.pieces) == self.fingerprint


def agree(comm: Comm, leaves: Sequence[Any], align: int, cache: LayoutCache, *,
          last_manifest: Callable[[], Mapping[str, Any] | None]) -> tuple[RankLayout, Layout | None]:
    """Collective: this rank's layout for a save of ``leaves`` (state leaves or their
    :class:`~coci_hpc.checkpoint.layout.LeafDesc`; the whole layout on rank 0).

    ``last_manifest``: rank 0 only, the newest committed manifest or None.
    Updates ``cache``; ``cache.last`` records the source ("cached", "manifest", "planned").

    A cached save costs this rank its leaves' rows (:func:`~coci_hpc.checkpoint.layout.leaf_rows`,
    built in C), one comparison of them with the last save's, one hash of its own pieces, and
    one allreduce of 8 bytes; the descriptions and their digest
    (:func:`~coci_hpc.checkpoint.layout.signature`, for the manifest) are made only when the
    layout is made again.
    """
    t0 = time.perf_counter()
    key = (align, comm.size, leaf_rows(leaves))
    mine_state = _SAME if cache.reusable(key) else _NO_CACHE if cache.mine is None else _CHANGED
    agreed = comm.allreduce_max(mine_state)
    source = "cached"
    mine, full = cache.mine, cache.full
    if agreed != _SAME:
        descs = describe(leaves)
        sig = signature(descs, align, comm.size)
        got = _from_manifest(comm, sig, descs, align, last_manifest) \
            if agreed == _NO_CACHE else None
        if got is not None:
            source, (mine, full) = "manifest", got
        else:
            source = "planned"
            mine, full = _plan(comm, descs, align)
        # Before the layout is cached: a refused state is checked again at the next save.
        replicas.check_equal(comm, leaves)
        cache.remember(key, sig, mine, full)
    assert mine is not None
    cache.last = {"source": source, "plan_s": time.perf_counter() - t0}
    return mine, full


def _plan(comm: Comm, descs: Sequence[LeafDesc], align: int) -> tuple[RankLayout, Layout | None]:
    gathered = comm.gather(list(descs))
    full: Layout | None = None
    payload: list[Any] | None = None
    error: BaseException | None = None
    if comm.rank == 0:
        assert gathered is not None
        try:
            full = replace(make_layout(gathered, align=align),
                           signatures=tuple(signature(g, align, comm.size) for g in gathered))
            payload = [full.for_rank(r) for r in range(comm.size)]
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


def _from_manifest(comm: Comm, sig: str, descs: Sequence[LeafDesc], align: int,
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
    mine = comm.scatter([prior.for_rank(r) for r in range(comm.size)]
                        if prior is not None else None)
    comm.run_step(lambda: check_pieces(mine.pieces, descs), "checking the reused checkpoint layout")
    return mine, prior

