"""The manifest of one save, built from its layout and every rank's commit message: the
tensor entries (name, dataset, dtype, shape, kind, offset; the parts of a packed per-rank
dataset, the boxes of a DTensor), the shard entries with their CRC-32Cs, the skeletons.

Rank 0 builds it in the commit phase (:func:`~coci_hpc.checkpoint.commit.seal`); nothing here
communicates or touches the file system.
"""
from __future__ import annotations

from typing import Any

from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.layout import shard_entries
from coci_hpc.checkpoint.leaves import LeafKind
from coci_hpc.checkpoint.prepared import Prepared


def manifest_of(world_size: int, prepared: Prepared, gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest of ``prepared`` (its whole layout is rank 0's), from ``gathered``: each
    rank's commit message ({"crcs", "per_rank" skeleton}), in rank order."""
    assert prepared.full is not None
    layout = prepared.full
    tensors = []
    for i, d in enumerate(layout.datasets):
        entry: dict[str, Any] = {"name": d.name, "dataset": d.path, "file": mf.DATA_FILE, "dtype": d.dtype,
                 "shape": list(d.shape), "kind": d.kind, "rank": None,
                 "nbytes": d.nbytes, "offset": prepared.offsets.get(i)}
        if d.kind == LeafKind.PER_RANK:
            entry["parts"] = [[p.rank, p.start, list(p.shape), p.nbytes] for p in layout.parts[i]]
        elif d.kind == LeafKind.DTENSOR:
            entry["boxes"] = [[r, list(o), list(sh)] for r, o, sh in layout.boxes[i]]
        tensors.append(entry)
    shards = shard_entries(layout, [g["crcs"] for g in gathered], mf.DATA_FILE)
    skel: dict[str, Any] = {LeafKind.REPLICATED: prepared.skeletons[LeafKind.REPLICATED],
                            LeafKind.PER_RANK: {str(r): g[LeafKind.PER_RANK] for r, g in enumerate(gathered)}}
    return mf.build(step=prepared.step, world_size=world_size, tensors=tensors, shards=shards,
                    skeletons=skel, files=[mf.DATA_FILE], backend=prepared.backend,
                    extra={"lustre": prepared.tuning.lustre, "align": prepared.tuning.align, **prepared.extra,
                           "layout": {"align": prepared.tuning.align,
                                      "signatures": list(layout.signatures)}})
