"""The HDF5 file format shared by the parallel and the serial backend, and the file's creation.

Every tensor is a native HDF5 dataset: contiguous (no chunking, no compression), allocated at
creation, never filled (``H5D_FILL_TIME_NEVER``: no wasted zero pass over the data), aligned to
the page or Lustre stripe size. Its bytes live at a fixed offset that the writer asks HDF5 for
(``H5Dget_offset``) and records in the manifest; readers look the dataset up through HDF5 again,
check its shape and dtype (:mod:`.h5check`), and read the raw bytes at that offset straight into
the destination tensor's memory (:mod:`.h5read`). Any HDF5 tool (``h5ls``, ``h5dump``, h5py) can
read the files.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py

from coci_hpc.checkpoint import rawio, spare
from coci_hpc.checkpoint.catalog import spare_path
from coci_hpc.checkpoint.layout import DatasetSpec
from coci_hpc.checkpoint.leaves import storage_dtype
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.manifest import DATA_FILE
from coci_hpc.checkpoint.perms import set_file
from coci_hpc.comm import Comm

os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")  # several ranks open the same file


def _dcpl() -> h5py.h5p.PropDCID:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def h5_shape(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Dataset shape of a tensor: 0-d tensors are stored as 1 element (h5py allocates scalar
    datasets late, so they would have no fixed offset); the manifest keeps the real shape."""
    return tuple(shape) if len(shape) else (1,)


def create_datasets(f: h5py.File, datasets: Sequence[DatasetSpec]) -> dict[int, int]:
    """Create ``datasets`` in ``f``; return {dataset index: byte offset in the file}.

    With the mpio driver this must run on every rank with the same datasets (it is collective).
    """
    dcpl = _dcpl()
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    types: dict[str, Any] = {}
    offsets: dict[int, int] = {}
    # Low-level H5Dcreate: the same file, byte for byte, as f.create_dataset, at a third of the
    # time (for an FSDP2 model's hundreds of datasets, a visible part of the async save's stall).
    for i, d in enumerate(datasets):
        tid = types.get(d.dtype)
        if tid is None:
            tid = types[d.dtype] = h5py.h5t.py_create(storage_dtype(d.dtype))
        space = h5py.h5s.create_simple(h5_shape(d.shape))
        off = h5py.h5d.create(f.id, d.path.encode(), tid, space, dcpl=dcpl, lcpl=lcpl).get_offset()
        if off is not None:
            offsets[i] = int(off)
    return offsets


def create_on_rank0(comm: Comm, directory: Path, datasets: Sequence[DatasetSpec] | None,
                    tuning: IOTuning) -> dict[int, int]:
    """Collective (one agreement): rank 0 creates ``data.h5`` and every dataset with h5py's default
    driver and returns their offsets; the others get {} (the engine sends each rank the offsets
    of its own pieces). Both backends make the file this way: see :mod:`.h5_parallel` for why
    not HDF5's collective creation."""
    def make() -> dict[int, int]:
        if comm.rank != 0:
            return {}
        assert datasets is not None
        with h5py.File(directory / DATA_FILE, "w", **file_kwargs(tuning.align, tuning.align_threshold)) as f:
            offsets = create_datasets(f, datasets)
        # h5py created it under the umask; the directory's mode decides. Inside the same step,
        # so its error agreement covers it without a second collective per save.
        set_file(directory / DATA_FILE, tuning.dir_mode)
        if not tuning.lustre:   # a retired step's blocks written over, or new ones allocated now
            path = directory / DATA_FILE
            extents = [(off, datasets[i].nbytes) for i, off in offsets.items()]
            if not spare.reuse(path, spare_path(directory.parent), extents):
                _preallocate(path)
        return offsets

    return comm.run_step(make, "creating the checkpoint file")


def _preallocate(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        rawio.preallocate(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def file_kwargs(align: int, threshold: int) -> dict[str, Any]:
    return {"alignment_threshold": threshold, "alignment_interval": align}
