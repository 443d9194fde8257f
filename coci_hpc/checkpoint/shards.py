"""The shard index of one checkpoint file: which shard (and so which CRC) covers which bytes.

Built once from the manifest when a file is opened for reading; pure (no file, no HDF5). A shard
is keyed by (dataset, first byte); its byte runs are one run, or a format-4 DTensor box's runs (one
per row of a column-sharded box), in the order its CRC covers them.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

from coci_hpc.checkpoint.leaves import storage_dtype
from coci_hpc.checkpoint.manifest import box_runs

ShardKey = tuple[str, int]   # (dataset, first byte in it)
Run = tuple[int, int, ShardKey]   # (first byte, end, the shard it belongs to)


class ShardIndex:
    """Each shard's entry and byte runs, and per dataset every run sorted for range look-ups."""

    def __init__(self, manifest: Mapping[str, Any] | None = None, file: str = "") -> None:
        self.metas: dict[str, Mapping[str, Any]] = {}
        self.by_key: dict[ShardKey, Mapping[str, Any]] = {}
        self.runs: dict[ShardKey, list[tuple[int, int]]] = {}
        self._index: dict[str, tuple[list[int], list[int], list[ShardKey]]] = {}
        if manifest is None:
            return
        self.metas = {t["dataset"]: t for t in manifest["tensors"] if t["file"] == file}
        every: dict[str, list[Run]] = {}
        for sh in manifest["shards"]:
            if sh["file"] == file:
                ds = sh["dataset"]
                key = (ds, sh["start"])
                self.by_key[key] = sh
                if "box" in sh:
                    t = self.metas[ds]
                    rs = box_runs(t["shape"], sh["box"], storage_dtype(t["dtype"]).itemsize)
                else:
                    rs = [(sh["start"], sh["stop"] - sh["start"])] if sh["stop"] > sh["start"] else []
                self.runs[key] = rs
                every.setdefault(ds, []).extend((a, a + n, key) for a, n in rs)
        for ds, runs in every.items():
            runs.sort()
            self._index[ds] = ([a for a, _, _ in runs], [b for _, b, _ in runs], [k for _, _, k in runs])

    def overlapping(self, dataset: str, start: int, stop: int) -> list[Run]:
        """The shard runs (first byte, end, shard key) overlapping bytes [start, stop), in order
        (the runs of a dataset never overlap: the manifest's check)."""
        idx = self._index.get(dataset)
        if idx is None:
            return []
        starts, stops, keys = idx
        lo, hi = bisect.bisect_right(stops, start), bisect.bisect_left(starts, stop)
        return [(starts[i], stops[i], keys[i]) for i in range(lo, hi)]

    def keys_in(self, dataset: str, start: int, stop: int) -> list[ShardKey]:
        """Keys of the shards overlapping [start, stop), each once, in order of first overlap."""
        return list(dict.fromkeys(k for _, _, k in self.overlapping(dataset, start, stop)))

    def keys_of(self, ranges: Sequence[tuple[Mapping[str, Any], int, int]]) -> set[ShardKey]:
        """Keys of the shards overlapping byte ranges ``(dataset entry, start, stop)``."""
        out: set[ShardKey] = set()
        for meta, start, stop in ranges:
            out.update(k for _, _, k in self.overlapping(meta["dataset"], start, stop))
        return out

    def span(self, key: ShardKey) -> int:
        """Bytes from the shard's first to its last (a box's runs have others' between them)."""
        sh = self.by_key[key]
        return int(sh["stop"] - sh["start"])

    def nbytes(self, sh: Mapping[str, Any]) -> int:
        """Bytes the shard's CRC covers."""
        return sum(n for _, n in self.runs[(sh["dataset"], sh["start"])])

    @staticmethod
    def covered(runs: list[Run], start: int, stop: int) -> bool:
        """Whether sorted runs (first byte, end, key) leave no byte of [start, stop) out."""
        at = start
        for a, b, _ in runs:
            if a > at:
                return False
            at = max(at, b)
        return at >= stop
