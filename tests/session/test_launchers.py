"""examples/train.py under each launcher: plain python, mpiexec -n 2, and torch.distributed alone
(torchrun-style RANK/WORLD_SIZE, no MPI: the Session then uses TorchComm). Interrupted and started
again with the same arguments, it ends with the parameters of the uninterrupted run."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from coci_hpc.runtime.events import read_events
from tests.conftest import ROOT, clean_env, reference_hash, reference_run, run_ranks

TRAIN = str(ROOT / "examples" / "train.py")
ARGS = ["--steps", "80", "--policy", "fixed:20", "--seed", "3"]


def _torch_only(ckpt: Path, extra: list[str], stop_rank1_at: str | None = None) -> list[str]:
    """Two processes with torchrun's variables and no MPI launcher; returns each one's output."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, TRAIN, *ARGS, "--ckpt-dir", str(ckpt), *extra], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=str(port)))
             for r in (0, 1)]
    if stop_rank1_at is not None:          # only rank 1 gets the signal: both must stop at one step
        deadline = time.monotonic() + 120
        while not any(e["event"] == "checkpoint" for e in read_events(ckpt)):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGUSR1)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return outs


def test_ddp_without_mpi_matches_mpiexec_and_resumes_bit_exactly(tmp_path: Path) -> None:
    ref = reference_hash(reference_run(2, "-m", "mpi4py", TRAIN, *ARGS, ckpt_dir=tmp_path / "mpi", timeout=300).stdout)
    assert reference_hash(_torch_only(tmp_path / "torch", [])[0]) == ref
    out = _torch_only(tmp_path / "stop", ["--step-time", "0.02"], stop_rank1_at="checkpoint")[0]
    assert "final_params_sha256" not in out and "stopped at step" in out
    ev = read_events(tmp_path / "stop")
    assert [e["ranks"] for e in ev if e["event"] == "attempt_start"] == [2]
    assert reference_hash(_torch_only(tmp_path / "stop", ["--step-time", "0.02"])[0]) == ref  # the same run
    # one process, plain python: resumes a 1-rank run after a hard kill
    one = reference_hash(reference_run(0, TRAIN, *ARGS, ckpt_dir=tmp_path / "one").stdout)
    p = subprocess.Popen([sys.executable, TRAIN, *ARGS, "--ckpt-dir", str(tmp_path / "kill"), "--step-time", "0.02"],
                         cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(e["event"] == "checkpoint" for e in read_events(tmp_path / "kill")):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    p.kill()
    p.wait()
    assert reference_hash(run_ranks(0, TRAIN, *ARGS, "--ckpt-dir", str(tmp_path / "kill"), "--step-time", "0.02").stdout) == one
    starts = [e for e in read_events(tmp_path / "kill") if e["event"] == "attempt_start"]
    assert starts[-1]["prev_end"]["reason"] == "crash" and starts[-1]["resumed_step"] >= 20
