"""Parsing `scontrol show job|partition|config`, on output recorded from the local cluster
(tests/fixtures/slurm/capture_scontrol.sh)."""
from __future__ import annotations

from pathlib import Path

import pytest

from coci_hpc.slurm import scontrol
from coci_hpc.slurm.accounting import parse_time

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "slurm"


def _read(name: str) -> str:
    return (FIX / name).read_text()


def test_a_preempted_job_shows_its_preempt_time_and_grace_end() -> None:
    job = scontrol.parse_job(_read("scontrol_show_job_preempted.txt"))
    assert job.preempted and job.state == "SIGNALING" and job.partition == "gpu" and job.restarts == 0
    grace = scontrol.parse_grace_time(_read("scontrol_show_partition.txt"))
    assert grace == 20.0
    assert job.end_time == job.preempt_time + grace      # Slurm moved EndTime to the grace time's end


def test_cancelled_requeued_and_running_jobs_are_not_preempted() -> None:
    can = scontrol.parse_job(_read("scontrol_show_job_cancelled.txt"))
    assert (can.state, can.preempted, can.restarts) == ("COMPLETING", False, 0)
    req = scontrol.parse_job(_read("scontrol_show_job_requeued_by_hand.txt"))
    assert (req.state, req.preempted, req.restarts) == ("COMPLETING", False, 1)  # no PreemptTime line at all
    run = scontrol.parse_job(_read("scontrol_show_job_running.txt"))
    assert run.state == "RUNNING" and not run.preempted and run.end_time is not None


def test_kill_wait_and_user_signal_setting_from_show_config() -> None:
    assert scontrol.parse_kill_wait(_read("scontrol_show_config.txt")) == 5.0
    assert "preempt_send_user_signal" in _read("scontrol_show_config.txt")
    assert "preempt_send_user_signal" not in _read("scontrol_show_config_no_user_signal.txt")


def test_garbage_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="scontrol show job"):
        scontrol.parse_job("slurm_load_jobs error: Invalid job id specified")
    with pytest.raises(ValueError, match="KillWait"):
        scontrol.parse_kill_wait("")
    with pytest.raises(ValueError, match="GraceTime"):
        scontrol.parse_grace_time("PartitionName=gpu")


def test_times_are_slurms_local_times() -> None:
    job = scontrol.parse_job("JobId=1 JobState=RUNNING\n   PreemptTime=2026-11-23T19:27:05 EndTime=Unknown")
    assert job.preempt_time == parse_time("2026-11-23T19:27:05") and job.end_time is None
