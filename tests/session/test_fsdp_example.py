"""examples/train_fsdp.py (FSDP2, the same four session lines) under mpiexec -n 2: stopped by a
signal after a checkpoint and started again, it ends bit-identical to an uninterrupted run; its
event log says why a lost rank would fall back to the last checkpoint (its shards exist nowhere
else), and coci-status prints it."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from coci_hpc.history import build, render_text
from coci_hpc.runtime.events import read_events
from tests.conftest import ROOT, clean_env, reference_hash, reference_run, run_ranks

TRAIN = str(ROOT / "examples" / "train_fsdp.py")
ARGS = ["--steps", "12", "--policy", "fixed:4", "--seed", "1"]
MPIEXEC = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2"]


def test_fsdp2_example_stopped_and_resumed_ends_bit_identical(tmp_path: Path) -> None:
    ref = reference_hash(reference_run(2, "-m", "mpi4py", TRAIN, *ARGS, ckpt_dir=tmp_path / "ref", timeout=300).stdout)
    run = tmp_path / "run"
    cmd = [*MPIEXEC, sys.executable, "-m", "mpi4py", TRAIN, *ARGS, "--ckpt-dir", str(run), "--step-time", "0.3"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while not any(e["event"] == "checkpoint" for e in read_events(run)):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.2)
    p.send_signal(signal.SIGUSR1)            # mpiexec forwards it to both ranks
    out = p.communicate(timeout=180)[0]
    assert "final_params_sha256" not in out and "stopped at step" in out, out[-3000:]
    assert reference_hash(run_ranks(2, "-m", "mpi4py", TRAIN, *ARGS, "--ckpt-dir", str(run), "--step-time", "0.3",
                           timeout=300).stdout) == ref
    starts = [e for e in read_events(run) if e["event"] == "attempt_start"]
    assert len(starts) == 2 and starts[-1]["resumed_step"] >= 4
    # FSDP2 shards: the memory tier (runtime/memtier.py) covers a lost rank, so the survivors count
    # (Laplace's 1/2 before any failure) and nothing says they are off.
    assert starts[-1]["memory_tier_every"] == 10 and starts[-1]["survivors_off"] is None
    assert starts[-1]["survivor_coverage"] == 0.5
    assert "memory tier on: every 10 step(s)" in out
    assert "on a lost rank: no survivors' save" not in render_text(build(read_events(run), str(run)))
