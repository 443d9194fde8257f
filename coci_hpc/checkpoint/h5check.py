"""The checks on a checkpoint file that may have been damaged or crafted, before any byte of it is read.

Reading trusts nothing in the file: ``data.h5`` must be a regular file (not a symlink), every
link in it a hard link (no soft or external links, which would make HDF5 open other files), every
dataset one the manifest names, and each dataset of the shape, dtype and size its manifest entry
says, lying wholly inside the file. Any HDF5 error on damaged metadata becomes a
:class:`~coci_hpc.errors.CheckpointCorrupt`. The CRCs of the bytes are :mod:`.h5read`'s.
"""
from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py

from coci_hpc.checkpoint.h5file import h5_shape
from coci_hpc.checkpoint.leaves import storage_dtype
from coci_hpc.errors import CheckpointCorrupt

# What h5py raises on damaged metadata (a flipped byte in an object header, a truncated B-tree).
H5_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError, IndexError, OverflowError,
             SystemError)

_HINT = "run `coci-ckpt verify` on it; load an older step"


@dataclass
class OpenedFile:
    """A checkpoint file opened after the checks: its descriptor (for ``pread`` and the mapping),
    size, the HDF5 file and every object in it (path -> low-level HDF5 id)."""

    fd: int
    size: int
    h5: h5py.File
    objects: dict[str, Any]

    def dataset_names(self) -> list[str]:
        return [n for n, o in self.objects.items() if isinstance(o, h5py.h5d.DatasetID)]

    def close(self) -> None:
        self.objects.clear()  # low-level ids keep the file open
        self.h5.close()
        os.close(self.fd)


def open_untrusted(path: Path) -> OpenedFile:
    """Open ``path`` read-only: a regular file, not a symlink, the same file HDF5 then opens, with
    hard links only; CheckpointCorrupt otherwise (nothing left open)."""
    try:
        # O_NOFOLLOW: a data.h5 that is a symlink would make us read any file on the machine.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        what = "is a symbolic link" if path.is_symlink() else f"cannot be opened: {exc}"
        raise CheckpointCorrupt(f"{path} {what}", hint=_HINT) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorrupt(f"{path} is not a regular file", hint=_HINT)
        try:
            h5 = h5py.File(path, "r")
        except H5_ERRORS as exc:
            raise CheckpointCorrupt(f"{path}: cannot open as HDF5: {exc}", hint=_HINT) from exc
        try:
            # The file HDF5 opened is the one we checked (not swapped for a link meanwhile).
            same = os.fstat(h5.id.get_vfd_handle())
            if (same.st_dev, same.st_ino) != (st.st_dev, st.st_ino):
                raise CheckpointCorrupt(f"{path} changed while it was being opened", hint=_HINT)
            objects = _hard_links_only(h5, path)
        except H5_ERRORS as exc:
            h5.close()
            raise CheckpointCorrupt(f"{path}: HDF5 metadata is damaged: {exc}", hint=_HINT) from exc
        except BaseException:
            h5.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    return OpenedFile(fd, st.st_size, h5, objects)


def _hard_links_only(h5: h5py.File, path: Path) -> dict[str, Any]:
    """Every object in the file, path -> its low-level HDF5 id (``h5d.DatasetID`` for a
    dataset); CheckpointCorrupt if any link is soft or external.

    Low-level calls (one link visit in C, one ``H5Oopen`` per link): the high-level
    ``visititems_links`` + ``get`` + ``in`` + ``[]`` cost about five times as much, which for a
    sharded model's hundreds of datasets was a visible part of a load (issue 23 profile)."""
    links: list[tuple[bytes, int]] = []

    def visit(name: bytes, info: Any) -> None:
        links.append((name, info.type))  # no HDF5 call in here: h5py mangles errors raised inside

    h5.id.links.visit(visit, info=True)
    kinds = {h5py.h5l.TYPE_SOFT: "SoftLink", h5py.h5l.TYPE_EXTERNAL: "ExternalLink"}
    bad = [f"{name.decode(errors='replace')!r} is a {kinds.get(kind, 'user-defined link')}"
           for name, kind in links if kind != h5py.h5l.TYPE_HARD]
    if bad:
        raise CheckpointCorrupt(f"{path}: {bad[0]} (coci checkpoints hold only hard links; a link "
                                f"could make the loader read another file)",
                                hint="this file was not written by coci_hpc or was tampered with; "
                                     "load an older step")
    return {name.decode(): h5py.h5o.open(h5.id, name) for name, _ in links}


def only_named_datasets(path: Path, names: list[str], manifest: Mapping[str, Any]) -> None:
    """CheckpointCorrupt if the file holds a dataset its manifest does not name."""
    wanted = {t["dataset"].lstrip("/") for t in manifest["tensors"] if t["file"] == path.name}
    extra = sorted(set(names) - wanted)
    if extra:
        raise CheckpointCorrupt(f"{path} holds {len(extra)} dataset(s) its manifest does not "
                                f"name, e.g. {extra[0]!r}",
                                hint="the file does not belong to this manifest or was tampered "
                                     "with; load an older step")


def checked_offset(opened: OpenedFile, path: Path, meta: Mapping[str, Any]) -> int:
    """Byte offset of the dataset of manifest entry ``meta`` in the file, after checking it is
    there, of that shape, dtype and size, contiguous and wholly inside the file."""
    name = meta["dataset"]
    ds = opened.objects.get(str(name).strip("/"))
    if ds is None:
        raise CheckpointCorrupt(f"{path}: dataset {name!r} named in the manifest is missing",
                                hint="the shard file is damaged; load an older step")
    if not isinstance(ds, h5py.h5d.DatasetID):
        raise CheckpointCorrupt(f"{path}: {name!r} is not a dataset",
                                hint="the shard file is damaged; load an older step")
    if tuple(ds.shape) != h5_shape(meta["shape"]) or ds.dtype != storage_dtype(meta["dtype"]):
        raise CheckpointCorrupt(f"{path}: dataset {name!r} is {ds.shape} {ds.dtype}, manifest "
                                f"says {tuple(meta['shape'])} {meta['dtype']}",
                                hint="the shard file does not belong to this manifest")
    nbytes = math.prod(h5_shape(meta["shape"])) * ds.dtype.itemsize
    if int(meta["nbytes"]) != nbytes:
        raise CheckpointCorrupt(f"{path}: dataset {name!r} holds {nbytes} bytes, manifest says "
                                f"{meta['nbytes']}", hint="the manifest was edited or damaged; "
                                "load an older step")
    off = ds.get_offset()
    if off is None:
        if nbytes == 0:
            return 0
        raise CheckpointCorrupt(f"{path}: dataset {name!r} has no contiguous storage",
                                hint="the file was not written by coci_hpc")
    if int(off) + nbytes > opened.size:
        raise CheckpointCorrupt(f"{path}: dataset {name!r} ends past the end of the file "
                                f"(truncated?)", hint="the shard file is damaged; load an older step")
    return int(off)
