"""Comm's scoped deadline on a dead peer: what a scope sets is restored on the way out, also when
the body raises (the Session's stop once left a requeue's 60 s deadline behind on an error)."""
from __future__ import annotations

import signal

import pytest

from coci_hpc.comm import Comm
from coci_hpc.errors import CociError
from coci_hpc.runtime.preemption import SignalRecorder, StopController
from coci_hpc.slurm.env import JobEnvironment


def test_deadline_is_restored_when_the_body_raises() -> None:
    comm = Comm.serial()
    comm.peer_deadline_s = 3.0
    with comm.deadline(60.0):
        assert comm.peer_deadline_s == 60.0
    assert comm.peer_deadline_s == 3.0
    with pytest.raises(RuntimeError, match="inside"), comm.deadline(None):
        assert comm.peer_deadline_s is None
        raise RuntimeError("inside")
    assert comm.peer_deadline_s == 3.0


def test_watch_sets_and_restores_deadline_handler_and_notice() -> None:
    comm = Comm.serial()
    def stuck(what: str) -> None:
        raise AssertionError(what)
    def notice(waited: float) -> str | None:
        return None
    with pytest.raises(KeyError), comm.watch(5.0, stuck, notice):
        assert (comm.peer_deadline_s, comm.on_stuck, comm.peer_notice) == (5.0, stuck, notice)
        comm.peer_deadline_s = 9.0          # the loop follows the step time inside its watch
        raise KeyError("x")
    assert (comm.peer_deadline_s, comm.on_stuck, comm.peer_notice) == (None, None, None)
    with comm.watch(5.0):                   # no notice given: the one there stays
        assert comm.peer_notice is None


def test_a_failed_requeue_leaves_the_deadline_as_it_was() -> None:
    def runner(argv: list[str]) -> str:
        raise RuntimeError("scontrol: broken pipe")     # not a SlurmError: no retries, one CommError
    comm = Comm.serial()
    comm.peer_deadline_s = 4.0
    errors: list[CociError] = []
    ctl = StopController(JobEnvironment.from_env({"SLURM_JOB_ID": "5"}), SignalRecorder([signal.SIGUSR1]), 60.0, runner)
    with pytest.raises(CociError, match="broken pipe"):
        ctl.requeue(comm, 60.0, errors.append)
    assert comm.peer_deadline_s == 4.0 and len(errors) == 1
