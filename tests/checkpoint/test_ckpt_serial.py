"""The serial fallback: same format without MPI-IO (no mpi4py at all, or h5py without MPI)."""
from __future__ import annotations

import json

import pytest

from coci_hpc.checkpoint import CheckpointManager, h5_parallel
from coci_hpc.checkpoint import catalog as cat
from tests.checkpoint.conftest import run_ranks
from tests.checkpoint.helpers import canonical, empty_state, full_state

NO_MPI = """
import sys, json
sys.modules["mpi4py"] = None          # as if mpi4py were not installed
from coci_hpc.checkpoint import CheckpointManager
from tests.checkpoint.helpers import canonical, empty_state, full_state
mgr = CheckpointManager(sys.argv[1])
s = full_state(3)
mgr.save(1, s)
mgr.save_async(2, s)
mgr.close()
t = empty_state()
mgr.load_latest(t)
print("RESULT " + json.dumps({"backend": mgr.writer.name, "same": canonical(t) == canonical(s),
                              "steps": [c.step for c in mgr.list()], "mpi": "mpi4py.MPI" in sys.modules}))
"""


@pytest.mark.timeout(120)
def test_works_without_mpi4py(tmp_path):
    p = run_ranks(0, "-c", NO_MPI, str(tmp_path))
    res = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert res == {"backend": "hdf5-serial", "same": True, "steps": [1, 2], "mpi": False}
    assert cat.read_manifest(cat.step_dir(tmp_path, 2))["backend"] == "hdf5-serial"


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_h5py_without_mpi_falls_back_to_serial_on_all_ranks(shared_dir, comm, monkeypatch):
    monkeypatch.setattr(h5_parallel, "available", lambda c: False)
    mgr = CheckpointManager(shared_dir, comm=comm)
    assert mgr.writer.name == "hdf5-serial"
    s = full_state(8, comm.rank, comm.size)
    mgr.save(1, s)
    t = empty_state(comm.rank, comm.size)
    mgr.load(1, t)
    assert canonical(t) == canonical(s)
    assert cat.read_manifest(cat.step_dir(shared_dir, 1))["world_size"] == comm.size
