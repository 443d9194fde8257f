"""A run that finished exits 0, every time: no abort at interpreter exit (issue 37).

A gloo worker thread drops its last reference to a collective's work item a moment after the
caller's ``wait()`` returned. When that reference is the last one to a tensor whose Python object
is already gone, the drop needs the GIL; if the interpreter has begun to finalize by then, the
thread is ended inside C++ and the process aborts (exit 134, "terminate called without an active
exception") after its work was done. Only process exits show it, so this test launches real
processes: ``mpiexec -n 2`` jobs, each a separate exit, and asserts that every one ends with 0.

The three kinds of job, in turn: the damaged-step fallback load of tests/checkpoint (step 2 fails
its CRC, the load falls back to step 1), a normal load, and ``examples/train_fsdp.py`` (a Session
run that ends, with FSDP2 collectives up to its last line, no ``destroy_process_group()`` of its
own). Before the fix about 1 launch in 14 aborted on this machine.

A second test needs no MPI: one process whose last collective is still running in a gloo worker
when the script ends (an ``async_op=True`` never waited), 32 launches; before the fix 11 in 96
aborted on this machine.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.checkpoint.test_ckpt_box_shards import FC2, _flip, job
from tests.conftest import ROOT, clean_env

pytestmark = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")

RUNS = 30                                                    # process launches (each one exit per rank)
PARALLEL = 2                                                 # launches at a time
BOX_JOB = str(ROOT / "tests" / "checkpoint" / "scripts" / "box_job.py")
TRAIN = str(ROOT / "examples" / "train_fsdp.py")


def _launch(args: list[str]) -> tuple[int, str]:
    cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "mpi4py", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=300)
    return p.returncode, p.stdout + p.stderr


UNWAITED = """
import torch, torch.distributed as dist
import coci_hpc
coci_hpc.init_distributed()
for _ in range(50):
    dist.all_reduce(torch.ones(64))
dist.all_reduce(torch.ones(1 << 16), async_op=True)   # never waited: still in a gloo worker at exit
print("done", flush=True)
"""


def test_a_collective_left_in_a_gloo_thread_does_not_abort_the_exit() -> None:
    def one(_: int) -> tuple[int, str]:
        p = subprocess.run([sys.executable, "-c", UNWAITED], capture_output=True, text=True, env=clean_env(),
                           cwd=ROOT, timeout=120)
        return p.returncode, p.stdout + p.stderr

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(32)))
    bad = [(rc, out) for rc, out in results if rc != 0 or "done" not in out]
    assert not bad, f"{len(bad)} of {len(results)} exits failed, first (exit {bad[0][0]}):\n{bad[0][1][-2000:]}"


def test_finished_jobs_exit_0_every_time(tmp_path: Path) -> None:
    good = tmp_path / "good"
    job(2, "save", good, "tp", 1)
    job(2, "save", good, "tp", 2)
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    _flip(damaged, 2, FC2, 0, 4)          # step 2 fails its CRC: the load falls back to step 1
    kinds = [
        ("fallback load", lambda i: [BOX_JOB, "load", str(damaged), "tp"], '"step": 1'),
        ("normal load", lambda i: [BOX_JOB, "load", str(good), "tp"], '"step": 2'),
        ("session run", lambda i: [TRAIN, "--steps", "4", "--policy", "fixed:2",
                                   "--ckpt-dir", str(tmp_path / f"run{i}")], "final_params_sha256="),
    ]
    plan = [(i, *kinds[i % len(kinds)]) for i in range(RUNS)]

    def one(item: tuple) -> tuple[str, int, str, str]:
        i, name, args, expect = item
        rc, out = _launch(args(i))
        return name, rc, out, expect

    with ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(one, plan))
    bad = [(name, rc, out) for name, rc, out, expect in results if rc != 0 or expect not in out]
    warned = [name for name, _, out, _ in results if "destroy_process_group() was not called" in out]
    summary = f"{len(bad)} of {len(results)} launches failed: " + ", ".join(f"{n} (exit {rc})" for n, rc, _ in bad)
    assert not bad, summary + "\n\nfirst failure's output:\n" + bad[0][2][-4000:]
    assert not warned, f"PyTorch warned that destroy_process_group() was not called: {warned}"
