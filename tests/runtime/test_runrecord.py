"""One run, one directory: the run (script, arguments, world size) is recorded with every attempt,
and a Session of another run on the same directory is refused at Session() unless asked for."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from coci_hpc.errors import CheckpointOtherRun
from coci_hpc.runtime import runrecord
from coci_hpc.runtime.events import read_events
from coci_hpc.session import Session

NO_SLURM: dict[str, str] = {}


def _train(ckpt: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch, total: int = 6, **kw) -> torch.Tensor:
    monkeypatch.setattr(sys, "argv", argv)
    w = torch.zeros(3)
    s = Session({"w": w}, total, ckpt_dir=ckpt, policy="fixed:2", environ=NO_SLURM, **kw)
    for _ in s.steps():
        w += 1.0
        s.observe(float(w.sum()))
    return w


def test_a_sweep_point_on_another_runs_directory_is_refused(tmp_path: Path, monkeypatch) -> None:
    script = str(tmp_path / "train.py")
    assert _train(tmp_path / "ck", [script, "--seed", "0"], monkeypatch).tolist() == [6.0] * 3
    run = [e["run"] for e in read_events(tmp_path / "ck") if e["event"] == "attempt_start"]
    assert run == [{"script": script, "args": ["--seed", "0"], "world_size": 1}]
    files = sorted(p.name for p in (tmp_path / "ck").rglob("*"))
    with pytest.raises(CheckpointOtherRun, match=r"belongs to another run: .*--seed 0.*--seed 7 \(other arguments: --seed 0 -> 7\)") as e:
        _train(tmp_path / "ck", [script, "--seed", "7"], monkeypatch)
    assert "--resume-from-other-run" in (e.value.hint or "") and "--ckpt-dir" in (e.value.hint or "")
    assert sorted(p.name for p in (tmp_path / "ck").rglob("*")) == files  # nothing written or taken
    with pytest.raises(CheckpointOtherRun, match="another script"):
        _train(tmp_path / "ck", [str(tmp_path / "other.py"), "--seed", "0"], monkeypatch)
    # the same run again resumes (here: is already complete); a relative script path is the same script
    monkeypatch.chdir(tmp_path)
    assert _train(tmp_path / "ck", ["train.py", "--seed", "0"], monkeypatch).tolist() == [6.0] * 3


def test_resume_from_other_run_on_purpose_is_recorded(tmp_path: Path, monkeypatch) -> None:
    script = str(tmp_path / "train.py")
    _train(tmp_path / "ck", [script, "--steps", "6"], monkeypatch)
    # continuing a finished run further, as asked: it resumes from step 6 and is the directory's run now
    w = _train(tmp_path / "ck", [script, "--steps", "10"], monkeypatch, total=10, resume_from_other_run=True)
    assert w.tolist() == [10.0] * 3
    assert runrecord.recorded_run(read_events(tmp_path / "ck"))["args"] == ["--steps", "10"]
    env = {"COCI_RESUME_FROM_OTHER_RUN": "1"}  # the environment's way (coci-submit's option)
    monkeypatch.setattr(sys, "argv", [script, "--steps", "12"])
    s = Session({"w": torch.zeros(3)}, 12, ckpt_dir=tmp_path / "ck", policy="fixed:2", environ=env)
    assert s.config.resume_from_other_run
    s.mgr.close()
    s.recorder.uninstall()


def test_world_size_is_recorded_not_compared() -> None:
    a = runrecord.current_run(["/x/train.py", "--lr", "1"], 2)
    b = runrecord.current_run(["/x/train.py", "--lr", "1"], 1)
    assert a["world_size"] == 2 and runrecord.difference(a, b) is None  # the store reshards
    assert runrecord.difference(None, b) is None                         # nothing recorded yet
    assert runrecord.difference(a, runrecord.current_run(["/x/train.py", "--lr", "2"], 2))


def test_more_steps_is_the_same_run_trained_longer(tmp_path: Path, monkeypatch, capsys) -> None:
    """`--steps 60` then `--steps 100` in one directory was refused as "other arguments" (issue 26, 3)."""
    script = str(tmp_path / "train.py")
    assert _train(tmp_path / "ck", [script, "--seed", "1", "--steps", "6"], monkeypatch).tolist() == [6.0] * 3
    capsys.readouterr()
    w = _train(tmp_path / "ck", [script, "--seed", "1", "--steps=10"], monkeypatch, total=10)
    assert w.tolist() == [10.0] * 3                         # resumed from step 6, not from scratch
    assert "the same run with another step count (--steps 6 -> 10)" in capsys.readouterr().err
    with pytest.raises(CheckpointOtherRun, match=r"other arguments: --seed 1 -> 2, --steps 10 -> 12"):
        _train(tmp_path / "ck", [script, "--seed", "2", "--steps", "12"], monkeypatch, total=12)


@pytest.mark.parametrize("old,new,named", [
    (["--lr", "1e-3", "--steps", "5"], ["--lr", "3e-4", "--steps", "5"], "--lr 1e-3 -> 3e-4"),
    (["--seed", "0"], ["--seed", "0", "--fp16"], "--fp16 (absent) -> "),
    (["data/a"], ["data/b"], "(positional) data/a -> data/b"),
    (["--steps", "5"], [], "--steps 5 -> (absent)"),          # dropping the count is not a count
])
def test_the_differing_arguments_are_named(old, new, named) -> None:
    diff = runrecord.difference(runrecord.current_run(["/x/t.py", *old], 1), runrecord.current_run(["/x/t.py", *new], 1))
    assert diff is not None and named in diff, diff


@pytest.mark.parametrize("old,new", [(["--max_steps", "5"], ["--max_steps", "50"]),
                                     (["--epochs", "3", "--lr", "1"], ["--lr", "1", "--epochs", "4"])])
def test_step_count_spellings_are_the_same_run(old, new) -> None:
    a, b = runrecord.current_run(["/x/t.py", *old], 1), runrecord.current_run(["/x/t.py", *new], 1)
    assert runrecord.difference(a, b) is None and runrecord.continuation(a, b)
