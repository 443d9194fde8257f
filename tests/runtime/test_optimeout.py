"""gloo's per-op timeout follows the session's peer deadline (runtime/optimeout.py): a peer that
goes silent inside the user's DDP allreduce (a frozen host: no reset) is detected within the bound,
a slow but live one is not taken for lost, and the original timeout comes back at the end."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from coci_hpc.runtime.optimeout import FACTOR, WARMUP_STEPS, OpTimeout


@pytest.fixture
def gloo_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=120))
    try:
        yield dist.group.WORLD._get_backend(torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_bound_after_warmup_follows_the_deadline_and_is_restored(gloo_one) -> None:
    ot = OpTimeout(backend=gloo_one)
    assert ot.original_s == 120.0
    for _ in range(WARMUP_STEPS - 1):
        ot.observe(5.0)
    assert gloo_one.options._timeout.total_seconds() == 120.0     # the first steps are not typical
    ot.observe(5.0)
    assert gloo_one.options._timeout.total_seconds() == FACTOR * 5.0
    ot.observe(5.5)                                                # a small drift: left as it is
    assert gloo_one.options._timeout.total_seconds() == FACTOR * 5.0
    ot.observe(30.0)                                               # slower steps: a longer bound
    assert gloo_one.options._timeout.total_seconds() == FACTOR * 30.0
    ot.observe(1000.0)                                             # never past what the user set
    assert gloo_one.options._timeout.total_seconds() == 120.0
    ot.observe(5.0)
    ot.restore()
    assert gloo_one.options._timeout.total_seconds() == 120.0 and ot.bound_s is None


def test_one_process_or_no_group_is_left_alone() -> None:
    assert not OpTimeout().active           # no process group: nothing to bound
    OpTimeout().observe(5.0)


def _rank(rank: int, port: int, q) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    model = DDP(torch.nn.Linear(4, 1))
    ot = OpTimeout()
    for _ in range(WARMUP_STEPS):
        model(torch.ones(2, 4)).sum().backward()
        ot.observe(1.0)                      # the session's deadline: bound = FACTOR x 1 s
    # A slow but live peer: rank 1 is late by half the bound; rank 0 must not give up.
    if rank == 1:
        time.sleep(0.5 * FACTOR)
    model(torch.ones(2, 4)).sum().backward()
    q.put((rank, "slow step ok"))
    if rank == 1:
        q.close()
        q.join_thread()                       # its message out before it freezes
        os.kill(os.getpid(), signal.SIGSTOP)  # a host that stops answering: its sockets stay open
        return
    t = time.monotonic()
    try:
        model(torch.ones(2, 4)).sum().backward()
        q.put((rank, "no error"))
    except RuntimeError as exc:
        q.put((rank, f"raised after {time.monotonic() - t:.2f}s: {exc}"))


def test_frozen_peer_raises_within_the_bound_a_slow_one_does_not() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = []
        while len(got) < 3:
            assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
            try:
                got.append(q.get(timeout=1))
            except queue.Empty:
                assert time.monotonic() - t0 < 120, got
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    print(got)
    assert sorted(m for r, m in got if m == "slow step ok") == ["slow step ok"] * 2
    (last,) = [m for r, m in got if r == 0 and m != "slow step ok"]
    assert last.startswith("raised after") and "Timed out" in last, last
    waited = float(last.split()[2].rstrip("s:"))
    assert FACTOR * 1.0 - 0.2 <= waited < FACTOR * 1.0 + 3.0, last     # the bound, not gloo's 120 s
