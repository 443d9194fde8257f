"""The cross-rank check of replicated state: a leaf each rank writes a part of must be equal on
every rank, or the file would hold a mix of the ranks' values with no error.

Every rank takes the CRC-32C of each of its ``replicated`` leaves; rank 0 broadcasts its list and
each rank compares. A difference is refused on every rank with the first differing leaf named.
It runs whenever the layout is planned again (the first save of a manager, a changed shape, the
first save of a requeued job): the cached save of an unchanged state costs nothing more. Module
buffers (``from_rank0``) are not compared: rank 0's are written (:mod:`.layout`). Neither are
``PerRank`` and ``Sharded`` leaves, which differ by design. A DTensor box held by several ranks
(HSDP's replicate dimension, ``Replicate()``) is compared across the ranks holding it the same
way (:func:`check_boxes_equal`): one of them writes it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint.integrity import checksum
from coci_hpc.checkpoint.leaves import LeafKind
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError, UsageError


def _bytes_of(leaf: Any) -> np.ndarray | None:
    """The bytes of a leaf: its host array, or a host copy of its device tensor (two-phase save)."""
    array = getattr(leaf, "array", None)
    if array is not None:
        return array
    source = getattr(leaf, "source", None)
    if isinstance(source, torch.Tensor):
        t = source.detach().cpu().contiguous()  # a blocking copy for a device tensor
        return t.view(torch.uint8).reshape(-1).numpy() if t.numel() else np.empty(0, np.uint8)
    return None


def checksums(leaves: Sequence[Any]) -> list[tuple[str, int]]:
    """(name, CRC-32C) of this rank's replicated leaves, in leaf order (leaves without bytes,
    descriptions only, are skipped)."""
    out = []
    for leaf in leaves:
        if leaf.kind != LeafKind.REPLICATED:
            continue
        data = _bytes_of(leaf)
        if data is not None:
            out.append((leaf.name, checksum(data)))
    return out


def box_checksums(leaves: Sequence[Any]) -> list[tuple[Any, int]]:
    """(box, CRC-32C) of this rank's DTensor leaves, in leaf order (None where there are no bytes)."""
    out: list[tuple[Any, int]] = []
    for leaf in leaves:
        if leaf.kind != LeafKind.DTENSOR:
            continue
        data = _bytes_of(leaf)
        out.append((leaf.box, checksum(data) if data is not None else -1))
    return out


def differing_boxes(names: Sequence[str], per_rank: Sequence[Sequence[tuple[Any, int]]]
                    ) -> tuple[str, Any, dict[int, list[int]]] | None:
    """The first DTensor leaf whose box is held by several ranks (replicas: HSDP's replicate
    dim, a ``Replicate()`` placement) with different bytes: (name, box, {CRC: ranks}), or None."""
    for i, name in enumerate(names):
        groups: dict[Any, dict[int, list[int]]] = {}
        for r, mine in enumerate(per_rank):
            if i >= len(mine):
                continue
            box, crc = mine[i]
            if crc < 0:
                continue
            key = (tuple(box[0]), tuple(box[1])) if box else ()
            groups.setdefault(key, {}).setdefault(crc, []).append(r)
        for key, by_crc in groups.items():
            if len(by_crc) > 1:
                return name, key, by_crc
    return None


def check_boxes_equal(comm: Comm, leaves: Sequence[Any]) -> None:
    """Collective: refuse (UsageError, every rank) a DTensor box whose replicas differ. Only one
    replica writes a replicated box (:func:`.dtensor.plan`), so different values would silently
    lose all but one."""
    if not any(leaf.kind == LeafKind.DTENSOR for leaf in leaves):
        return   # every rank alike: the layout agreed which leaves are DTensors on every rank
    mine = comm.run_step(lambda: box_checksums(leaves), "checksumming the DTensor boxes")
    per_rank = comm.allgather(mine)   # a box and 4 bytes a DTensor leaf, only when the layout is planned
    names = [leaf.name for leaf in leaves if leaf.kind == LeafKind.DTENSOR]
    found = differing_boxes(names, per_rank)
    if found is None:
        return
    name, box, by_crc = found
    groups = sorted(by_crc.values())
    raise UsageError(
        f"DTensor {name!r}: its shard at offsets {list(box[0]) if box else []}, shape "
        f"{list(box[1]) if box else []} is replicated over ranks {sorted(r for g in groups for r in g)} "
        f"but its values differ between them (CRC-32C groups {groups}): only one replica is "
        f"written, so saving would keep one rank's values and drop the others'; nothing was written",
        hint="replicas of a shard (HSDP's replicate dimension, a Replicate() placement) must be equal "
             "when saving: step on gradients reduced over the replicate dimension, or broadcast the "
             "shard from one replica (e.g. dt.redistribute) before saving")


def check_equal(comm: Comm, leaves: Sequence[Any]) -> None:
    """Collective: raise a CheckpointError on every rank if a replicated leaf differs between
    ranks, a UsageError if the replicas of a DTensor box do (:func:`check_boxes_equal`)."""
    if comm.size == 1:
        return
    check_boxes_equal(comm, leaves)
    mine = comm.run_step(lambda: checksums(leaves), "checksumming the replicated state")
    crcs = np.fromiter((c for _, c in mine), dtype=np.uint32, count=len(mine))
    ref = comm.bcast(crcs if comm.rank == 0 else None)   # 4 bytes a leaf; the names are agreed
    # Names, dtypes and shapes were checked by the layout, which refuses a list of another
    # length or order with its own message.
    differ = np.flatnonzero(crcs != ref) if len(ref) == len(crcs) else np.empty(0, np.int64)
    found = comm.allgather(int(differ[0]) if len(differ) else -1)
    differing = [r for r, i in enumerate(found) if i >= 0]
    if not differing:
        return
    at = min(found[r] for r in differing)
    name = mine[at][0]
    ranks = [r for r in differing if found[r] == at]
    raise CheckpointError(
        f"replicated state {name!r} differs between rank 0 and rank(s) {ranks} (CRC-32C compared "
        f"across ranks; {len(differing)} rank(s) differ in at least one leaf): saving it would mix the "
        f"ranks' values, so nothing was written",
        hint="wrap a value each rank owns in PerRank(...) and a tensor split over the ranks in "
             "Sharded(...); a value that should be the same everywhere (parameters, optimizer state "
             "under DDP) must be made equal on every rank before saving, e.g. by stepping on "
             "all-reduced gradients or broadcasting rank 0's value")
