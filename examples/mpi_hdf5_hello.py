"""Each MPI rank writes its block of one dataset into ONE HDF5 file through MPI-IO, then rank 0 reads it back.

Run under Slurm:  srun --mpi=pmix python examples/mpi_hdf5_hello.py OUT.h5
Prints one JSON line per rank (host, Slurm node, rank) and rank 0 prints the verified file path.
"""
from __future__ import annotations

import json
import os
import sys

import h5py
import numpy as np
from mpi4py import MPI

ROWS_PER_RANK = 1 << 16  # 64 Ki float64 rows = 512 KiB a rank


def main(path: str) -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    print(json.dumps({"rank": rank, "size": size, "node": os.environ.get("SLURMD_NODENAME"),
                      "host": MPI.Get_processor_name()}), flush=True)
    with h5py.File(path, "w", driver="mpio", comm=comm) as f:
        dset = f.create_dataset("x", (size * ROWS_PER_RANK,), dtype="f8")
        f.attrs["writers"] = size
        block = np.arange(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK, dtype="f8")
        with dset.collective:
            dset[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK] = block
    comm.Barrier()
    if rank == 0:
        with h5py.File(path, "r") as f:
            data = f["x"][...]
            ok = bool(np.array_equal(data, np.arange(size * ROWS_PER_RANK, dtype="f8")))
            print(json.dumps({"file": os.path.abspath(path), "writers": int(f.attrs["writers"]),
                              "bytes": int(data.nbytes), "verified": ok}), flush=True)
            if not ok:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "mpi_hdf5_hello.h5"))
