"""Fixtures for checkpoint tests that run the same under plain pytest, `mpiexec -n 1` and `-n 2`."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from coci_hpc.comm import Comm

ROOT = Path(__file__).resolve().parents[2]
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


def clean_env(**extra: str) -> dict[str, str]:
    """Environment for a child mpiexec/python: no MPI variables inherited from this process."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "OPAL_", "PRTE_", "HYDRA_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_ranks(n: int, *args: str, timeout: float = 120, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    """Run ``python args...`` on n ranks under mpiexec (n=0: plain python, no MPI)."""
    cmd = [sys.executable, *args]
    if n:
        cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(n), *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=ROOT)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p
