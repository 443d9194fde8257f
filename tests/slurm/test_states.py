"""Slurm's job-state groups (slurm/states.py), one per question; PREEMPTED is where they differ."""
from __future__ import annotations

from coci_hpc import history
from coci_hpc.slurm import accounting, commands, states


def test_each_group_answers_its_question() -> None:
    # squeue: a preempted job runs no more (it is PENDING again if requeued) ...
    assert "PREEMPTED" in states.NOT_ACTIVE and "PENDING" not in states.NOT_ACTIVE
    # ... but a preempted attempt does not end the run: a requeueable job comes back.
    assert "PREEMPTED" not in states.RUN_OVER and "REQUEUED" not in states.RUN_OVER
    assert set(states.RUN_OVER) == set(states.NOT_ACTIVE) - {"PREEMPTED"}
    # The Session's own stop ends in a requeue or a preemption, never in a node failure.
    assert "PREEMPTED" in states.AFTER_A_STOP and "NODE_FAIL" not in states.AFTER_A_STOP
    assert not set(states.ANNOUNCED) & set(states.UNANNOUNCED)


def test_readers_use_the_named_groups() -> None:
    assert history.SLURM_ENDED is states.RUN_OVER
    assert accounting.ANNOUNCED_STATES is states.ANNOUNCED
    assert commands.job_active("7", lambda argv: "PREEMPTED\n") is False
    assert commands.job_active("7", lambda argv: "PENDING\n") is True
