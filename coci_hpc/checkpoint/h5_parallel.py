"""Parallel HDF5 backend: h5py ``driver='mpio'`` structure, collective MPI-IO data writes.

* ``create``: every rank opens the file with the mpio driver (MPI-IO hints from
  :mod:`~coci_hpc.checkpoint.lustre` in an ``MPI.Info``), creates every dataset with identical
  arguments (HDF5 requires structural calls to be collective) and closes it collectively.
  Datasets are contiguous and allocated at creation, so their offsets are fixed.
* ``write``: one collective ``MPI_File_write_at_all`` per round over the rank's pieces, same hints,
  then ``MPI_File_sync``. Replicated tensors are split by bytes so each rank writes ~1/N; no
  rank ever passes a zero-size HDF5 selection (the h5py #965 hang): data never goes through
  HDF5 selections at all, and MPI-IO accepts empty buffers in a collective call.
* The two-phase (async) save does not use ``write``: its background thread writes the same
  pieces with plain ``pwrite`` (see :mod:`~coci_hpc.checkpoint.twophase` for why).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import h5py

from coci_hpc.checkpoint.h5file import create_datasets, file_kwargs
from coci_hpc.checkpoint.layout import DatasetSpec
from coci_hpc.checkpoint.lustre import IOTuning, mpi_info
from coci_hpc.checkpoint.manifest import DATA_FILE
from coci_hpc.checkpoint.perms import set_file
from coci_hpc.checkpoint.rawio import WriteItem, write_mpiio
from coci_hpc.comm import Comm


def available(comm: Comm) -> bool:
    return comm.is_mpi and bool(h5py.get_config().mpi)


class ParallelH5Writer:
    name = "hdf5-mpio"
    collective_write = True
    collective_create = True   # every rank creates every dataset (HDF5 structure calls are collective)

    def __init__(self, comm: Comm) -> None:
        if not available(comm):
            from coci_hpc.errors import CheckpointError

            raise CheckpointError("the parallel HDF5 backend needs mpi4py and h5py built with MPI",
                                  hint="use backend='serial' or install h5py with HDF5_MPI=ON")
        self.comm = comm

    def create(self, directory: Path, datasets: Sequence[DatasetSpec] | None, tuning: IOTuning
               ) -> dict[int, int]:
        assert datasets is not None
        info = mpi_info(tuning.mpi_hints)
        try:
            def make() -> dict[int, int]:
                with h5py.File(directory / DATA_FILE, "w", driver="mpio", comm=self.comm.mpi_comm,
                               info=info, **file_kwargs(tuning.align, tuning.align_threshold)) as f:
                    offsets = create_datasets(f, datasets)
                # h5py created it under the umask; the directory's mode decides. Inside the same
                # step, so its error agreement covers it without a second collective per save.
                if self.comm.rank == 0:
                    set_file(directory / DATA_FILE, tuning.dir_mode)
                return offsets

            return self.comm.run_step(make, "creating the checkpoint file (mpio)")
        finally:
            if tuning.mpi_hints:
                info.Free()

    def write(self, path: Path, items: Sequence[WriteItem], tuning: IOTuning) -> list[int]:
        info = mpi_info(tuning.mpi_hints)
        try:
            return write_mpiio(self.comm.mpi_comm, path, items, info)
        finally:
            if tuning.mpi_hints:
                info.Free()
