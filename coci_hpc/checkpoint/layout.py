"""Pure layout planning: which datasets a checkpoint file holds and which bytes each rank writes.

Input is every rank's list of leaf descriptions (allgathered); output is the same layout on every
rank, so the collective HDF5 calls that follow get identical arguments everywhere.

* replicated leaves: one dataset each (from rank 0's description; all ranks must agree). Their
  bytes, taken as one stream in dataset order, are cut into ``world`` nearly equal ranges whose
  boundaries fall on ``align``-byte multiples inside a dataset (page / stripe aligned in the
  file), so each rank writes about 1/N of them.
* per-rank leaves: one dataset per rank and leaf, under ``rank00003/...``, written by that rank.
* sharded leaves: one dataset holding the rows of all ranks in rank order; rank r writes its rows.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coci_hpc.errors import CheckpointError


@dataclass(frozen=True)
class LeafDesc:
    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    nbytes: int


@dataclass(frozen=True)
class DatasetSpec:
    path: str                 # HDF5 path inside the file
    name: str                 # logical leaf name ("replicated/model/fc.weight")
    dtype: str
    shape: tuple[int, ...]
    kind: str
    nbytes: int
    rank: int | None = None   # owner of a per-rank dataset


@dataclass(frozen=True)
class Piece:
    """Bytes [start, stop) of dataset ``dataset`` (index into the layout), written by ``rank``.

    ``src_start`` is where the bytes begin in that rank's local leaf buffer.
    """

    dataset: int
    rank: int
    start: int
    stop: int
    leaf: str
    src_start: int


@dataclass(frozen=True)
class Layout:
    datasets: tuple[DatasetSpec, ...]
    pieces: tuple[Piece, ...]

    def pieces_of(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.rank == rank]


def dataset_path(name: str, kind: str, rank: int | None) -> str:
    # leaf names already start with their section ("replicated/...", "per_rank/...").
    if kind == "per_rank":
        return f"rank{rank:05d}/{name.split('/', 1)[1]}"
    return name


def make_layout(per_rank_leaves: Sequence[Sequence[LeafDesc]], align: int = 4096) -> Layout:
    world = len(per_rank_leaves)
    datasets: list[DatasetSpec] = []
    pieces: list[Piece] = []

    # Replicated: rank 0 defines them; every rank must describe the same ones.
    repl0 = [l for l in per_rank_leaves[0] if l.kind == "replicated"]
    sig0 = [(l.name, l.dtype, l.shape) for l in repl0]
    bad = [r for r, leaves in enumerate(per_rank_leaves)
           if [(l.name, l.dtype, l.shape) for l in leaves if l.kind == "replicated"] != sig0]
    if bad:
        r = bad[0]
        mine = {(l.name, l.dtype, l.shape) for l in per_rank_leaves[r] if l.kind == "replicated"}
        diff = sorted(set(sig0) ^ mine)[:3]
        raise CheckpointError(
            f"replicated state differs between rank 0 and rank(s) {bad} (first differences: {diff})",
            hint="replicated state must have the same names, shapes and dtypes on every rank; "
                 "wrap rank-specific values in PerRank(...) or tensors split across ranks in Sharded(...)")
    repl_idx = []
    for l in repl0:
        repl_idx.append(len(datasets))
        datasets.append(DatasetSpec(dataset_path(l.name, l.kind, None), l.name, l.dtype, l.shape,
                                    "replicated", l.nbytes))
    pieces.extend(_split_replicated([datasets[i] for i in repl_idx], repl_idx, world, align))

    # Sharded: global dim 0 = sum of local dim 0, other dims equal.
    shard_names = [l.name for l in per_rank_leaves[0] if l.kind == "sharded"]
    for name in shard_names:
        locs = []
        for r, leaves in enumerate(per_rank_leaves):
            match = [l for l in leaves if l.name == name and l.kind == "sharded"]
            if not match:
                raise CheckpointError(f"sharded tensor {name!r} is missing on rank {r}",
                                      hint="every rank must pass its Sharded(...) part, even with 0 rows")
            locs.append(match[0])
        base = locs[0]
        if any(l.dtype != base.dtype or l.shape[1:] != base.shape[1:] or len(l.shape) == 0 for l in locs):
            raise CheckpointError(f"sharded tensor {name!r} has different dtypes or trailing shapes per rank",
                                  hint="Sharded(...) parts must differ only in dim 0")
        rows = sum(l.shape[0] for l in locs)
        row_bytes = (base.nbytes // base.shape[0]) if base.shape[0] else \
            _row_bytes(locs)
        idx = len(datasets)
        datasets.append(DatasetSpec(name, name, base.dtype, (rows,) + tuple(base.shape[1:]), "sharded",
                                    rows * row_bytes))
        off = 0
        for r, l in enumerate(locs):
            if l.nbytes:
                pieces.append(Piece(idx, r, off, off + l.nbytes, name, 0))
            off += l.nbytes

    # Per-rank.
    for r, leaves in enumerate(per_rank_leaves):
        for l in leaves:
            if l.kind != "per_rank":
                continue
            idx = len(datasets)
            datasets.append(DatasetSpec(dataset_path(l.name, l.kind, r), l.name, l.dtype, l.shape,
                                        "per_rank", l.nbytes, rank=r))
            if l.nbytes:
                pieces.append(Piece(idx, r, 0, l.nbytes, l.name, 0))
    return Layout(tuple(datasets), tuple(pieces))


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
    for r in range(1, world):
        target = total * r // world
        k = max(i for i, s in enumerate(starts) if s <= target)
        within = target - starts[k]
        within = min(dsets[k].nbytes, round(within / align) * align)
        cuts.append(max(cuts[-1], starts[k] + within))
    cuts.append(total)
    out: list[Piece] = []
    for r in range(world):
        lo, hi = cuts[r], cuts[r + 1]
        if lo >= hi:
            continue
        for d, idx, s in zip(dsets, idxs, starts):
            a, b = max(lo, s), min(hi, s + d.nbytes)
            if a < b:
                out.append(Piece(idx, r, a - s, b - s, d.name, a - s))
    return out
