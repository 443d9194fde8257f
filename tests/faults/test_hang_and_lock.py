"""A rank that hangs during a save (detected by the timeout, reported naming it, nothing
committed) and two runs pointed at one checkpoint directory (issue 8 #11: the second is refused
up front by a lock naming the holder; a dead holder's lock is recognised and taken over)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from coci_hpc.checkpoint import catalog as cat
from tests.conftest import ROOT, clean_env
from tests.faults.test_exit import JOB, launch, results

pytestmark = pytest.mark.timeout(300)


def test_a_rank_whose_background_write_hangs_is_named_on_every_rank_and_nothing_commits(tmp_path, record_figure):
    rc, out, seconds = launch(2, "hang", str(tmp_path / "ck"), "async", timeout=120)
    assert rc == 0, out
    rows = results(out)
    assert len(rows) == 2, out
    for r in rows:
        assert r["failed"] == [1] and "did not finish within 3 s on rank 1" in r["error"], r
        assert r["seconds"] < 30 and r["latest"] == 1 and not r["step2"], r
    record_figure("hung rank during a save", runs=1, detected=1, committed=0)


def test_a_rank_whose_synchronous_write_hangs_aborts_the_job_naming_it(tmp_path, record_figure):
    rc, out, seconds = launch(2, "hang", str(tmp_path / "ck"), "sync", timeout=120)
    assert rc not in (0, 124), f"exit {rc} (124: hung)\n{out}"
    assert "rank 1: saving checkpoint step 2 did not finish within 3 s (stuck writing its data)" in out
    assert cat.committed_steps(tmp_path / "ck") == [1]
    record_figure("hung rank during a save", runs=1, detected=1, committed=0)


def _hold(root, ranks: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, JOB, "hold", str(root), "120"]
    if ranks:
        cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(ranks), *cmd]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=clean_env(), cwd=ROOT, start_new_session=True)
    line = p.stdout.readline()
    assert line.startswith("RESULT"), line + p.stdout.read()
    return p


def test_a_second_run_on_the_same_directory_is_refused_up_front_naming_the_holder(tmp_path, record_figure):
    root = tmp_path / "ck"
    holder = _hold(root)
    try:
        for ranks in (0, 2):
            rc, out, _ = launch(ranks, "exit_async", str(root), timeout=120)
            assert rc != 0, out
            assert f"in use by another writer: (pid {holder.pid} on {socket.gethostname()}" in out, out
            assert cat.scan(root) == [], "the refused run wrote nothing"
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # dies holding the lock, as a crashed run does
        holder.wait()
    rc, out, _ = launch(0, "exit_async", str(root), timeout=120)   # the stale lock is taken over
    assert rc == 0, out
    assert cat.committed_steps(root) == [1, 2]
    record_figure("two runs on one directory", second_refused=2, stale_taken_over=1)
