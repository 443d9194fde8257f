"""Signal recording, step-boundary agreement and self-requeue, without a cluster (fake runner)."""
from __future__ import annotations

import os
import signal

import pytest

from coci_hpc.comm import Comm
from coci_hpc.errors import CommError, SlurmError
from coci_hpc.runtime.preemption import PreemptionGuard, SignalRecorder
from coci_hpc.slurm.env import JobEnvironment


def test_job_environment_reads_the_table_and_types_values() -> None:
    env = JobEnvironment.from_env({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "3", "SLURM_NTASKS": "2",
                                   "SLURMD_NODENAME": "n1", "SLURM_JOB_NUM_NODES": "x"})
    assert (env.job_id, env.restart_count, env.ntasks, env.node_name) == ("42", 3, 2, "n1")
    assert env.num_nodes is None  # not a number: ignored, not fatal
    assert JobEnvironment.from_env({}).in_slurm_job is False
    arr = JobEnvironment.from_env({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"})
    assert arr.requeue_id == "40_3"


def test_recorder_only_records_and_restores_previous_handler() -> None:
    calls: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: calls.append(s))
    try:
        rec = SignalRecorder([signal.SIGUSR1]).install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert [r.name for r in rec.received] == ["SIGUSR1"]
        assert calls == [signal.SIGUSR1]  # the handler that was there still runs
        rec.uninstall()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert len(rec.received) == 1 and calls == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_guard_stops_at_the_boundary_after_a_signal_and_requeues_through_scontrol() -> None:
    seen: list[list[str]] = []
    job = JobEnvironment.from_env({"SLURM_JOB_ID": "77"})
    with PreemptionGuard(Comm.serial(), job, SignalRecorder([signal.SIGUSR1]),
                         runner=lambda argv: seen.append(list(argv)) or "") as guard:
        assert guard.stop_requested() is False
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.stop_requested() is True
        guard.requeue()
    assert seen == [["scontrol", "requeue", "77"]]


def _show_job(end: str, preempt: str = "None") -> str:
    return f"JobId=5 JobName=x\n   JobState=RUNNING Reason=None Dependency=(null)\n   Requeue=1 Restarts=0\n" \
           f"   StartTime=2026-11-23T19:00:00 EndTime={end} Deadline=N/A\n   PreemptEligibleTime=2026-11-23T19:00:00 " \
           f"PreemptTime={preempt}\n   Partition=gpu"


@pytest.mark.parametrize("left_s,preempt,expected", [(45, "None", "time_limit"), (3600, "None", "preemption"),
                                                     (None, "None", "preemption"),
                                                     (45, "2026-11-23T19:05:00", "preemption")])
def test_reason_is_the_sessions_one_rule_on_slurms_record(left_s, preempt, expected) -> None:
    import time as _t
    end = "Unknown" if left_s is None else _t.strftime("%Y-%m-%dT%H:%M:%S", _t.localtime(_t.time() + left_s))
    job = JobEnvironment.from_env({"SLURM_JOB_ID": "5"})
    guard = PreemptionGuard(Comm.serial(), job, SignalRecorder([signal.SIGUSR1]), signal_lead_s=60,
                            runner=lambda argv: _show_job(end, preempt))
    with guard:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.reason() == expected


def test_requeue_outside_slurm_is_a_clear_error() -> None:
    guard = PreemptionGuard(Comm.serial(), JobEnvironment(), SignalRecorder([]))
    with pytest.raises((SlurmError, CommError), match="not inside a Slurm job"):
        guard.requeue()


def test_reason_when_slurm_cannot_be_asked_names_the_signal() -> None:
    def broken(argv):
        raise SlurmError("squeue: error: slurm_load_jobs error: Unable to contact slurm controller")
    guard = PreemptionGuard(Comm.serial(), JobEnvironment.from_env({"SLURM_JOB_ID": "5"}),
                            SignalRecorder([signal.SIGUSR1]), signal_lead_s=60, runner=broken)
    with guard:
        os.kill(os.getpid(), signal.SIGUSR1)
        plan = guard.plan()
        assert plan is not None and plan.reason == "preemption" and "record unavailable" in plan.detail


class _RankZeroOfTwo(Comm):
    """Rank 0 of a two-rank job whose rank 1 got ``other`` (name, wall time) first: Slurm signals
    a job's tasks one by one, so rank 0 may agree to stop before its own signal arrived."""

    def __init__(self, other: tuple[str, float] | None) -> None:
        super().__init__(None)
        self.other = other

    def allreduce_max(self, value: float) -> float:
        return max(value, 1.0 if self.other is not None else 0.0)

    def allgather(self, obj):  # type: ignore[no-untyped-def]
        return [obj, self.other]


def test_the_guard_decides_on_the_first_signal_of_any_rank() -> None:
    """Rank 0 has no signal of its own yet; rank 1 got SIGTERM: outside Slurm that is a
    termination (until 2026-11-30 rank 0 decided on "?", a preemption)."""
    import time as _t

    guard = PreemptionGuard(_RankZeroOfTwo(("SIGTERM", _t.time() - 0.2)), JobEnvironment(),
                            SignalRecorder([signal.SIGUSR1]))
    with guard:
        assert guard.plan() is None               # nothing agreed yet
        assert guard.stop_requested() is True
        plan = guard.plan()
    assert plan is not None and plan.reason == "terminated" and plan.detail.startswith("SIGTERM"), plan


def test_the_stop_records_the_jobs_first_signal_not_rank_zeros_own() -> None:
    """The Session's stop (StopController.stop) on rank 0 before its own SIGTERM arrived: the
    stop event names the signal rank 1 received, and the reason is decided on it."""
    import time as _t

    from coci_hpc.runtime import events as ev
    from coci_hpc.runtime.preemption import StopController

    written: list = []

    class _Log:
        def write(self, e) -> None:  # type: ignore[no-untyped-def]
            written.append(e)

    class _Mgr:
        def latest_step(self) -> int:
            return 7          # already saved: no save needed

        def close(self) -> None:
            pass

    class _Schedule:
        def save_s(self) -> None:
            return None

    class _Losses:
        def flush(self) -> None:
            pass

    ctl = StopController(JobEnvironment(), SignalRecorder([signal.SIGUSR1]), None)
    with pytest.raises(SystemExit):
        ctl.stop(7, comm=_RankZeroOfTwo(("SIGTERM", _t.time() - 0.1)), mgr=_Mgr(), schedule=_Schedule(),  # type: ignore[arg-type]
                 log=_Log(), losses=_Losses(), settle=lambda: None, save=lambda st: None, wait_s=1.0)  # type: ignore[arg-type]
    stop = [e for e in written if isinstance(e, ev.Stop)][0]
    assert (stop.signal, stop.reason, stop.requeued) == ("SIGTERM", ev.StopReason.TERMINATED, False), stop
