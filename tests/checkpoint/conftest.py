"""Fixtures for checkpoint tests that run the same under plain pytest, `mpiexec -n 1` and `-n 2`."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from coci_hpc.comm import Comm
from tests.conftest import ROOT, clean_env, run_ranks  # noqa: F401  (re-exported for the tests here)

FAKES = Path(__file__).resolve().parent / "fakes"
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture
def comm() -> Comm:
    return Comm.world()


@pytest.fixture
def shared_dir(comm: Comm):
    """A temp directory every rank sees: rank 0 creates it and broadcasts the path."""
    path = comm.bcast(tempfile.mkdtemp(prefix="coci-ckpt-test-") if comm.rank == 0 else None)
    yield Path(path)
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
