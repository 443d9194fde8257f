"""The Session in one process: one collective per step (counted with a fake comm), stop -> save ->
clean exit -> bit-exact resume, giving up, handler ownership, requeue retries, rendezvous precedence."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coci_hpc.comm import Comm
from coci_hpc.errors import GaveUpError, SlurmError
from coci_hpc.runtime.data import ResumableSampler
from coci_hpc.runtime.distributed import rendezvous
from coci_hpc.runtime.events import read_events
from coci_hpc.runtime.preemption import requeue_with_retries
from coci_hpc.session import Session


class CountingComm(Comm):
    """A one-rank communicator that counts every collective the session makes."""

    def __init__(self) -> None:
        super().__init__(None)
        self.calls: list[str] = []

    def _count(self, name: str) -> None:
        self.calls.append(name)

    def bcast(self, obj, root=0):  # type: ignore[override]
        self._count("bcast")
        return obj

    def allgather(self, obj):  # type: ignore[override]
        self._count("allgather")
        return [obj]

    def allreduce_max(self, value):  # type: ignore[override]
        self._count("allreduce_max")
        return value

    def allreduce_min(self, value):  # type: ignore[override]
        self._count("allreduce_min")
        return value

    def barrier(self) -> None:
        self._count("barrier")

    def iallreduce_max_array(self, send: np.ndarray, recv: np.ndarray) -> Any:
        self._count("iallreduce_max_array")
        recv[:] = send
        return Done()


class Done:
    def wait(self) -> None:
        pass


def _training(seed: int = 0) -> tuple[dict[str, Any], Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 7, 0.5)
    sampler = ResumableSampler(64, seed=seed)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True)

    def step() -> torch.Tensor:
        idx = torch.from_numpy(sampler.next_batch(8))
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return loss.detach()

    return {"model": model, "optimizer": opt, "scheduler": sched, "loader": sampler}, step


def _params(state: dict) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state["model"].parameters()]


NO_SLURM: dict[str, str] = {}


@pytest.mark.parametrize("policy", ["fixed:1000", "young"])
def test_one_collective_per_step(tmp_path: Path, policy: str) -> None:
    comm = CountingComm()
    state, train_step = _training()
    s = Session(state, 60, ckpt_dir=tmp_path, policy=policy, comm=comm, environ=NO_SLURM,
                failure_model=None if policy.startswith("fixed") else _mtbf())
    per_step = []
    for _ in s.steps():
        before = len(comm.calls)
        s.observe(train_step())
        yield_gap_start = before
        per_step.append(yield_gap_start)
    # calls made between consecutive yields = the step boundary's work
    marks = per_step + [len(comm.calls)]
    boundary = [comm.calls[marks[i]:marks[i + 1]] for i in range(len(marks) - 1)]
    plain = [b for b in boundary[:-1] if b == ["iallreduce_max_array"]]
    # every boundary that did not save is exactly one small allreduce; saves are rare
    assert len(plain) >= 50, boundary
    assert all(b.count("iallreduce_max_array") == 1 for b in boundary[:-1])


def _mtbf():
    from coci_hpc.planner.failures import from_mtbf
    return from_mtbf(3600.0)


def _run_until_signal(tmp_path: Path, at: int, total: int) -> None:
    state, train_step = _training()
    s = Session(state, total, ckpt_dir=tmp_path, policy="fixed:10", environ=NO_SLURM)
    with pytest.raises(SystemExit) as e:
        for step in s.steps():
            s.observe(train_step())
            if step == at:
                os.kill(os.getpid(), signal.SIGUSR2)   # arrives inside a step; acted on at its end
    assert e.value.code == 0


def test_stop_saves_at_the_boundary_and_resume_is_bit_exact(tmp_path: Path) -> None:
    ref_state, ref_step = _training()
    ref = Session(ref_state, 40, ckpt_dir=tmp_path / "ref", policy="fixed:10", environ=NO_SLURM)
    for _ in ref.steps():
        ref.observe(ref_step())

    before = signal.getsignal(signal.SIGUSR2)
    _run_until_signal(tmp_path / "run", at=22, total=40)
    assert signal.getsignal(signal.SIGUSR2) == before            # handlers restored after the session
    state, train_step = _training()
    s = Session(state, 40, ckpt_dir=tmp_path / "run", policy="fixed:10", environ=NO_SLURM)
    seen = []
    for step in s.steps():
        seen.append(step)
        s.observe(train_step())
    assert seen[0] == 24                # stopped one boundary after the signal; nothing repeated or skipped
    assert all(torch.equal(a, b) for a, b in zip(_params(state), _params(ref_state)))
    ev = read_events(tmp_path / "run")
    stop = [e for e in ev if e["event"] == "stop"]
    assert stop and stop[0]["step"] == 24 and stop[0]["requeued"] is False and stop[0]["signal"] == "SIGUSR2"
    start2 = [e for e in ev if e["event"] == "attempt_start"][1]
    assert start2["prev_end"]["reason"] == "preemption" and start2["resumed_step"] == 24 and start2["steps_lost"] == 0
    assert [e["kind"] for e in ev if e["event"] == "checkpoint"] == ["planned", "planned", "stop", "planned", "final"]
    assert ev[-1]["event"] == "end" and ev[-1]["status"] == "completed"
    losses = [s for e in ev if e["event"] == "losses" for s in e["steps"]]
    assert losses == list(range(1, 41))                           # every step's loss, once


def test_submitits_handler_does_not_run_while_the_session_owns_the_signal(tmp_path: Path) -> None:
    called = []
    old = signal.signal(signal.SIGUSR2, lambda s, f: called.append(s))
    try:
        _run_until_signal(tmp_path, at=3, total=20)
        assert called == []
        os.kill(os.getpid(), signal.SIGUSR2)
        assert called == [signal.SIGUSR2]                        # and it is back afterwards
    finally:
        signal.signal(signal.SIGUSR2, old)


def _slurm_env(restart: int, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "99", "SLURM_RESTART_COUNT": str(restart), "SLURM_JOB_NODELIST": "n[1-2]",
            "SLURM_JOB_PARTITION": "gpu", **extra}


FIX = Path(__file__).resolve().parent.parent / "fixtures" / "slurm"


def _local(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def show_job(*, left_s: float | None = 480.0, preempt_ago_s: float | None = None, state: str = "RUNNING",
             restarts: int = 0) -> str:
    """A recorded `scontrol show job` (the running job) with the fields the session reads set."""
    text = (FIX / "scontrol_show_job_running.txt").read_text()
    now = time.time()
    end = "Unknown" if left_s is None else _local(now + left_s)
    pre = "None" if preempt_ago_s is None else _local(now - preempt_ago_s)
    text = re.sub(r"EndTime=\S+", f"EndTime={end}", text)
    text = re.sub(r"PreemptTime=\S+", f"PreemptTime={pre}", text)
    text = re.sub(r"JobState=\S+", f"JobState={state}", text)
    return re.sub(r"Restarts=\d+", f"Restarts={restarts}", text)


class FakeSlurm:
    """Slurm's commands as the session calls them; `scontrol show ...` answers with recorded output."""

    def __init__(self, rows: str, job: str | None = None, fail_requeue: int = 0) -> None:
        self.rows, self.fail_requeue, self.calls = rows, fail_requeue, []
        self.job = job if job is not None else show_job()

    def __call__(self, argv):
        self.calls.append(list(argv))
        if argv[0] == "sacct":
            return self.rows
        if argv[:3] == ["scontrol", "show", "job"]:
            return self.job
        if argv[:3] == ["scontrol", "show", "partition"]:
            return (FIX / "scontrol_show_partition.txt").read_text()
        if argv[:3] == ["scontrol", "show", "config"]:
            return (FIX / "scontrol_show_config_no_user_signal.txt").read_text()
        if argv[:2] == ["scontrol", "requeue"]:
            if self.fail_requeue:
                self.fail_requeue -= 1
                raise SlurmError("slurm_requeue error: Unable to contact slurm controller")
            return ""
        raise SlurmError(f"unexpected {argv}")

    def requeued(self) -> bool:
        return any(c[:2] == ["scontrol", "requeue"] for c in self.calls)


def test_in_a_slurm_job_the_stop_requeues_and_the_next_attempt_is_classified(tmp_path: Path) -> None:
    slurm = FakeSlurm("99|RUNNING|2026-11-22T10:00:00|Unknown|n[1-2]\n", show_job(left_s=480), fail_requeue=1)
    state, train_step = _training()
    s = Session(state, 30, ckpt_dir=tmp_path, policy="fixed:10", environ=_slurm_env(0, COCI_SIGNAL_LEAD_S="30"),
                runner=slurm)
    with pytest.raises(SystemExit):
        for step in s.steps():
            s.observe(train_step())
            if step == 4:
                os.kill(os.getpid(), signal.SIGUSR2)
    assert [c[:2] for c in slurm.calls].count(["scontrol", "requeue"]) == 2     # one transient failure, retried
    stop = [e for e in read_events(tmp_path) if e["event"] == "stop"][0]
    assert (stop["reason"], stop["requeued"]) == ("preemption", True)            # 480 s left >> 30 s lead

    rows = ("99|REQUEUED|2026-11-22T10:00:00|2026-11-22T10:00:20|n[1-2]\n"
            "99|RUNNING|2026-11-22T10:00:40|Unknown|n[1-2]\n")
    state, train_step = _training()
    s = Session(state, 30, ckpt_dir=tmp_path, policy="fixed:10", environ=_slurm_env(1), runner=FakeSlurm(rows))
    for _ in s.steps():
        s.observe(train_step())
    start = [e for e in read_events(tmp_path) if e["event"] == "attempt_start"][-1]
    assert start["prev_end"]["reason"] == "preemption" and start["prev_end"]["source"] == "session"
    assert start["nodes"] == ["n1", "n2"] and start["restart_count"] == 1
    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"][-1]
    assert set(resumed["restart_latency_s"]) == {"total", "after_last_step_s", "slurm_requeue_s", "process_start_s",
                                                 "restore_s"}


NODE_FAIL_ROWS = ("99|NODE_FAIL|2026-11-22T10:00:00|2026-11-22T10:00:20|n1\n"
                  "99|RUNNING|2026-11-22T10:00:40|Unknown|n1\n")


def _crash_after(s: Session, n: int) -> None:
    it = s.steps()
    for _ in range(n):
        next(it)
    it.close()                         # the process "dies" inside the step


def test_max_requeues_counts_node_failures_and_gives_up_without_training(tmp_path: Path) -> None:
    for rc in (0, 1):                  # the first attempt and one restart after a node failure
        state, _ = _training()
        _crash_after(Session(state, 30, ckpt_dir=tmp_path, policy="fixed:10", runner=FakeSlurm(NODE_FAIL_ROWS),
                             environ=_slurm_env(rc, COCI_MAX_REQUEUES="1")), 3)
    state, _ = _training()
    s = Session(state, 30, ckpt_dir=tmp_path, policy="fixed:10", environ=_slurm_env(2, COCI_MAX_REQUEUES="1"),
                runner=FakeSlurm(NODE_FAIL_ROWS))
    with pytest.raises(GaveUpError, match="max-requeues 1"):
        for _ in s.steps():
            raise AssertionError("must not train")
    end = read_events(tmp_path)[-1]
    assert end["event"] == "end" and end["status"] == "gave_up" and "requeued 2 times after unannounced" in end["message"]


def test_stops_for_time_limit_or_preemption_never_count_against_max_requeues(tmp_path: Path) -> None:
    # The 44th time-limit continuation of a healthy --max-requeues 10 run stops, saves and requeues
    # (the old rule gave up once SLURM_RESTART_COUNT reached the limit).
    rows = "99|REQUEUED|2026-11-22T10:00:00|2026-11-22T10:00:20|n1\n99|RUNNING|2026-11-22T10:00:40|Unknown|n1\n"
    slurm = FakeSlurm(rows, show_job(left_s=60))
    state, train_step = _training()
    s = Session(state, 30, ckpt_dir=tmp_path, policy="fixed:10", runner=slurm,
                environ=_slurm_env(44, COCI_MAX_REQUEUES="10", COCI_SIGNAL_LEAD_S="90"))
    with pytest.raises(SystemExit) as e:
        for step in s.steps():
            s.observe(train_step())
            if step == 4:
                os.kill(os.getpid(), signal.SIGUSR2)
    assert e.value.code == 0 and slurm.requeued()
    stop = [x for x in read_events(tmp_path) if x["event"] == "stop"][0]
    assert (stop["reason"], stop["requeued"], stop["saved"]) == ("time_limit", True, True)


def test_no_progress_counts_this_jobs_restarts_only(tmp_path: Path) -> None:
    for _ in range(4):                 # runs by hand that die before their first checkpoint never brick it
        state, _ = _training()
        _crash_after(Session(state, 30, ckpt_dir=tmp_path, policy="fixed:100", no_progress_limit=2,
                             environ=NO_SLURM), 1)
    rows = "99|FAILED|2026-11-22T10:00:00|2026-11-22T10:00:20|n1\n99|RUNNING|2026-11-22T10:00:40|Unknown|n1\n"
    for rc in range(3):                # one job whose restarts keep dying: the third restart refuses
        state, _ = _training()
        s = Session(state, 30, ckpt_dir=tmp_path, policy="fixed:100", no_progress_limit=2,
                    environ=_slurm_env(rc), runner=FakeSlurm(rows))
        if rc < 2:
            _crash_after(s, 1)
            continue
        with pytest.raises(GaveUpError, match="no-progress"):
            next(s.steps())
    state, _ = _training()             # resubmitted (a new job): it trains again
    s = Session(state, 30, ckpt_dir=tmp_path, policy="fixed:100", no_progress_limit=2,
                environ=_slurm_env(0, SLURM_JOB_ID="100"), runner=FakeSlurm(rows))
    _crash_after(s, 1)


def test_requeue_retries_then_names_the_fix() -> None:
    slurm = FakeSlurm("", fail_requeue=10)
    sleeps: list[float] = []
    with pytest.raises(SlurmError, match="failed 3 times") as e:
        requeue_with_retries("5", slurm, tries=3, sleep=sleeps.append)
    assert sleeps == [1.0, 2.0] and "scontrol requeue" in (e.value.hint or "")
    assert requeue_with_retries("5", FakeSlurm("", fail_requeue=1), sleep=sleeps.append) == 2


def test_rendezvous_precedence() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "5"}
    assert rendezvous(Comm.serial(), environ={**env, **_slurm_env(0, SLURM_PROCID="0", SLURM_NTASKS="2")}) == \
        ({"MASTER_ADDR": "h", "MASTER_PORT": "5", "RANK": "1", "WORLD_SIZE": "4"}, "env")
    vals, src = rendezvous(Comm.serial(), environ=_slurm_env(0, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0"))
    assert src == "slurm" and vals == {"MASTER_ADDR": "n1", "MASTER_PORT": str(20000 + 99), "RANK": "1",
                                       "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert rendezvous(Comm.serial(), environ={}) == ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "single")


def _sigterm_at(tmp_path: Path, slurm: FakeSlurm, at: int = 13, restart: int = 0) -> int:
    state, train_step = _training()
    s = Session(state, 30, ckpt_dir=tmp_path, policy="fixed:10", environ=_slurm_env(restart), runner=slurm)
    with pytest.raises(SystemExit) as e:
        for step in s.steps():
            s.observe(train_step())
            if step == at:
                os.kill(os.getpid(), signal.SIGTERM)
    return int(e.value.code)


def _stop_and_ckpts(tmp_path: Path) -> tuple[dict, list[tuple[int, str]]]:
    ev = read_events(tmp_path)
    stop = [x for x in ev if x["event"] == "stop"][-1]
    return stop, [(x["step"], x["kind"]) for x in ev if x["event"] == "checkpoint"]


def _requeued_attempt_start(tmp_path: Path) -> dict:
    """The next attempt after a stop at step 15: it resumes at 15; its attempt_start record."""
    rows = "99|REQUEUED|2026-11-22T10:00:00|2026-11-22T10:00:20|n1\n99|RUNNING|2026-11-22T10:00:40|Unknown|n1\n"
    state, _ = _training()
    s = Session(state, 30, ckpt_dir=tmp_path, policy="fixed:10", environ=_slurm_env(1), runner=FakeSlurm(rows))
    it = s.steps()
    assert next(it) == 15
    start = [x for x in read_events(tmp_path) if x["event"] == "attempt_start"][-1]
    it.close()
    return start


def test_sigterm_preemption_saves_and_requeues(tmp_path: Path) -> None:
    # No preempt_send_user_signal: SIGTERM at the start of the grace time, PreemptTime in Slurm's record.
    slurm = FakeSlurm("99|RUNNING|2026-11-22T10:00:00|Unknown|n1\n", show_job(preempt_ago_s=1, state="SIGNALING"))
    assert _sigterm_at(tmp_path, slurm) == 0
    stop, ckpts = _stop_and_ckpts(tmp_path)
    assert (stop["reason"], stop["requeued"], stop["saved"], stop["step"]) == ("preemption", True, True, 15)
    assert ckpts == [(10, "planned"), (15, "stop")] and slurm.requeued()
    assert ["scontrol", "show", "partition", "gpu"] in slurm.calls          # the window is the GraceTime
    start = _requeued_attempt_start(tmp_path)
    assert start["prev_end"]["reason"] == "preemption" and start["steps_lost"] == 0


def test_sigterm_from_scancel_saves_and_is_not_requeued(tmp_path: Path) -> None:
    slurm = FakeSlurm("99|RUNNING|2026-11-22T10:00:00|Unknown|n1\n", show_job(state="COMPLETING"))
    assert _sigterm_at(tmp_path, slurm) == 0
    stop, ckpts = _stop_and_ckpts(tmp_path)
    assert (stop["reason"], stop["requeued"], stop["saved"]) == ("cancelled", False, True)
    assert ckpts == [(10, "planned"), (15, "stop")] and not slurm.requeued()
    assert ["scontrol", "show", "config"] in slurm.calls                    # the window is KillWait


def test_sigterm_of_a_requeue_by_hand_saves_and_leaves_the_requeue_to_slurm(tmp_path: Path) -> None:
    slurm = FakeSlurm("99|RUNNING|2026-11-22T10:00:00|Unknown|n1\n", show_job(state="COMPLETING", restarts=1))
    assert _sigterm_at(tmp_path, slurm) == 0
    stop, ckpts = _stop_and_ckpts(tmp_path)
    assert (stop["reason"], stop["requeued"], stop["saved"]) == ("requeue_by_hand", False, True)
    assert not slurm.requeued()
    start = _requeued_attempt_start(tmp_path)
    assert start["prev_end"]["reason"] == "requeue_by_hand" and start["steps_lost"] == 0


def test_a_save_that_cannot_end_before_the_kill_is_skipped_and_the_preempted_job_still_requeues(
        tmp_path: Path) -> None:
    # The grace time (20 s) ended 5 s ago: any measured save would be cut off.
    slurm = FakeSlurm("99|RUNNING|2026-11-22T10:00:00|Unknown|n1\n", show_job(preempt_ago_s=25, state="SIGNALING"))
    assert _sigterm_at(tmp_path, slurm) == 0
    stop, ckpts = _stop_and_ckpts(tmp_path)
    assert (stop["reason"], stop["requeued"], stop["saved"]) == ("preemption", True, False)
    assert ckpts == [(10, "planned")] and slurm.requeued()
    assert "would not end before" in stop["detail"]


def test_a_session_that_fails_to_start_gives_the_signals_back(tmp_path: Path) -> None:
    from coci_hpc.errors import UsageError

    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    state, _ = _training()
    with pytest.raises(UsageError, match="keep"):
        Session(state, 10, ckpt_dir=tmp_path, policy="fixed:5", keep=0, environ=NO_SLURM)
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_short_signal_lead_stops_at_the_signals_own_boundary_and_warns_at_the_next_start(tmp_path: Path) -> None:
    # 0.5 s steps against a 2 s lead: two steps + the requeue allowance do not fit, so the ranks
    # agree at each boundary itself (decided after the attempt's first 3 timed steps).
    env = {"COCI_SIGNAL_LEAD_S": "2"}
    state, train_step = _training()
    s = Session(state, 12, ckpt_dir=tmp_path, policy="fixed:100", environ=env)
    with pytest.raises(SystemExit):
        for step in s.steps():
            s.observe(train_step())
            time.sleep(0.5)
            if step == 5:
                os.kill(os.getpid(), signal.SIGUSR2)
    stop = [e for e in read_events(tmp_path) if e["event"] == "stop"][0]
    assert stop["step"] == 6                     # the pipelined agreement would have stopped at 7
    state, train_step = _training()
    s = Session(state, 12, ckpt_dir=tmp_path, policy="fixed:100", environ=env)
    it = s.steps()
    assert next(it) == 6
    warn = [e for e in read_events(tmp_path) if e["event"] == "lead_warning"]
    assert warn and "signal lead (2s) is shorter than a step" in warn[0]["message"] and warn[0]["step_s"] >= 0.5
    it.close()


def test_a_torn_survivors_save_is_named_then_its_staging_swept_only_after_attempt_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim of an earlier survivors' save stays until this attempt's ``attempt_start`` is
    written: a process of the replaced attempt that runs again late meets the claim, then the newer
    record, never neither (``runtime.peerloss.PeerLoss.handle``)."""
    from coci_hpc.runtime import survivors as sv

    staging = sv.staging_dir(tmp_path, 7)
    staging.mkdir()
    (staging / "claim").touch()                      # a writer killed before its manifest
    seen: list[list[str]] = []
    sweep_torn = sv.sweep_torn

    def sweep(where: Any) -> list[int]:        # the manager's catalog (the restart's one listing)
        seen.append([e["event"] for e in read_events(tmp_path)])
        return sweep_torn(where)

    monkeypatch.setattr(sv, "sweep_torn", sweep)      # runtime.attemptbook calls it through the module
    state, train_step = _training()
    s = Session(state, 3, ckpt_dir=tmp_path, policy="fixed:10", environ=NO_SLURM)
    for _ in s.steps():
        s.observe(train_step())
    assert seen == [["attempt_start"]], seen
    assert not staging.exists()
    start = next(e for e in read_events(tmp_path) if e["event"] == "attempt_start")
    assert start["torn_survivors_saves"] == [7], start


def test_a_gpu_session_page_locks_its_async_save_buffers_at_its_first_boundary(tmp_path: Path, monkeypatch) -> None:
    """With CUDA (here: the FAKE device boundary, tests/checkpoint/fake_device.py, and CUDA said
    available) the Session calls prepare_async once, at its first boundary: the two-phase saves
    then find every host buffer page-locked (none registered at a save), and the run ends as one
    without the fake does."""
    from coci_hpc import session as session_mod
    from coci_hpc.checkpoint import CheckpointManager
    from tests.checkpoint.fake_device import DeviceBoundary

    ref_state, ref_step = _training()
    ref = Session(ref_state, 25, ckpt_dir=tmp_path / "ref", policy="fixed:10", environ=NO_SLURM)
    for _ in ref.steps():
        ref.observe(ref_step())

    fake = DeviceBoundary()
    calls: list[tuple[int, int, int]] = []
    real = CheckpointManager.prepare_async

    def spy(self: CheckpointManager, state: Any) -> int:
        n = real(self, state)
        self._async.buffers.settle()
        calls.append((s.step, n, fake.crossings["registered"]))
        return n

    monkeypatch.setattr(session_mod, "_cuda_available", lambda: True)
    monkeypatch.setattr(CheckpointManager, "prepare_async", spy)
    with fake.installed():
        state, train_step = _training()
        fake.adopt(state["model"], state["optimizer"])
        s = Session(state, 25, ckpt_dir=tmp_path / "run", policy="fixed:10", environ=NO_SLURM)
        for _ in s.steps():
            s.observe(train_step())
            fake.adopt(state["optimizer"])        # Adam's moments, made by the first step
    assert len(calls) == 1 and calls[0][0] == 1 and calls[0][1] > 0, calls
    assert fake.crossings["registered"] == calls[0][2], (calls, fake.crossings)   # no save page-locked anything
    assert fake.crossings["side_stream"] > 0 and fake.crossings["unpinned_dst"] == 0, fake.crossings
    assert all(torch.equal(a, b) for a, b in zip(_params(state), _params(ref_state)))
    kinds = [(e["kind"], e["step"]) for e in read_events(tmp_path / "run") if e["event"] == "checkpoint"]
    assert kinds == [("planned", 10), ("planned", 20), ("final", 25)], kinds
