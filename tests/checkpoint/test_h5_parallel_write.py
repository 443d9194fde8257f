"""Which data write the parallel backend uses (issue 33): each rank's own ``pwrite`` + fsync off
Lustre (no two-phase aggregation on one block device), collective MPI-IO with the Lustre hints on
Lustre (forced here with the test-only COCI_FORCE_FSTYPE, since Lustre cannot run on this
machine). Both write the same bytes and return the same CRC-32Cs, on 1 rank and on 2."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coci_hpc.checkpoint import h5_parallel, lustre
from coci_hpc.checkpoint.integrity import CHECKSUM, checksum
from coci_hpc.checkpoint.rawio import WriteItem

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("on_lustre", [False, True], ids=["ext4-pwrite", "lustre-mpiio"])
def test_the_parallel_writer_pwrites_off_lustre_and_writes_collectively_on_lustre(
        comm: Any, shared_dir: Path, monkeypatch: pytest.MonkeyPatch, on_lustre: bool) -> None:
    if not h5_parallel.available(comm):
        pytest.skip("plain pytest: the parallel backend needs mpiexec (this runs in the mpi phases)")
    calls: list[str] = []
    for name in ("write_mpiio", "write_posix"):
        real = getattr(h5_parallel, name)
        monkeypatch.setattr(h5_parallel, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    tuning = lustre.decide(on_lustre, lustre.LustrePolicy(), comm.size, None)
    path = shared_dir / f"data-{on_lustre}.bin"
    n = 3 << 20
    if comm.rank == 0:
        path.write_bytes(b"")
    comm.barrier()
    mine = np.random.default_rng(comm.rank).integers(0, 256, n, dtype=np.uint8)
    crcs = h5_parallel.ParallelH5Writer(comm).write(path, [WriteItem(comm.rank * n, mine)], tuning)
    assert calls == (["write_mpiio"] if on_lustre else ["write_posix"])
    assert crcs == [checksum(mine, CHECKSUM)]
    comm.barrier()
    data = np.fromfile(path, dtype=np.uint8)
    assert data.nbytes == comm.size * n
    assert np.array_equal(data[comm.rank * n:(comm.rank + 1) * n], mine)
    comm.barrier()
