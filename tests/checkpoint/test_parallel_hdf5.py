"""The foundation under every checkpoint test: parallel HDF5 through mpi4py, on however many ranks run us."""
from __future__ import annotations

import os
import tempfile

import h5py
import numpy as np
import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi


def test_h5py_is_built_with_mpi() -> None:
    assert h5py.get_config().mpi, "h5py without MPI: rerun slurm/setup (it builds h5py against parallel HDF5)"


def test_all_ranks_write_one_file_collectively() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    path = comm.bcast(os.path.join(tempfile.mkdtemp(prefix="coci-h5-"), "x.h5") if rank == 0 else None)
    n = 1000
    with h5py.File(path, "w", driver="mpio", comm=comm) as f:
        d = f.create_dataset("x", (size * n,), dtype="i8")
        with d.collective:
            d[rank * n:(rank + 1) * n] = np.arange(rank * n, (rank + 1) * n)
    comm.Barrier()
    with h5py.File(path, "r", driver="mpio", comm=comm) as f:
        assert np.array_equal(f["x"][...], np.arange(size * n))
    comm.Barrier()
    if rank == 0:
        os.remove(path)
        os.rmdir(os.path.dirname(path))
