"""Short writes never pass silently (issue 8, defect 10): Open MPI's ``Write_at_all`` reports a
full disk as success with a short count, and ``write_mpiio`` ignored the count. A file-size
limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the kernel cut writes short the same way."""
from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import numpy as np
import pytest

from coci_hpc.checkpoint.rawio import WriteItem, write_mpiio, write_posix
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError

MiB = 1 << 20


class _FileSizeLimit:
    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __enter__(self) -> None:
        self.old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.old[1]))

    def __exit__(self, *exc: object) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, self.old)
        signal.signal(signal.SIGXFSZ, self.old_sig)


@pytest.mark.mpi
def test_short_mpiio_write_fails_on_the_rank_that_saw_it_without_hanging_the_others(tmp_path_factory):
    """Rank 0's write crosses the limit (short count); rank 1's lies past it (an error)."""
    from mpi4py import MPI

    comm = Comm.world()
    mpi_comm = comm.mpi_comm or MPI.COMM_SELF  # plain pytest: one rank on COMM_SELF
    base = comm.bcast(str(tmp_path_factory.mktemp("short")) if comm.rank == 0 else None)
    path = Path(base) / "data.bin"
    if comm.rank == 0:
        path.write_bytes(b"")
    comm.barrier()
    buf = np.full(MiB, 7, dtype=np.uint8)
    items = [WriteItem(comm.rank * 3 * MiB // 2 + MiB // 2, buf)]
    with _FileSizeLimit(MiB):
        with pytest.raises(CheckpointError, match=r"wrote \d+ of 1048576 bytes|write failed") as info:
            write_mpiio(mpi_comm, path, items)
    assert info.value.hint and "nothing was committed" in info.value.hint
    comm.barrier()


def test_short_pwrite_fails(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"")
    with _FileSizeLimit(MiB), pytest.raises(OSError):
        write_posix(path, [WriteItem(MiB // 2, np.full(MiB, 7, dtype=np.uint8))], fsync=False)
    assert os.path.getsize(path) == MiB  # the kernel wrote up to the limit; the rest is an error
