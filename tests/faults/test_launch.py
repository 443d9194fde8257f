"""A multi-process launch without MPI (issue 8 #4): torchrun, or srun without --mpi, used to make
every process rank 0 of 1, all writing the same step directory. Each is refused, nothing written."""
from __future__ import annotations

import subprocess
import sys

import pytest

from coci_hpc.checkpoint import catalog as cat
from tests.conftest import ROOT, clean_env
from tests.faults.test_exit import JOB

pytestmark = pytest.mark.timeout(300)


def _run_all(cmds_envs) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
             for cmd, env in cmds_envs]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=180)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    return out


def test_torchrun_without_a_covering_communicator_is_refused(tmp_path, record_figure):
    root = tmp_path / "ck"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    (p,) = _run_all([([*torchrun, JOB, "exit_async", str(root)], clean_env())])
    assert p.returncode != 0, p.stdout
    assert "torchrun (WORLD_SIZE) started 2 processes" in p.stdout and "mpi4py" in p.stdout, p.stdout
    assert cat.scan(root) == []
    record_figure("multi-process launch without MPI", launches=1, written=0)


def test_srun_without_mpi_is_refused_on_every_task(tmp_path, record_figure):
    root = tmp_path / "ck"
    # What srun without --mpi gives each task: its Slurm rank variables, no MPI launcher variables.
    runs = _run_all([([sys.executable, JOB, "exit_async", str(root)],
                      clean_env(SLURM_JOB_ID="4242", SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2",
                                SLURM_PROCID=str(r))) for r in range(2)])
    for p in runs:
        assert p.returncode != 0, p.stdout
        assert "srun (SLURM_STEP_NUM_TASKS) started 2 processes" in p.stdout, p.stdout
    assert cat.scan(root) == []
    record_figure("multi-process launch without MPI", launches=1, written=0)
