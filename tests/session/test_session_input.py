"""What Session() refuses at once instead of an hour later, and what it gives back after its loop
(issue 12, items 4 and 10): a plain DataLoader in the state, a state the store cannot save, a
total_steps below the latest checkpoint, torchrun's WORLD_SIZE beside a one-rank MPI world, and
coci-submit's placeholder signal handlers after the loop."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from coci_hpc.comm import Comm
from coci_hpc.errors import UsageError
from coci_hpc.runtime import distributed, signals
from coci_hpc.session import Session
from coci_hpc.submit.runner import hold_signals

ENV: dict[str, str] = {}      # not in a Slurm job, no COCI_* settings


def _model() -> dict:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    return {"model": m, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1)}


def test_a_plain_dataloader_is_refused_with_the_stateful_hint(tmp_path: Path) -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2)
    with pytest.raises(UsageError) as e:
        Session({**_model(), "loader": loader}, 10, ckpt_dir=tmp_path, policy="fixed:5", environ=ENV)
    assert "StatefulDataLoader" in str(e.value) and "ResumableSampler" in str(e.value)


def test_a_stateful_dataloader_is_saved_per_rank_without_pickle_and_resumes(tmp_path: Path) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = torch.utils.data.TensorDataset(torch.arange(40.0))

    def make():
        return sdl.StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    ref = [b[0].tolist() for b, _ in zip(make(), range(7))]
    loader = make()
    s = Session({**_model(), "loader": loader}, 3, ckpt_dir=tmp_path, policy="fixed:100", environ=ENV)
    it = iter(loader)
    got = []
    for _ in s.steps():
        got.append(next(it)[0].tolist())
    loader2 = make()
    s2 = Session({**_model(), "loader": loader2}, 7, ckpt_dir=tmp_path, policy="fixed:100", environ=ENV)
    it2 = None
    for _ in s2.steps():
        it2 = it2 or iter(loader2)           # after the restore (the first step)
        got.append(next(it2)[0].tolist())
    assert got == ref


def test_a_state_the_store_cannot_save_is_refused_at_session(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR2)    # (an earlier test's session may have left its own)
    with pytest.raises(UsageError) as e:
        Session({**_model(), "extras": {"lock": threading.Lock()}}, 10, ckpt_dir=tmp_path, policy="fixed:5",
                environ=ENV)
    assert "cannot be checkpointed" in str(e.value) and "extras" in str(e.value)
    assert not list(tmp_path.glob("step*")), "nothing saved"
    assert signal.getsignal(signal.SIGUSR2) is before, "handlers given back"


def test_total_steps_below_the_latest_checkpoint_says_so(tmp_path: Path) -> None:
    s = Session(_model(), 10, ckpt_dir=tmp_path, policy="fixed:5", environ=ENV)
    for _ in s.steps():
        pass
    s = Session(_model(), 6, ckpt_dir=tmp_path, policy="fixed:5", environ=ENV)
    with pytest.raises(UsageError) as e:
        for _ in s.steps():
            raise AssertionError("no step may run")
    assert "total_steps=6 is lower than the step of the latest checkpoint" in str(e.value) and "(10)" in str(e.value)
    s = Session(_model(), 12, ckpt_dir=tmp_path, policy="fixed:5", environ=ENV)
    assert list(s.steps()) == [10, 11]     # the checkpoint of step 10 is intact


def test_torchrun_world_size_wins_over_a_one_rank_mpi_world(monkeypatch: pytest.MonkeyPatch) -> None:
    class Singleton:                       # what mpi4py's COMM_WORLD is under torchrun
        def Get_rank(self) -> int:
            return 0

        def Get_size(self) -> int:
            return 1
    monkeypatch.setattr(Comm, "world", classmethod(lambda cls: cls(Singleton())))
    with pytest.raises(UsageError) as e:
        distributed.default_comm({"WORLD_SIZE": "2", "RANK": "0"})
    assert "init_distributed" in str(e.value)
    assert distributed.default_comm({}).is_mpi            # a real one-rank MPI run stays MPI


def test_after_the_loop_coci_submits_placeholders_give_the_default_action_back(tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in signals.SHIELDED}
    early = hold_signals()
    try:
        s = Session(_model(), 2, ckpt_dir=tmp_path, policy="fixed:5", environ=ENV)
        for _ in s.steps():
            assert signal.getsignal(signal.SIGUSR2) != early._handle   # the Session owns it
        # the run completed: a late time-limit / preemption warning must not kill the exiting
        # process (Slurm would record the finished job as FAILED); SIGTERM keeps its default
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in signals.LATE_WARNINGS)
        os.kill(os.getpid(), signal.SIGUSR2)   # would end this test process under SIG_DFL
        time.sleep(0.1)
        mine = lambda *a: None             # noqa: E731  a user's own handler is left alone
        signal.signal(signal.SIGUSR1, mine)
        signals.after_session(completed=True)
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_torchrun_with_mpi4py_imported_runs_as_two_ranks(tmp_path: Path) -> None:
    """Two processes with torchrun's variables whose script imports mpi4py first (an MPI singleton
    world of 1 in each): before, each took itself for the only rank and they fought over one
    checkpoint directory."""
    import socket
    import subprocess
    import sys

    from coci_hpc.runtime.events import read_events
    from tests.conftest import ROOT, clean_env
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    code = ("import sys, runpy; from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 1; "
            f"sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path({str(ROOT / 'examples' / 'train.py')!r}, "
            "run_name='__main__')")
    args = ["--steps", "20", "--policy", "fixed:10", "--ckpt-dir", str(tmp_path)]
    procs = [subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=str(port)))
             for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [e["ranks"] for e in read_events(tmp_path) if e["event"] == "attempt_start"] == [2], outs[0][-2000:]
