"""The test harness's ``run_ranks`` (tests/conftest.py) under real mpiexec: a rank that fails ends
the job at once with its own message (the others are waiting for it in a collective), and a job
that does not finish in time is ended with every rank, its output shown.

Before, a failed rank waited in MPI_Finalize for ranks that waited in a barrier for it: the test
hung until its timeout (300 s for the HSDP survivors' test) and showed no cause."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import run_ranks

FAILS = """
import sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
if comm.rank == 1:
    time.sleep(0.5)
    {exit}
comm.barrier()          # rank 0 waits here for a rank that is gone
print("rank", comm.rank, "passed the barrier", flush=True)
"""

STUCK = """
import os, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
open(os.path.join(sys.argv[1], f"pid.{comm.rank}"), "w").write(str(os.getpid()))
print("rank", comm.rank, "started", flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("exit", ['raise RuntimeError("rank 1 fails on purpose")',
                                  'raise SystemExit("rank 1 fails on purpose")'])
def test_a_failed_rank_ends_the_job_with_its_message(tmp_path: Path, exit: str) -> None:
    script = tmp_path / "fails.py"
    script.write_text(FAILS.format(exit=exit))
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run_ranks(2, str(script), timeout=120)
    took = time.monotonic() - t0
    assert "failed (" in str(err.value) and "did not finish" not in str(err.value)
    assert "rank 1 fails on purpose" in str(err.value)
    assert "passed the barrier" not in str(err.value)
    assert took < 60, f"the failed rank's job took {took:.0f} s to end"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not reaped yet) is gone for this purpose: it runs nothing and holds no pipe
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_job_past_its_timeout_is_ended_with_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run_ranks(2, str(script), str(tmp_path), timeout=15)
    took = time.monotonic() - t0
    assert "did not finish in 15 s" in str(err.value)
    assert "started" in str(err.value)            # what the ranks printed before, shown
    assert took < 15 + 40                         # SIGTERM (+30 s grace, + kill) at most
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:                                # do not leave them to the next test either
        subprocess.run(["kill", "-9", str(p)], check=False)
    assert not left, f"ranks {left} outlived their mpiexec"
