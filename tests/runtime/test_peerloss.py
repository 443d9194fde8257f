"""coci_hpc.runtime.peerloss: which rank of a peer loss saves, records and requeues, and which leaves quietly."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint.catalog import StepCatalog
from coci_hpc.comm import Comm
from coci_hpc.runtime import peerloss
from coci_hpc.runtime.events import EventLog, read_events


class _Left(Exception):
    """leave_after_peer_loss, caught: the process would have ended here."""


class _Book:
    def newer_attempt(self) -> int | None:
        return None


class _Snapshot:
    def __init__(self, step: int) -> None:
        self.step = step
        self.opt_steps = 0


class _Survival:
    """Only what handle() reads before it decides to save: the last step this rank finished."""

    def __init__(self, step: int) -> None:
        self.snapshot = _Snapshot(step)
        self.enabled = True
        self.memtier = None


class _Mgr:
    def __init__(self, root: Path) -> None:
        self.quiesced = False
        self.catalog = StepCatalog(root)

    def quiesce(self, timeout_s: float) -> None:
        self.quiesced = True


class _Losses:
    def flush(self) -> None:
        pass


def _peer_loss(root: Path, last_finished: int, calls: list[Any], in_slurm: bool = True,
               host_only: bool = False) -> tuple[peerloss.PeerLoss, _Mgr, EventLog]:
    log = EventLog(root / "events.jsonl", attempt=1, job_id="77", enabled=True)
    mgr = _Mgr(root)

    class Job:
        in_slurm_job = in_slurm
        requeue_id = "77"
        job_id = "77"

    parts = peerloss.SessionParts(comm=Comm.serial(), mgr=mgr,  # type: ignore[arg-type]
                                  state={}, session_key="__coci__", local_session_state=dict, parts=[], root=root,
                                  log=log, book=_Book(), losses=_Losses(), job=Job(),  # type: ignore[arg-type]
                                  runner=lambda *a, **k: calls.append(a) or "", notice=None, in_place=None)
    pl = peerloss.PeerLoss(parts, _Survival(last_finished), host_only=host_only)  # type: ignore[arg-type]
    return pl, mgr, log


def _committed(root: Path, step: int) -> None:
    with CheckpointManager(root, Comm.serial()) as mgr:
        mgr.save(step, {"w": torch.ones(3)})


@pytest.fixture
def left(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    out: list[bool] = []

    def leave(in_place: bool) -> Any:
        out.append(in_place)
        raise _Left

    monkeypatch.setattr(peerloss, "leave_after_peer_loss", leave)
    return out


def test_a_rank_behind_a_newer_committed_checkpoint_leaves_without_saving_or_recording(
        tmp_path: Path, left: list[bool], capsys: pytest.CaptureFixture[str]) -> None:
    """A frozen host's rank woken after the survivors committed step 9 without it (its own last
    finished step is 7): it must not save, write a peer_lost record or requeue (it would blame
    the survivors and requeue the live run)."""
    _committed(tmp_path, 9)
    calls: list[Any] = []
    pl, mgr, log = _peer_loss(tmp_path, last_finished=7, calls=calls)
    with pytest.raises(_Left):
        pl.handle(8, "the step agreement's deadline passed", 0.0)
    assert left == [False]
    assert not mgr.quiesced and calls == []                          # no save begun, no scontrol
    assert [r for r in read_events(tmp_path / "events.jsonl") if r.get("event") == "peer_lost"] == []
    err = capsys.readouterr().err
    assert "step 9 was committed after this rank's last step (7)" in err and "without saving" in err


def test_a_rank_at_the_newest_checkpoint_goes_on_to_the_survivors_save(tmp_path: Path, left: list[bool]) -> None:
    """The same loss on a rank whose last finished step is the committed one: it is a survivor and
    goes on to save (the fake Survival has no partner machinery, so the save fails and the rank
    leaves through the failure path: what matters here is that it got past the check)."""
    _committed(tmp_path, 9)
    calls: list[Any] = []
    pl, mgr, _ = _peer_loss(tmp_path, last_finished=9, calls=calls, in_slurm=False)
    with pytest.raises(_Left):
        pl.handle(10, "the step agreement's deadline passed", 0.0)
    assert mgr.quiesced                                             # the survivors' path began


def test_under_nccl_without_host_copies_nothing_is_saved_and_the_record_says_why(
        tmp_path: Path, left: list[bool], capsys: pytest.CaptureFixture[str]) -> None:
    """Under NCCL (host_only) with the memory tier off there is no host copy, and device memory is
    never read after a lost peer: no survivors' checkpoint, the record and the log say so and name
    the disk checkpoint the run falls back to."""
    _committed(tmp_path, 9)
    pl, _, _ = _peer_loss(tmp_path, last_finished=11, calls=[], in_slurm=False, host_only=True)
    with pytest.raises(_Left):
        pl.handle(12, "the NCCL watcher's agreement over MPI did not complete", 0.0)
    [rec] = [r for r in read_events(tmp_path / "events.jsonl") if r.get("event") == "peer_lost"]
    assert rec["committed"] is False and rec["tier"] == "disk" and rec["fallback_step"] == 9, rec
    assert rec["reason"] == peerloss.NO_HOST_COPY and rec.get("saved_from") is None, rec
    assert "process groups aborted" in rec["how"]          # no group here: the abort returns at once
    err = capsys.readouterr().err
    assert "survivors save from host copies only" in err
    assert "no host copy of the state to save from" in err and "falling back to the last regular checkpoint (step 9)" in err
