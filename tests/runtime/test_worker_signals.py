"""Slurm's stop signals reach every process of a job step (issue 12, item 4): DataLoader workers,
forked before Session() or spawned, must not die of them, and the run must stop, save and resume
bit-exactly, at the batch the loop consumed (torchdata's StatefulDataLoader in the state).

Here the step's processes are this test's child and its process group: ``killpg`` delivers the
signal to every one of them, as slurmstepd does (the end-to-end run on the cluster is in
tests/runtime/test_worker_signals_cluster.py)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coci_hpc.runtime.events import read_events
from tests.conftest import ROOT, clean_env, reference_hash

pytest.importorskip("torchdata")
SCRIPT = str(ROOT / "examples" / "train_workers.py")
ARGS = ["--steps", "30", "--policy", "fixed:10"]


def _run(ckpt: Path, *extra: str, signal_at_step: int | None = None, signum: int = signal.SIGUSR2,
         timeout: float = 300) -> tuple[int, str]:
    out = ckpt.parent / f"{ckpt.name}-{time.monotonic_ns()}.out"
    with open(out, "w") as fh:
        p = subprocess.Popen([sys.executable, SCRIPT, *ARGS, "--ckpt-dir", str(ckpt), *extra], cwd=ROOT,
                             stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                             env=clean_env(COCI_SHIELD_SIGNALS="1"))
        try:
            if signal_at_step is not None:
                deadline = time.monotonic() + timeout
                while f"step={signal_at_step} " not in out.read_text():
                    assert p.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
                    time.sleep(0.1)
                os.killpg(p.pid, signum)      # the rank AND its workers, as Slurm does
            p.wait(timeout=timeout)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, out.read_text()


def test_workers_fork_and_spawn_survive_the_stop_signal_and_resume_bit_exactly(tmp_path: Path) -> None:
    rc, text = _run(tmp_path / "ref")
    assert rc == 0, text[-3000:]
    ref = reference_hash(text)
    rc, text = _run(tmp_path / "run", "--step-time", "0.2", signal_at_step=14)
    assert rc == 0 and "killed by signal" not in text and "exited unexpectedly" not in text, text[-3000:]
    assert "final_params_sha256" not in text and "stopped at step" in text, text[-3000:]
    stop = [e for e in read_events(tmp_path / "run") if e["event"] == "stop"]
    assert len(stop) == 1 and stop[0]["step"] >= 14, stop
    rc, text = _run(tmp_path / "run", "--step-time", "0.2")     # the same command (one run, one directory)
    assert rc == 0, text[-3000:]
    assert reference_hash(text) == ref
    resumed = [e for e in read_events(tmp_path / "run") if e["event"] == "attempt_start"][-1]
    assert resumed["resumed_step"] == stop[0]["step"]
    # the resumed attempt trained exactly the steps after the stop, each once
    assert re.findall(r"^step=(\d+) ", text, re.M) == [str(s) for s in range(stop[0]["step"] + 1, 31)]


def test_sigterm_to_every_process_leaves_the_workers_alive_and_the_process_exits(tmp_path: Path) -> None:
    # scancel and SIGTERM-only preemption: SIGTERM to the rank and its workers. A worker that died
    # of it would fail the run ("exited unexpectedly"); a deaf worker must not keep the process
    # from exiting (multiprocessing's exit would wait for it forever: the session kills it).
    # multiprocessing's resource tracker, started lazily by the first spawn, unblocks SIGTERM in
    # the caller: the shield starts it first, else the spawned workers here would die of SIGTERM.
    t0 = time.monotonic()
    rc, text = _run(tmp_path / "run", "--step-time", "0.2", signal_at_step=14, signum=signal.SIGTERM, timeout=240)
    assert "killed by signal" not in text and "exited unexpectedly" not in text, text[-3000:]
    assert rc in (0, 143) and "final_params_sha256" not in text, (rc, text[-3000:])
    assert time.monotonic() - t0 < 240
