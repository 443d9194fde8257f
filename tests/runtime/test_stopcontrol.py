"""The stop rule is one: PreemptionGuard (users without the Session) and the Session's stop
controller answer the same "why, requeue or not, does the save fit?" for the same signal and the
same Slurm record (recorded scontrol output: a preemption with GraceTime, a scancel with KillWait)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from coci_hpc.comm import Comm
from coci_hpc.runtime.preemption import PreemptionGuard
from coci_hpc.session import Session

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "slurm"


def _runner(job_file: str):
    def run(argv):
        if argv[:3] == ["scontrol", "show", "job"]:
            return (FIX / job_file).read_text()
        if argv[:3] == ["scontrol", "show", "partition"]:
            return (FIX / "scontrol_show_partition.txt").read_text()
        if argv[:3] == ["scontrol", "show", "config"]:
            return (FIX / "scontrol_show_config.txt").read_text()
        return ""
    return run


@pytest.mark.parametrize("job_file,reason", [("scontrol_show_job_preempted.txt", "preemption"),
                                             ("scontrol_show_job_cancelled.txt", "cancelled")])
def test_guard_and_session_give_the_same_stop_answer(tmp_path, job_file, reason) -> None:
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_PARTITION": "debug", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = _runner(job_file)
    s = Session({"w": torch.zeros(2)}, 10, ckpt_dir=tmp_path / "ck", policy="fixed:5", environ=env,
                runner=run, signal_lead_s=60, comm=Comm.serial())
    try:
        os.kill(os.getpid(), signal.SIGTERM)                # recorded only (the session's handler)
        guard = PreemptionGuard(Comm.serial(), s.job, s.recorder, signal_lead_s=s.config.signal_lead_s, runner=run)
        mine, theirs = s.stopper.plan(), guard.plan()
        assert theirs is not None and mine.reason == theirs.reason == reason
        assert (mine.requeue, mine.detail) == (theirs.requeue, theirs.detail)
        # The kill's time comes from GraceTime (preemption) or KillWait (scancel): known to both
        assert mine.deadline_wall is not None and theirs.deadline_wall == pytest.approx(mine.deadline_wall, abs=1.0)
        for save_s in (0.5, 30.0, 1e5, None):
            now = 0.5 * (mine.deadline_wall or 0.0) + 0.5 * (theirs.deadline_wall or 0.0) - 10.0
            assert mine.save_fits(now, save_s) == theirs.save_fits(now, save_s)
    finally:
        s.recorder.uninstall()
        s.mgr.close()
