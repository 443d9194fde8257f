"""The survivors' save under NCCL (coci_hpc/runtime/ncclwatch.py): a watcher thread notices a lost
peer while the main thread waits in a collective that never returns, the process groups are
aborted so that the wait ends, and the survivors save from host copies only.

NCCL itself needs a GPU per rank; its failure behaviour is emulated by the FAKE backend of
tests/runtime/fake_nccl.py (over gloo). In process: the watcher against a communicator whose
peer never answers, torch's abort reaching the fake's wait. Under ``mpiexec -n 2`` (the Session,
real MPI, the fake backend): rank 1 freezes inside a step (SIGSTOP: a host that stopped), rank 0
waits in the gradient allreduce that never returns; with the watcher it saves the memory tier's
host copy within the peer deadline and a resume from it is bit-exact with an uninterrupted run;
without it the same hang blocks."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from coci_hpc.runtime import ncclwatch
from tests.conftest import ROOT, clean_env, reference_hash, reference_run_later, run_ranks
from tests.runtime import fake_nccl

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "nccl_job.py")


# -- the watcher, in process ---------------------------------------------------------------------
class _Request:
    def __init__(self, done: bool) -> None:
        self.done = done

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return self.done


class _Comm:
    """The watcher's MPI communicator: every round answered (a MAX over one rank: the value sent)
    until ``silent`` is set (a peer gone: the round never completes)."""

    def __init__(self) -> None:
        self.silent = False
        self.rounds = 0

    def Iallreduce(self, send: Any, recv: Any, op: Any) -> _Request:  # noqa: N802 - mpi4py's name
        self.rounds += 1
        if self.silent:
            return _Request(False)
        recv[:] = send
        return _Request(True)


def _watch(comm: _Comm, deadline: float) -> tuple[ncclwatch.NcclWatch, list[tuple[str, float]]]:
    called: list[tuple[str, float]] = []
    w = ncclwatch.NcclWatch(comm, lambda: deadline, heartbeat_s=0.05, poll_s=0.01)
    w.start(lambda how, t: called.append((how, t)))
    return w, called


def test_a_silent_peer_is_declared_lost_at_the_deadline_while_the_main_thread_waits() -> None:
    comm = _Comm()
    w, called = _watch(comm, deadline=0.5)
    time.sleep(0.3)
    assert comm.rounds >= 3 and not w.fired.is_set()          # rounds answered: nothing to declare
    comm.silent = True
    t0 = time.monotonic()
    assert w.fired.wait(5.0)
    waited = time.monotonic() - t0
    assert 0.5 <= waited < 0.5 + 1.0, waited                   # the deadline, plus at most a heartbeat and polls
    [(how, t_fail)] = called
    assert "did not complete within 0.5s" in how and "inside a step" in how
    assert abs(t_fail - (time.time() - waited)) < 0.3          # the silence began when the round did
    w.stop(0.1)


def test_a_main_thread_that_keeps_reaching_boundaries_is_not_taken_for_stuck() -> None:
    """The watcher's round is silent, but the main thread passes boundaries (its own step agreement
    detects a loss there): nothing is declared until the main thread stops coming back."""
    comm = _Comm()
    comm.silent = True
    w, called = _watch(comm, deadline=0.4)
    end = time.monotonic() + 1.2                               # 3 deadlines of boundaries
    while time.monotonic() < end:
        w.boundary()
        time.sleep(0.05)
    assert not w.fired.is_set() and called == []
    assert w.fired.wait(5.0)                                   # no boundary since: declared
    w.stop(0.1)


def test_once_declared_the_main_thread_is_held_at_its_next_boundary() -> None:
    comm = _Comm()
    comm.silent = True
    w, _ = _watch(comm, deadline=0.2)
    assert w.fired.wait(5.0)
    back = threading.Thread(target=w.boundary, daemon=True)   # the main thread, back from an aborted wait
    back.start()
    back.join(0.5)
    assert back.is_alive()                                     # held: the survivors' save ends the process
    w._release.set()
    back.join(1.0)
    assert not back.is_alive()


def test_the_watchers_stop_together_after_a_round_whose_max_says_stop() -> None:
    from mpi4py import MPI

    w = ncclwatch.NcclWatch(MPI.COMM_SELF.Dup(), lambda: 1.0, heartbeat_s=0.02, poll_s=0.005)
    called: list[Any] = []
    w.start(lambda *a: called.append(a))
    time.sleep(0.2)
    t0 = time.monotonic()
    assert w.stop() is True and time.monotonic() - t0 < 0.5
    assert w.rounds >= 2 and called == []


def test_a_device_copy_that_returns_after_the_abort_never_becomes_a_host_copy() -> None:
    """The memory tier under NCCL: the abort can end a `.cpu()` at the boundary that waited on the hung
    stream; what it copied may be a half-finished step. The peer-loss path freezes the tier before it
    aborts: that copy is dropped, and the slot it was rewriting is not posted (its old bytes are gone)."""
    from mpi4py import MPI

    from coci_hpc.runtime import memtier

    state = {"w": torch.arange(6.0)}
    tier = memtier.MemoryTier(lambda: state, MPI.COMM_SELF.Dup(), 1, every=1)   # its own partner
    tier.boundary(1)
    tier.boundary(2)
    assert sorted(s.step for _, s in tier.held()) == [1, 2, 2]

    def aborted_while_copying() -> dict[str, torch.Tensor]:
        tier.frozen = True                   # the watcher froze the tier and aborted meanwhile
        state["w"].fill_(float("nan"))       # what the stream ran after the hung collective
        return state
    tier.state_fn = aborted_while_copying
    tier.boundary(3)
    held = sorted(s.step for _, s in tier.held())
    assert held == [2, 2], held              # step 3 never whole; step 1's slot was being rewritten
    step2 = next(s for r, s in tier.held() if s in tier.own)
    assert step2.snapshot().leaves[0].array.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


# -- the abort, a world of one rank on the fake backend, each in a fresh process -------------------
# Not in pytest's process: creating, aborting and destroying process groups there, test after test,
# once aborted the whole worker (gloo's init after an earlier test's abort, "Fatal Python error:
# Aborted", 1 run in 6 on a loaded machine), and a crash of a pytest-xdist worker fails the phase.
@contextmanager
def _fake_world() -> Iterator[Any]:
    fake_nccl.register()
    dist.init_process_group(fake_nccl.NAME, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _in_fresh_process(body: str) -> None:
    """Run this module's function ``body`` in a new interpreter; its assertion error is the test's."""
    p = subprocess.run([sys.executable, "-c", f"from tests.runtime import test_ncclwatch as m; m.{body}()"],
                       capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, f"{body} failed in its own process (status {p.returncode}):\n{p.stdout}{p.stderr}"


def _backend_decides() -> None:
    with _fake_world():
        assert ncclwatch.backend_hangs()                       # "fakenccl": NCCL's behaviour
        t = torch.ones(3)
        dist.all_reduce(t)                                     # and it still moves data (gloo underneath)
        assert t.tolist() == [1.0, 1.0, 1.0]
    assert not ncclwatch.backend_hangs()                       # no group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not ncclwatch.backend_hangs()                   # gloo raises where NCCL hangs
    finally:
        dist.destroy_process_group()


def _abort_ends_the_wait() -> None:
    with _fake_world() as world:
        work = fake_nccl.FakeNcclWork(world.pending)           # a collective whose peer is gone
        world.pending.works.add(work)
        raised: list[BaseException] = []

        def main_thread() -> None:
            try:
                work.wait()
            except RuntimeError as exc:
                raised.append(exc)
        th = threading.Thread(target=main_thread, daemon=True)
        th.start()
        th.join(0.3)
        assert th.is_alive() and raised == []                  # it hangs
        res = ncclwatch.abort_groups()
        assert res.done and res.seconds < 2.0, res
        th.join(2.0)
        assert not th.is_alive() and "aborted" in str(raised[0])
        assert not dist.is_initialized()                       # every group is gone after the abort


def test_the_backend_decides_whether_a_lost_peer_hangs_gloo_or_no_group_does_not() -> None:
    _in_fresh_process("_backend_decides")


def test_torchs_abort_ends_a_wait_that_never_returns_with_an_error() -> None:
    _in_fresh_process("_abort_ends_the_wait")


def test_an_abort_that_blocks_does_not_hold_up_the_save() -> None:
    # The abort never returns while it is waited for (an Event set only after): the wait ends at
    # its timeout, far from the abort's own end. The bound is loose (a loaded CI machine took
    # 1.85 s to come back from a 0.2 s join, 2026-11-29); the abort would hold it up for 60 s.
    release = threading.Event()
    try:
        res = ncclwatch.abort_groups(timeout_s=0.2, abort=lambda: release.wait(60))
    finally:
        release.set()
    assert not res.done and 0.2 <= res.seconds < 20 and "had not returned" in res.describe()
    res = ncclwatch.abort_groups(abort=lambda: 1 / 0)
    assert not res.done and "ZeroDivisionError" in res.describe()


# -- the Session under mpiexec -n 2, the fake backend ---------------------------------------------
STEPS, FREEZE_AT, K = 10, 6, 2       # copies at steps 2 and 4; rank 1 freezes inside step 6 (5 done)
JOB_ENV = {"COCI_MEMTIER_K": str(K), "COCI_PEER_TIMEOUT_S": "1", "COCI_POLICY": "fixed:3"}


def _peer_lost(root: Path) -> list[dict[str, Any]]:
    path = root / "events.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == "peer_lost"]


def _frozen_run(root: Path, *, watch: bool, give_s: float = 60.0) -> tuple[float, int | None, str]:
    """The job with rank 1 frozen inside step FREEZE_AT: (when it froze, mpiexec's status or None
    when the run was still going ``give_s`` after the freeze and was ended here, its output)."""
    env = clean_env(**JOB_ENV, NCCL_JOB_FREEZE_AT=str(FREEZE_AT), **({} if watch else {"NCCL_JOB_NO_WATCH": "1"}))
    cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-quiet", "-n", "2", sys.executable, "-m", "mpi4py",
           SCRIPT, "--steps", str(STEPS), "--ckpt-dir", str(root)]
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT) as proc:
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
        reader.start()
        end = time.monotonic() + 120
        while not any(l.startswith("FROZEN ") for l in lines):
            assert proc.poll() is None and time.monotonic() < end, "".join(lines)
            time.sleep(0.05)
        frozen = float(next(l for l in lines if l.startswith("FROZEN ")).split()[1])
        try:
            rc: int | None = proc.wait(timeout=max(0.0, frozen + give_s - time.time()))
        except subprocess.TimeoutExpired:
            rc = None
            proc.send_signal(signal.SIGTERM)    # mpiexec ends its ranks (the stopped one with SIGKILL)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(5)
    return frozen, rc, "".join(lines)


def test_a_frozen_peer_under_nccl_survivors_save_the_host_copy_and_resume_bit_exactly(tmp_path: Path) -> None:
    ref = reference_run_later(2, SCRIPT, "--steps", str(STEPS), ckpt_dir=tmp_path / "ref")   # meanwhile
    root = tmp_path / "run"
    frozen, rc, out = _frozen_run(root, watch=True)
    assert rc is not None, f"the survivor did not leave after the peer froze:\n{out}"
    [rec] = _peer_lost(root)
    # The host copy of the memory tier's newest whole step (4; 5 steps done: 1 step lost <= k),
    # rank 1's from its partner's copy, never the device state of the half-finished step 6.
    assert rec["committed"] and rec["tier"] == "memory" and rec["saved_from"] == "host", rec
    assert rec["step"] == 4 and rec["lost_ranks"] == [1] and rec["survivor"] == 0, rec
    assert "NCCL watcher" in rec["how"] and "process groups aborted" in rec["how"], rec
    # The peer deadline is 1 s (COCI_PEER_TIMEOUT_S, steps of ms); a heartbeat, the abort and the
    # save come on top. Loose: the machine the tests run on is shared.
    assert rec["commit_wall"] - frozen < 1.0 + 5.0, (rec, frozen)
    assert "survivors save from host copies only" in out
    assert "FAKE NCCL ABORT rank 0: 1 waiting collective(s) released" in out   # the hung allreduce's wait
    resumed = run_ranks(2, SCRIPT, "--steps", str(STEPS), "--ckpt-dir", str(root), env=clean_env(**JOB_ENV))
    assert "resuming from step 4" in resumed.stderr, resumed.stderr
    assert reference_hash(resumed.stdout) == reference_hash(ref.result().stdout)


def test_without_the_watcher_the_same_hang_blocks(tmp_path: Path) -> None:
    """The test above could fail: with the watcher left out, rank 0 waits in the allreduce that never
    returns, long past the peer deadline, and nothing is saved."""
    root = tmp_path / "run"
    _, rc, out = _frozen_run(root, watch=False, give_s=5.0)    # 5x the peer deadline
    assert rc is None, f"the run ended although nothing could end its wait:\n{out}"
    assert _peer_lost(root) == [] and "peer lost" not in out
