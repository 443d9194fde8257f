"""Serial HDF5 backend: the same file format without MPI-IO.

Used when there is no MPI, or h5py was built without MPI. Rank 0 creates the file and all
datasets with h5py's default driver; the engine sends each rank the offsets it needs; then every rank (one process,
or several with mpi4py but a serial h5py) writes its pieces with ``pwrite`` at those offsets.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from coci_hpc.checkpoint.h5file import create_on_rank0
from coci_hpc.checkpoint.layout import DatasetSpec
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.rawio import WriteItem, write_posix
from coci_hpc.comm import Comm


class SerialH5Writer:
    name = "hdf5-serial"
    collective_write = False

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def create(self, directory: Path, datasets: Sequence[DatasetSpec] | None, tuning: IOTuning
               ) -> dict[int, int]:
        return create_on_rank0(self.comm, directory, datasets, tuning)

    def write(self, path: Path, items: Sequence[WriteItem], tuning: IOTuning) -> list[int]:
        return write_posix(path, items, direct=True)

    def write_independent(self, path: Path, items: Sequence[WriteItem], tuning: IOTuning, *,
                          direct: bool = False) -> list[int]:
        return write_posix(path, items, direct=direct)
