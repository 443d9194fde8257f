"""Serial HDF5 backend: the same file format without MPI-IO.

Used when there is no MPI, or h5py was built without MPI. Rank 0 creates the file and all
datasets with h5py's default driver; the engine sends each rank the offsets it needs; then every rank (one process,
or several with mpi4py but a serial h5py) writes its pieces with ``pwrite`` at those offsets.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import h5py

from coci_hpc.checkpoint.h5file import create_datasets, file_kwargs
from coci_hpc.checkpoint.layout import DatasetSpec
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.manifest import DATA_FILE
from coci_hpc.checkpoint.perms import set_file
from coci_hpc.checkpoint.rawio import WriteItem, write_posix
from coci_hpc.comm import Comm


class SerialH5Writer:
    name = "hdf5-serial"
    collective_write = False
    collective_create = False  # rank 0 creates the file alone

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def create(self, directory: Path, datasets: Sequence[DatasetSpec] | None, tuning: IOTuning
               ) -> dict[int, int]:
        """Rank 0 creates the file and returns every dataset's offset; the others get {} (the
        engine sends each rank the offsets of its own pieces)."""
        def make() -> dict[int, int]:
            if self.comm.rank != 0:
                return {}
            assert datasets is not None
            with h5py.File(directory / DATA_FILE, "w",
                           **file_kwargs(tuning.align, tuning.align_threshold)) as f:
                offsets = create_datasets(f, datasets)
            set_file(directory / DATA_FILE, tuning.dir_mode)  # not the umask's mode
            return offsets

        return self.comm.run_step(make, "creating the checkpoint file")

    def write(self, path: Path, items: Sequence[WriteItem], tuning: IOTuning) -> list[int]:
        return write_posix(path, items)
