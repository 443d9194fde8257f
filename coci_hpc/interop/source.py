"""One committed coci checkpoint seen as named tensors, read one at a time and checked.

A tensor is whatever the manifest stores as one dataset of its global shape (replicated leaves,
:class:`~coci_hpc.checkpoint.leaves.Sharded` tensors assembled from the ranks' rows, and any
later kind stored the same way): :meth:`CheckpointSource.read` fills a fresh tensor with its
bytes, or :meth:`read_rows` with a range of its rows, through
:class:`~coci_hpc.checkpoint.h5read.DatasetReader`, which checks every byte against the CRC of
the shard holding it before it returns. Per-rank state (RNG, ``PerRank``) is no tensor of the
model and is not offered.
"""
from __future__ import annotations

import math
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint.h5read import DatasetReader
from coci_hpc.checkpoint.leaves import LeafKind, storage_dtype
from coci_hpc.checkpoint.treecode import empty_like_leaf, leaf_view
from coci_hpc.errors import CheckpointCorrupt, CheckpointNotFound, UsageError
from coci_hpc.interop import names

MODEL_KEY = "model"
_MAP_AT_LEAST = 1 << 20   # bytes from which a tensor read gets its own mapping


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: its state key, its path inside that state's tree (dotted,
    as ``state_dict()`` names it) and its manifest entry."""

    key: str
    path: str
    meta: Mapping[str, Any]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.meta["shape"])

    @property
    def dtype(self) -> str:
        return str(self.meta["dtype"])

    @property
    def nbytes(self) -> int:
        return int(self.meta["nbytes"])


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a stored leaf comes back as ("numpy.float32" -> torch.float32)."""
    if name.startswith("torch."):
        return getattr(torch, name.split(".", 1)[1])
    return torch.from_numpy(np.empty(0, dtype=storage_dtype(name))).dtype


def _walk(skel: Any, prefix: str, out: list[tuple[str, str]]) -> None:
    """(dotted path, leaf name) of every tensor in a skeleton, in the tree's order."""
    if isinstance(skel, dict):
        if "__tensor__" in skel:
            out.append((prefix, skel["__tensor__"]))
            return
        if "__dict__" in skel and len(skel) == 1:
            for k, v in skel["__dict__"]:
                _walk(v, f"{prefix}.{k}" if prefix else str(k), out)
            return
        if "__tuple__" in skel and len(skel) == 1:
            skel = skel["__tuple__"]
        else:
            for k, v in skel.items():
                _walk(v, f"{prefix}.{k}" if prefix else k, out)
            return
    if isinstance(skel, list):
        for i, v in enumerate(skel):
            _walk(v, f"{prefix}.{i}" if prefix else str(i), out)


class CheckpointSource:
    """Open step ``step`` (default: the newest committed) of the coci checkpoint at ``root``."""

    def __init__(self, root: str | os.PathLike, step: int | None = None) -> None:
        self.root = Path(root)
        named = cat.STEP_RE.match(self.root.name)
        if named and cat.is_committed(self.root) and step is None:   # a step directory
            self.root, step = self.root.parent, int(named.group(1))
        if not self.root.is_dir():
            raise CheckpointNotFound(f"{self.root} is not a directory",
                                     hint="pass the checkpoint root (the directory holding step_*)")
        if step is None:
            step = cat.latest_step(self.root)
            if step is None:
                raise CheckpointNotFound(f"no committed checkpoint under {self.root}",
                                         hint="`coci-ckpt list DIR` shows what is there")
        self.step = int(step)
        self.dir = cat.step_dir(self.root, self.step)
        self.manifest = cat.read_manifest(self.dir)
        self._by_name = {t["name"]: t for t in self.manifest["tensors"]
                         if not (t["kind"] == LeafKind.PER_RANK)}
        self._readers: dict[str, DatasetReader] = {}

    # -- what is in it -----------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self.manifest["skeletons"][LeafKind.REPLICATED])

    def entries(self, key: str) -> list[Entry]:
        """The tensors of state ``key`` (a replicated state value), in its state_dict order."""
        skel = self.manifest["skeletons"][LeafKind.REPLICATED]
        if key not in skel:
            where = " (it is per-rank state)" if key in self.manifest["skeletons"][LeafKind.PER_RANK] else ""
            raise UsageError(f"{self.dir} has no state {key!r}{where}; its state keys: {self.keys()}",
                             hint="name the model's state key (--model-key KEY / model_key=)")
        found: list[tuple[str, str]] = []
        _walk(skel[key], "", found)
        out = []
        for path, leaf in found:
            meta = self._by_name.get(leaf)
            if meta is None:
                raise CheckpointCorrupt(f"{self.dir}: the manifest names tensor {leaf!r} but lists no "
                                        f"dataset for it", hint="load an older step")
            out.append(Entry(key, path, meta))
        return out

    def model(self, key: str = MODEL_KEY) -> list[Entry]:
        return self.entries(key)

    # -- reading -----------------------------------------------------------------------------
    def _reader(self, meta: Mapping[str, Any]) -> DatasetReader:
        f = meta["file"]
        if f not in self._readers:
            self._readers[f] = DatasetReader(self.dir / f, self.manifest)
        return self._readers[f]

    def read(self, entry: Entry) -> torch.Tensor:
        """A fresh tensor with the whole of ``entry``, every byte checked against its CRC."""
        return self.read_rows(entry, 0, entry.shape[0] if entry.shape else 1)

    def read_rows(self, entry: Entry, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 (a 0-d tensor: the whole), checked."""
        shape = entry.shape
        if not shape:
            obj, view = empty_like_leaf(entry.dtype, shape)
            self._read_into(entry, view, 0)   # filled before the tensor is handed out
            return obj if isinstance(obj, torch.Tensor) else torch.from_numpy(obj)
        row = entry.nbytes // shape[0] if shape[0] else 0
        out_shape = (stop - start,) + shape[1:]
        n = (stop - start) * row
        if n < _MAP_AT_LEAST:
            obj, view = empty_like_leaf(entry.dtype, out_shape)
            self._read_into(entry, view, start * row)
            return obj if isinstance(obj, torch.Tensor) else torch.from_numpy(obj)
        # A large tensor gets its own anonymous mapping, unmapped when the tensor dies: the
        # export's memory then falls back after each shard (glibc keeps freed blocks of this
        # size in its heap once its dynamic mmap threshold has risen, and RSS only grows).
        buf = mmap.mmap(-1, n)
        self._read_into(entry, np.frombuffer(buf, dtype=np.uint8), start * row)
        return torch.frombuffer(buf, dtype=torch_dtype(entry.dtype)).view(out_shape)

    def read_bytes(self, entry: Entry, view: np.ndarray, start: int = 0) -> None:
        """Bytes [start, start + view.nbytes) of ``entry`` as stored, into ``view`` (uint8),
        checked against the CRCs of the shards they lie in before this returns."""
        self._read_into(entry, view, start)

    def _read_into(self, entry: Entry, view: np.ndarray, start: int) -> None:
        try:
            self._reader(entry.meta).read(entry.meta, view, start)
        except CheckpointCorrupt as exc:
            raise CheckpointCorrupt(f"tensor {entry.key}.{entry.path}: {exc.message}", hint=exc.hint) from exc

    def will_need(self, boxes: Sequence[tuple[Entry, tuple[int, ...], tuple[int, ...]]]) -> None:
        """Start the disk reading the rows of every box ``(entry, offsets, lengths)`` now,
        so that the box reads that follow, one at a time, find them read in."""
        by_file: dict[str, list[tuple[Mapping[str, Any], int, int]]] = {}
        for e, offsets, lengths in boxes:
            row = e.nbytes // e.shape[0] if e.shape and e.shape[0] else e.nbytes
            first, rows = (offsets[0], lengths[0]) if e.shape else (0, 1)
            by_file.setdefault(e.meta["file"], []).append((e.meta, first * row, (first + rows) * row))
        for ranges in by_file.values():
            self._reader(ranges[0][0]).will_need(ranges)

    def read_box_into(self, entry: Entry, offsets: tuple[int, ...], lengths: tuple[int, ...],
                      target: torch.Tensor) -> bool:
        """Read the box straight into ``target`` when it can take the bytes as they are stored (a
        contiguous CPU tensor of the stored dtype, a box of whole rows); False: it cannot, nothing
        was read. The bytes are checked as they arrive; on a bad checksum ``target`` holds them
        and CheckpointCorrupt is raised (as DCP's own readers, no all-or-nothing load)."""
        shape = entry.shape
        if not shape or any(o != 0 or n != d for o, n, d in zip(offsets[1:], lengths[1:], shape[1:])):
            return False
        view = leaf_view(target, entry.dtype, (lengths[0],) + shape[1:])
        if view is None:
            return False
        row = entry.nbytes // shape[0] if shape[0] else 0
        self._read_into(entry, view, offsets[0] * row)
        return True

    def read_box(self, entry: Entry, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
        """The box ``offsets``..``offsets+lengths`` (one slice per dim): the rows it spans are read
        (and checked), the other dims narrowed."""
        if not entry.shape:
            return self.read(entry)
        t = self.read_rows(entry, offsets[0], offsets[0] + lengths[0])
        for d in range(1, len(lengths)):
            if offsets[d] != 0 or lengths[d] != entry.shape[d]:
                t = t.narrow(d, offsets[d], lengths[d])
        return t

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def __enter__(self) -> CheckpointSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def nbytes_as(entry: Entry, dtype: torch.dtype | None) -> int:
    """Bytes of ``entry`` once converted to ``dtype`` (None: as stored)."""
    if dtype is None or not torch_dtype(entry.dtype).is_floating_point:
        return entry.nbytes
    return math.prod(entry.shape) * torch.empty((), dtype=dtype).element_size()


def export_name(entry: Entry, renames: list, *, prefix: bool = False) -> str:
    base = names.clean(entry.path)
    name = f"{entry.key}.{base}" if prefix else base
    return names.rename(name, renames)
