"""Pure layout planning: which datasets a checkpoint file holds and which bytes each rank writes.

Input is every rank's list of leaf descriptions, gathered on the coordinator (rank 0), which
alone builds the :class:`Layout`; each rank then gets only its :class:`RankLayout` (see
:mod:`.coordinator`, which also caches it between saves).

* replicated leaves: one dataset each (from rank 0's description; all ranks must agree). Their
  bytes, taken as one stream in dataset order, are cut into ``world`` nearly equal ranges whose
  boundaries fall on ``align``-byte multiples inside a dataset (page / stripe aligned in the
  file), so each rank writes about 1/N of them. Leaves of kind ``from_rank0`` (module buffers,
  whose rank-0 value is the authoritative one) are replicated datasets too, written whole by
  rank 0.
* sharded leaves: one dataset holding the rows of all ranks in rank order; rank r writes its rows.
* per-rank leaves: ONE dataset per leaf name (and dtype) holding every rank's elements one after
  the other (1-D, rank order), so the file's metadata grows with the leaves, not ranks x leaves.
  Each rank's part (its byte range and its own shape, which may differ between ranks) is in
  :attr:`Layout.parts` and in the manifest. Format 2 stored one dataset per rank and leaf
  (``rank00003/...``); the loader still reads those.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Any, NamedTuple

from coci_hpc.checkpoint.leaves import LeafKind
from coci_hpc.errors import CheckpointCorrupt, CheckpointError

# A replicated leaf rank 0 writes whole: its value there is the authoritative one (module
# buffers; see coci_hpc.checkpoint.state.collect).
FROM_RANK0 = LeafKind.FROM_RANK0.value
REPLICATED_KINDS = (LeafKind.REPLICATED.value, FROM_RANK0)


class LeafDesc(NamedTuple):
    """One leaf as the planner sees it. A tuple, so that comparing a rank's whole list with the
    previous save's (the cached save's only per-leaf work) runs in C, not per leaf in Python."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    nbytes: int
    box: tuple[Any, ...] = ()  # DTensor leaves: (global offsets, local shape); see :mod:`.dtensor`


_FIELDS = attrgetter(*LeafDesc._fields)
_AS_DESC = partial(tuple.__new__, LeafDesc)  # LeafDesc(...) would run a Python-level __new__


def describe(leaves: Sequence[Any]) -> list[LeafDesc]:
    """The descriptions of ``leaves`` (anything with name, dtype, shape, kind, nbytes)."""
    return list(map(_AS_DESC, map(_FIELDS, leaves)))


def leaf_rows(leaves: Sequence[Any]) -> tuple[tuple[Any, ...], ...]:
    """What :func:`describe` says of ``leaves``, as plain tuples, built without a Python-level
    call per leaf: equal (``==``) to the descriptions, about half their cost to build. A cached
    save compares these with the last save's and builds descriptions only when they differ."""
    return tuple(map(_FIELDS, leaves))


@dataclass(frozen=True)
class DatasetSpec:
    """What creating one dataset needs (identical on every rank that creates it)."""

    path: str                 # HDF5 path inside the file
    name: str                 # logical leaf name ("replicated/model/fc.weight")
    dtype: str
    shape: tuple[int, ...]
    kind: str
    nbytes: int


@dataclass(frozen=True)
class RankPart:
    """Rank ``rank``'s leaf inside a packed per-rank dataset: bytes [start, start + nbytes)."""

    rank: int
    start: int
    shape: tuple[int, ...]
    nbytes: int


class Piece(NamedTuple):
    """Bytes [start, stop) of dataset ``dataset`` (index into the layout), written by ``rank``.

    ``src_start`` is where the bytes begin in that rank's local leaf buffer. A tuple: a rank's
    cached pieces are fingerprinted with one C-level ``hash`` per save (:mod:`.coordinator`).
    """

    dataset: int
    rank: int
    start: int
    stop: int
    leaf: str
    src_start: int


@dataclass(frozen=True)
class RankLayout:
    """One rank's share of a layout: its pieces (rank 0 creates the file and holds the whole
    :class:`Layout`; the others never need the dataset list)."""

    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Layout:
    datasets: tuple[DatasetSpec, ...]
    pieces: tuple[Piece, ...]
    parts: Mapping[int, tuple[RankPart, ...]] = field(default_factory=dict)  # per-rank datasets
    world: int = 1
    # signature of each rank's leaves (see :func:`signature`): a later save, or a requeued job
    # reading it from the manifest, reuses this layout when its own leaves have the same one.
    signatures: tuple[str, ...] = ()
    # DTensor datasets: (writer rank, global offsets, local shape) of each box written
    boxes: Mapping[int, tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]] = field(default_factory=dict)
    _by_rank: dict[int, list[Piece]] = field(default_factory=dict, compare=False, repr=False)

    def pieces_of(self, rank: int) -> list[Piece]:
        if not self._by_rank and self.pieces:
            for p in self.pieces:
                self._by_rank.setdefault(p.rank, []).append(p)
        return self._by_rank.get(rank, [])

    def for_rank(self, rank: int) -> RankLayout:
        return RankLayout(tuple(self.pieces_of(rank)))


def signature(descs: Sequence[LeafDesc], align: int, world: int) -> str:
    """A digest of one rank's leaf descriptions: equal digests on every rank mean the layout
    built last time is the layout that would be built now."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{align}|{world}".encode())
    for d in descs:
        h.update(f"\0{d.name}\1{d.dtype}\1{d.shape}\1{d.kind}\1{d.nbytes}".encode())
        if d.box:
            h.update(f"\1{d.box}".encode())
    return h.hexdigest()


def packed_path(name: str, dtype: str, first_dtype: str) -> str:
    """Dataset of a per-rank leaf: its name; a second dtype of the same name (ranks disagree)
    gets a suffix no escaped key can produce ("%" appears in keys only as %XX)."""
    return name if dtype == first_dtype else f"{name}%dtype={dtype}"


def make_layout(per_rank_leaves: Sequence[Sequence[LeafDesc]], align: int = 4096) -> Layout:
    world = len(per_rank_leaves)
    datasets: list[DatasetSpec] = []
    pieces: list[Piece] = []

    # Replicated: rank 0 defines them; every rank must describe the same ones. Those rank 0 is
    # the authority for (FROM_RANK0: module buffers) are written whole by rank 0; the bytes of
    # the others (equal on every rank: checked by .replicas) are spread over all ranks.
    repl0 = [l for l in per_rank_leaves[0] if l.kind in REPLICATED_KINDS]
    sig0 = [(l.name, l.dtype, l.shape) for l in repl0]
    bad = [r for r, leaves in enumerate(per_rank_leaves)
           if [(l.name, l.dtype, l.shape) for l in leaves if l.kind in REPLICATED_KINDS] != sig0]
    if bad:
        r = bad[0]
        mine = {(l.name, l.dtype, l.shape) for l in per_rank_leaves[r] if l.kind in REPLICATED_KINDS}
        diff = sorted(set(sig0) ^ mine)[:3]
        raise CheckpointError(
            f"replicated state differs between rank 0 and rank(s) {bad} (first differences: {diff})",
            hint="replicated state must have the same names, shapes and dtypes on every rank; "
                 "wrap rank-specific values in PerRank(...) or tensors split across ranks in Sharded(...)")
    repl_idx = []
    for l in repl0:
        idx = len(datasets)
        datasets.append(DatasetSpec(l.name, l.name, l.dtype, l.shape, LeafKind.REPLICATED, l.nbytes))
        if l.kind == FROM_RANK0:
            if l.nbytes:
                pieces.append(Piece(idx, 0, 0, l.nbytes, l.name, 0))
        else:
            repl_idx.append(idx)
    pieces.extend(_split_replicated([datasets[i] for i in repl_idx], repl_idx, world, align))

    # Sharded: global dim 0 = sum of local dim 0, other dims equal.
    by_rank = [{l.name: l for l in leaves if l.kind == LeafKind.SHARDED} for leaves in per_rank_leaves]
    for name in [l.name for l in per_rank_leaves[0] if l.kind == LeafKind.SHARDED]:
        locs = []
        for r, mine_s in enumerate(by_rank):
            if name not in mine_s:
                raise CheckpointError(f"sharded tensor {name!r} is missing on rank {r}",
                                      hint="every rank must pass its Sharded(...) part, even with 0 rows")
            locs.append(mine_s[name])
        base = locs[0]
        if any(l.dtype != base.dtype or l.shape[1:] != base.shape[1:] or len(l.shape) == 0 for l in locs):
            raise CheckpointError(f"sharded tensor {name!r} has different dtypes or trailing shapes per rank",
                                  hint="Sharded(...) parts must differ only in dim 0")
        rows = sum(l.shape[0] for l in locs)
        row_bytes = (base.nbytes // base.shape[0]) if base.shape[0] else _row_bytes(locs)
        idx = len(datasets)
        datasets.append(DatasetSpec(name, name, base.dtype, (rows,) + tuple(base.shape[1:]), LeafKind.SHARDED,
                                    rows * row_bytes))
        off = 0
        for r, l in enumerate(locs):
            if l.nbytes:
                pieces.append(Piece(idx, r, off, off + l.nbytes, name, 0))
            off += l.nbytes

    # Per-rank, packed: one dataset per (name, dtype), ranks' elements concatenated in rank order.
    groups: dict[tuple[str, str], list[tuple[int, LeafDesc]]] = {}
    first_dtype: dict[str, str] = {}
    for r, leaves in enumerate(per_rank_leaves):
        for l in leaves:
            if l.kind == LeafKind.PER_RANK:
                first_dtype.setdefault(l.name, l.dtype)
                groups.setdefault((l.name, l.dtype), []).append((r, l))
    parts: dict[int, tuple[RankPart, ...]] = {}
    for (name, dtype), members in groups.items():
        idx = len(datasets)
        total, elems, mine_p = 0, 0, []
        for r, l in members:
            mine_p.append(RankPart(r, total, tuple(l.shape), l.nbytes))
            if l.nbytes:
                pieces.append(Piece(idx, r, total, total + l.nbytes, name, 0))
            total += l.nbytes
            elems += math.prod(l.shape)
        datasets.append(DatasetSpec(packed_path(name, dtype, first_dtype[name]), name, dtype, (elems,),
                                    LeafKind.PER_RANK, total))
        parts[idx] = tuple(mine_p)
    boxes = _plan_dtensors(per_rank_leaves, datasets, pieces)
    return Layout(tuple(datasets), tuple(pieces), parts, world, boxes=boxes)


def _plan_dtensors(per_rank_leaves: Sequence[Sequence[LeafDesc]], datasets: list[DatasetSpec],
                   pieces: list[Piece]) -> dict[int, tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]]:
    """DTensor leaves: one dataset of the global shape each; every distinct box written once
    (see :func:`.dtensor.plan`), as its coalesced byte runs."""
    from coci_hpc.checkpoint.dtensor import plan
    from coci_hpc.checkpoint.leaves import storage_dtype

    by_rank = [{l.name: l for l in leaves if l.kind == LeafKind.DTENSOR} for leaves in per_rank_leaves]
    out: dict[int, tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]] = {}
    written: dict[int, int] = {}
    for name in [l.name for l in per_rank_leaves[0] if l.kind == LeafKind.DTENSOR]:
        descs = [mine.get(name) for mine in by_rank]
        base = descs[0]
        assert base is not None
        itemsize = storage_dtype(base.dtype).itemsize
        writers = plan(name, descs, written, itemsize)
        idx = len(datasets)
        datasets.append(DatasetSpec(name, name, base.dtype, tuple(base.shape), LeafKind.DTENSOR,
                                    math.prod(base.shape) * itemsize))
        out[idx] = tuple((r, box[0], box[1]) for r, box in writers)
        pieces.extend(dtensor_pieces(idx, name, tuple(base.shape), itemsize, out[idx]))
    if any(name not in by_rank[0] for mine in by_rank[1:] for name in mine):
        extra = sorted({n for mine in by_rank[1:] for n in mine} - set(by_rank[0]))[:3]
        raise CheckpointError(f"DTensor state {extra} exists on other ranks but not on rank 0",
                              hint="every rank must hold the same DTensor state (a mesh over all ranks)")
    return out


def dtensor_pieces(idx: int, name: str, shape: tuple[int, ...], itemsize: int,
                   boxes: Sequence[tuple[int, tuple[int, ...], tuple[int, ...]]]) -> list[Piece]:
    from coci_hpc.checkpoint.dtensor import runs

    return [Piece(idx, r, start, start + n, name, src)
            for r, offs, shape_b in boxes for start, src, n in runs(shape, (offs, shape_b), itemsize)]


def shard_entries(layout: Layout, crcs: Sequence[Sequence[int]], file: str) -> list[dict[str, Any]]:
    """The manifest's "shards": every rank's pieces (in :meth:`Layout.pieces_of` order) with the
    CRC-32C each rank computed while writing them (``crcs[rank]``, same order).

    The runs of a DTensor box (a rank writes at most one box of a tensor) become ONE entry
    (format 4): ``"box"`` [offsets, shape], ``start``/``stop`` its first byte and one past its
    last in the dataset, and the CRC-32C of its bytes in the local shard's C order (its runs in
    order), combined from the runs' CRCs. A ``Shard(1)`` box of a 4096-row weight was 4096
    entries before; it is one now."""
    from coci_hpc.checkpoint.integrity import Combiner

    comb = Combiner()
    out: list[dict[str, Any]] = []
    box_of = {i: {b[0]: b for b in bx} for i, bx in layout.boxes.items()}  # dataset -> rank -> box
    for r, mine in enumerate(crcs):
        pieces = layout.pieces_of(r)
        if len(pieces) != len(mine):
            raise CheckpointError(f"rank {r} reported {len(mine)} checksums for {len(pieces)} pieces",
                                  hint="report this; save again under a new step")
        i = 0
        while i < len(pieces):
            p = pieces[i]
            d = layout.datasets[p.dataset]
            if d.kind != LeafKind.DTENSOR:
                out.append({"file": file, "dataset": d.path, "rank": r, "start": p.start, "stop": p.stop,
                            "crc32c": mine[i]})
                i += 1
                continue
            j = i + 1
            while j < len(pieces) and pieces[j].dataset == p.dataset:
                j += 1
            _, offs, shape = box_of[p.dataset][r]
            crc = comb.fold([(mine[k], pieces[k].stop - pieces[k].start) for k in range(i, j)])
            out.append({"file": file, "dataset": d.path, "rank": r, "start": p.start,
                        "stop": pieces[j - 1].stop, "box": [list(offs), list(shape)], "crc32c": crc})
            i = j
    return out


def _row_bytes(locs: Sequence[LeafDesc]) -> int:
    for l in locs:
        if l.shape and l.shape[0]:
            return l.nbytes // l.shape[0]
    return 0


def _split_replicated(dsets: Sequence[DatasetSpec], idxs: Sequence[int], world: int,
                      align: int) -> list[Piece]:
    total = sum(d.nbytes for d in dsets)
    if total == 0:
        return []
    # Global stream offset where each dataset starts.
    starts, acc = [], 0
    for d in dsets:
        starts.append(acc)
        acc += d.nbytes
    # Cut points in the stream, snapped to an align multiple inside the dataset holding them.
    cuts = [0]
    k = 0
    for r in range(1, world):
        target = total * r // world
        while k + 1 < len(starts) and starts[k + 1] <= target:
            k += 1
        within = target - starts[k]
        within = min(dsets[k].nbytes, round(within / align) * align)
        cuts.append(max(cuts[-1], starts[k] + within))
    cuts.append(total)
    out: list[Piece] = []
    j = 0
    for r in range(world):
        lo, hi = cuts[r], cuts[r + 1]
        if lo >= hi:
            continue
        while j < len(dsets) and starts[j] + dsets[j].nbytes <= lo:
            j += 1
        i = j
        while i < len(dsets) and starts[i] < hi:
            d, s = dsets[i], starts[i]
            a, b = max(lo, s), min(hi, s + d.nbytes)
            if a < b:
                out.append(Piece(idxs[i], r, a - s, b - s, d.name, a - s))
            i += 1
    return out


def check_pieces(pieces: Sequence[Piece], descs: Sequence[LeafDesc]) -> None:
    """Refuse a layout (cached, or rebuilt from a manifest) that does not fit this rank's leaves:
    a piece of an unknown leaf or one reaching past the leaf's bytes would write a wrong file."""
    size = {d.name: d.nbytes for d in descs}
    for p in pieces:
        n = size.get(p.leaf)
        if n is None or not 0 <= p.src_start <= p.src_start + (p.stop - p.start) <= n or p.stop < p.start:
            raise CheckpointError(f"the checkpoint layout does not fit this rank's state at {p.leaf!r}",
                                  hint="report this; the layout is planned again at the next save")


def layout_from_manifest(m: Mapping[str, Any]) -> Layout:
    """The layout a (format 3) manifest was written with: datasets, pieces and per-rank parts."""
    from coci_hpc.checkpoint.leaves import storage_dtype

    datasets: list[DatasetSpec] = []
    parts: dict[int, tuple[RankPart, ...]] = {}
    boxes: dict[int, tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]] = {}
    index: dict[str, int] = {}
    for t in m["tensors"]:
        if t["kind"] == LeafKind.PER_RANK and t.get("rank") is not None:
            raise CheckpointCorrupt("a format-2 manifest has no reusable layout",
                                    hint="the layout is planned from the state instead")
        index[t["dataset"]] = len(datasets)
        if t["kind"] == LeafKind.PER_RANK:
            parts[len(datasets)] = tuple(RankPart(int(r), int(s), tuple(sh), int(n))
                                         for r, s, sh, n in t["parts"])
        if t["kind"] == LeafKind.DTENSOR:
            boxes[len(datasets)] = tuple((int(r), tuple(o), tuple(sh)) for r, o, sh in t["boxes"])
        datasets.append(DatasetSpec(t["dataset"], t["name"], t["dtype"], tuple(t["shape"]), t["kind"],
                                    int(t["nbytes"])))
    pieces = []
    for i, bx in boxes.items():  # the shards are these boxes' runs: expanded again, same order
        d = datasets[i]
        pieces.extend(dtensor_pieces(i, d.name, d.shape, storage_dtype(d.dtype).itemsize, bx))
    for sh in m["shards"]:
        i = index[sh["dataset"]]
        d = datasets[i]
        if d.kind == LeafKind.DTENSOR:
            continue
        src = sh["start"] if d.kind == LeafKind.REPLICATED else 0
        pieces.append(Piece(i, int(sh["rank"]), int(sh["start"]), int(sh["stop"]), d.name, int(src)))
    sigs = tuple(m.get("layout", {}).get("signatures", ()))
    return Layout(tuple(datasets), tuple(pieces), parts, int(m["world_size"]), sigs, boxes=boxes)
