"""init_distributed: the backend choice (torch.cuda and init_process_group mocked), the MPI rendezvous's
port and job check, and a rank that never arrives (real processes, a real TCPStore)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from coci_hpc.comm import Comm
from coci_hpc.errors import CommError, UsageError
from coci_hpc.runtime import distributed
from coci_hpc.runtime.distributed import NCCL_WITH_CPU, init_distributed
from tests.conftest import ROOT


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.update(device=d))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(distributed.errorexit, "install", lambda: None)
    monkeypatch.setattr(distributed, "_store", lambda *a: seen.update(store=a))
    monkeypatch.setattr(distributed, "_all_joined", lambda *a: seen.update(joined=a[1:]))
    monkeypatch.setattr(distributed, "rendezvous",
                        lambda comm=None, **kw: ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "3",
                                            "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "env"))
    return seen


def test_nccl_comes_with_a_cpu_backend(calls: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # DCP's async save refuses NCCL alone ("A CPU backend must be enabled for async save"), seen
    # on the first GPU run; control paths on host tensors must not queue behind NCCL either
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    info = init_distributed()
    assert calls["backend"] == NCCL_WITH_CPU == "cpu:gloo,cuda:nccl"
    assert info.backend == "cpu:gloo,cuda:nccl" and "nccl" in info.backend
    assert calls["device"] == 3                     # the local rank's GPU
    assert (info.rank, info.world_size, info.local_rank) == (1, 2, 3)


def test_gloo_without_cuda(calls: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert init_distributed().backend == "gloo"
    assert calls["backend"] == "gloo" and "device" not in calls


def test_an_explicit_backend_is_kept(calls: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert init_distributed("nccl").backend == "nccl"
    assert calls["backend"] == "nccl" and calls["device"] == 3


class _FakeMPI:
    """An mpi4py communicator of `size` ranks seen from `rank`: bcast returns what rank 0 sent
    (``root_value`` for the other ranks)."""

    def __init__(self, rank: int, size: int = 2, root_value: Any = None) -> None:
        self.rank, self.size, self.root_value = rank, size, root_value
        self.sent: Any = None

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self.sent = obj
        return obj if self.rank == root else self.root_value


def test_mpi_rendezvous_publishes_a_port_rank_0_already_listens_on() -> None:
    # Binding port 0, closing and binding again leaves the port free in between: another process,
    # or a TCP connection's local end, could take it. Rank 0 keeps it bound until the store does.
    fake = _FakeMPI(0)
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    vals, src = distributed.rendezvous(Comm(fake), environ=env, listen=True)
    port = int(vals["MASTER_PORT"])
    assert src == "mpi" and fake.sent == (socket.gethostname(), port, "7")
    try:
        with pytest.raises(OSError), socket.socket() as other:
            other.bind(("", port))             # still rank 0's: nobody else can take it
    finally:
        distributed._listeners.pop(port).close()
    # A caller that starts its own store there (tcp://) gets a port that is free again.
    vals, _ = distributed.rendezvous(Comm(_FakeMPI(0)), environ=env)
    assert int(vals["MASTER_PORT"]) not in distributed._listeners
    with socket.socket() as s:
        s.bind(("", int(vals["MASTER_PORT"])))


def test_mpi_rendezvous_refuses_another_jobs_address() -> None:
    fake = _FakeMPI(1, root_value=("vm", 1234, "8"))
    with pytest.raises(UsageError, match="job 8"):
        distributed.rendezvous(Comm(fake), environ={"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    vals, _ = distributed.rendezvous(Comm(_FakeMPI(1, root_value=("vm", 1234, "7"))),
                                     environ={"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    assert (vals["MASTER_ADDR"], vals["MASTER_PORT"], vals["RANK"]) == ("vm", "1234", "1")


RANK0 = """
import os, sys, time
sys.path.insert(0, {root!r})
import coci_hpc
import coci_hpc.runtime.distributed   # torch and torch.distributed, before any go
go = os.environ.get("TEST_GO_FILE")     # imported already: say so, wait for the test's go, then start at once
if go:
    open(go + ".ready", "w").close()
while go and not os.path.exists(go):
    time.sleep(0.02)
slow = os.environ.get("TEST_SLOW_JOIN_FILE")   # rank 1's init_process_group returns 3 s after its handshake
if slow and os.environ["RANK"] == "1":
    import torch.distributed as dist
    handshake = dist.init_process_group
    def slow_return(*args, **kwargs):
        handshake(*args, **kwargs)
        time.sleep(3)
        open(slow, "w").close()
    dist.init_process_group = slow_return
coci_hpc.init_distributed()
print("INITIALISED")
if slow:
    print("RANK 1 JOINED" if os.path.exists(slow) else "RANK 1 NOT JOINED")
"""


def _rank(rank: int, port: int, timeout_s: float, tmp: Path, **extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "COCI_DIST_TIMEOUT_S": str(timeout_s), **extra}
    script = tmp / "rank.py"
    script.write_text(RANK0.format(root=str(ROOT)))
    return subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def test_a_rank_that_never_arrives_is_named_and_the_waiting_rank_prints_its_stack(tmp_path: Path) -> None:
    p = _rank(0, _port(), 6, tmp_path)                  # rank 1 never starts
    out, err = p.communicate(timeout=90)
    assert p.returncode == CommError.exit_code, err
    assert "Traceback" not in err and "INITIALISED" not in out
    assert "rank(s) [1] of 2 did not reach the rendezvous" in err and "COCI_DIST_TIMEOUT_S" in err
    # the watchdog: this rank's own stack, printed before the timeout, in init_distributed
    assert "Timeout (0:00:01)!" in err and "in init_distributed" in err


def test_two_ranks_meet_and_the_watchdog_stays_quiet(tmp_path: Path) -> None:
    port = _port()
    ranks = [_rank(r, port, 30, tmp_path) for r in (0, 1)]
    for p in ranks:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0 and "INITIALISED" in out, err
        assert "Timeout (" not in err                  # cancelled once the group exists


def test_under_torchruns_agent_store_every_rank_is_a_client(tmp_path: Path) -> None:
    """torchrun's agent serves the store at MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), as
    torch's own env:// rendezvous expects: rank 0 serving it too would find the port taken."""
    from datetime import timedelta

    agent = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=30), wait_for_workers=False)
    agent.set(f"{distributed.ARRIVED_KEY}0/1", "a worker of the attempt before")   # not this attempt's
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1"}
    ranks = [_rank(r, agent.port, 30, tmp_path, **env) for r in (0, 1)]
    _all_initialised(ranks)
    assert agent.check([f"{distributed.ARRIVED_KEY}1/0", f"{distributed.ARRIVED_KEY}1/1"])


def test_no_rank_returns_before_every_rank_has_its_process_group(tmp_path: Path) -> None:
    """gloo's handshake can return on rank 0 while rank 1 is still inside it; a rank 0 that then
    exits (a script ending or failing right after it starts) closed the connection under rank 1
    ("Connection closed by peer" and a traceback, seen under load). Here rank 1's
    init_process_group returns 3 s late: rank 0 must not have returned before it."""
    port = _port()
    slow = tmp_path / "rank1-joined"
    ranks = [_rank(r, port, 30, tmp_path, TEST_SLOW_JOIN_FILE=str(slow)) for r in (0, 1)]
    out0, err0 = ranks[0].communicate(timeout=90)
    out1, err1 = ranks[1].communicate(timeout=90)
    assert ranks[0].returncode == 0 and ranks[1].returncode == 0, err0 + err1
    assert "RANK 1 JOINED" in out0 and "INITIALISED" in out1, out0 + err0


def _all_initialised(ranks: list[subprocess.Popen[str]]) -> None:
    done = [p.communicate(timeout=90) for p in ranks]
    report = "\n".join(f"--- rank {r}: exit {p.returncode}\n{err[-3000:]}" for r, (p, (_, err)) in
                        enumerate(zip(ranks, done)))
    assert all(p.returncode == 0 and "INITIALISED" in out for p, (out, _) in zip(ranks, done)), report


def _agent_store() -> tuple[dist.TCPStore, dict[str, str]]:
    from datetime import timedelta

    agent = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)
    return agent, {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


def _wait_for(predicate: Any, what: str, within_s: float = 90) -> None:
    import time

    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {within_s}s"
        time.sleep(0.02)


def test_a_rank_0_that_arrives_longer_than_the_timeout_after_the_others_still_meets_them(tmp_path: Path) -> None:
    """Rank 1 reaches the rendezvous first and rank 0 only 9 s later, more than the 8-s timeout
    after it: gloo's handshake, which counts its timeout from each rank's start of it, would give
    up on rank 1 (a DistStoreError traceback; rank 0 "Connection closed by peer", seen in CI under
    load). Every rank now waits for all of them before the handshake starts."""
    import time

    agent, env = _agent_store()
    go = tmp_path / "go"
    rank1 = _rank(1, agent.port, 8, tmp_path, **env)
    rank0 = _rank(0, agent.port, 8, tmp_path, TEST_GO_FILE=str(go), **env)
    _wait_for(lambda: agent.check([f"{distributed.ARRIVED_KEY}0/1"]), "arrival of rank 1")
    arrived = time.monotonic()
    # rank 0 imported, so that what is left after the go is init_distributed alone (a slow import
    # under load would otherwise eat the margin: 9 s late of the 16 s rank 1 waits for rank 0)
    _wait_for(lambda: Path(f"{go}.ready").exists(), "rank 0's imports")
    time.sleep(max(0.0, arrived + 9 - time.monotonic()))
    go.touch()
    _all_initialised([rank0, rank1])


def test_a_rank_that_gave_up_on_rank_0_fails_rank_0_too_in_one_line(tmp_path: Path) -> None:
    """Rank 1 waits 2 x the timeout for rank 0, gives up (exit 8, one line, no traceback) and says
    so in the store: rank 0, arriving after, raises that instead of starting a handshake with a
    rank that has gone."""
    agent, env = _agent_store()
    go = tmp_path / "go"
    rank0 = _rank(0, agent.port, 2, tmp_path, TEST_GO_FILE=str(go), **env)
    rank1 = _rank(1, agent.port, 2, tmp_path, **env)
    out1, err1 = rank1.communicate(timeout=90)
    go.touch()
    out0, err0 = rank0.communicate(timeout=90)
    for p, out, err in ((rank0, out0, err0), (rank1, out1, err1)):
        assert p.returncode == CommError.exit_code, err
        assert "Traceback" not in err and "INITIALISED" not in out
    assert "error: rank 1 had no word from rank 0 at the rendezvous" in err1 and "within 4s of arriving" in err1
    assert "rank 0 reached the rendezvous after another rank gave up: rank 1 had no word" in err0


def test_the_ranks_that_did_arrive_name_the_one_that_did_not_as_rank_0_does(tmp_path: Path) -> None:
    """Rank 2 of 3 never starts: rank 0 names it (exit 8) and rank 1, which arrived, raises the
    same, one line, instead of timing out inside gloo's handshake with a traceback."""
    port = _port()
    ranks = [_rank(r, port, 3, tmp_path, WORLD_SIZE="3") for r in (0, 1)]
    for p in ranks:
        out, err = p.communicate(timeout=90)
        assert p.returncode == CommError.exit_code, err
        assert "Traceback" not in err and "INITIALISED" not in out
        assert "rank(s) [2] of 3 did not reach the rendezvous" in err, err
    assert "rank 0's rendezvous failed: rank(s) [2] of 3" in err
