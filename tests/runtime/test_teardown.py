"""coci_hpc.runtime.teardown: the exit hook destroys init_distributed's group and waits for quiet."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

from coci_hpc.runtime import teardown
from tests.conftest import ROOT, clean_env


def test_quiesce_returns_once_no_other_thread_runs() -> None:
    t0 = time.monotonic()
    assert teardown.quiesce(limit_s=5.0)
    assert time.monotonic() - t0 < 2.0


def test_quiesce_gives_up_at_its_limit_while_a_thread_keeps_running() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        assert not teardown.quiesce(limit_s=0.3)
        assert 0.3 <= time.monotonic() - t0 < 3.0
    finally:
        stop.set()
        th.join()


SCRIPT = """
import atexit, torch, torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))  # runs last
import coci_hpc
info = coci_hpc.init_distributed()
t = torch.ones(3)
dist.all_reduce(t)
print("source", info.source, flush=True)
"""


def test_the_group_init_distributed_created_is_destroyed_at_exit() -> None:
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=clean_env(), cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "source single" in p.stdout
    assert "initialized at exit: False" in p.stdout, p.stdout
    assert "destroy_process_group" not in p.stderr


def test_a_group_the_script_created_is_left_to_it() -> None:
    script = SCRIPT.replace("import coci_hpc\n", "import coci_hpc\ndist.init_process_group('gloo', "
                            "store=dist.HashStore(), rank=0, world_size=1)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=clean_env(), cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "source initialized" in p.stdout and "initialized at exit: True" in p.stdout, p.stdout
