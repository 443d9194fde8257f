"""Configuration precedence: explicit argument > COCI_* environment > default; conflicts reported."""
from __future__ import annotations

from pathlib import Path

import pytest

from coci_hpc.errors import UsageError
from coci_hpc.runtime.config import resolve


def test_environment_fills_what_the_script_leaves_out(tmp_path: Path) -> None:
    env = {"COCI_CKPT_DIR": str(tmp_path / "e"), "COCI_POLICY": "fixed:7", "COCI_MAX_REQUEUES": "4",
           "COCI_NO_PROGRESS_LIMIT": "2", "COCI_SIGNAL_LEAD_S": "45", "COCI_RESUME_FROM_OTHER_RUN": "1"}
    cfg, conflicts = resolve({}, env)
    assert cfg.ckpt_dir == tmp_path / "e" and cfg.policy == "fixed:7"
    assert (cfg.max_requeues, cfg.no_progress_limit, cfg.signal_lead_s) == (4, 2, 45.0)
    assert cfg.resume_from_other_run is True
    assert conflicts == [] and set(cfg.sources.values()) == {"environment"}


def test_explicit_argument_wins_and_the_conflict_is_reported(tmp_path: Path) -> None:
    env = {"COCI_CKPT_DIR": str(tmp_path / "env"), "COCI_POLICY": "young"}
    cfg, conflicts = resolve({"ckpt_dir": str(tmp_path / "arg"), "policy": "young"}, env)
    assert cfg.ckpt_dir == tmp_path / "arg" and cfg.sources["ckpt_dir"] == "argument"
    assert len(conflicts) == 1 and "ckpt_dir" in conflicts[0] and "COCI_CKPT_DIR" in conflicts[0]


def test_defaults_and_array_task_directory(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "3"}
    cfg, _ = resolve({"ckpt_dir": str(tmp_path)}, env)
    assert cfg.ckpt_dir == tmp_path / "task3"
    assert (cfg.policy, cfg.max_requeues, cfg.no_progress_limit, cfg.signal_lead_s) == ("coci", None, 3, None)


@pytest.mark.parametrize("env,word", [({"COCI_MAX_REQUEUES": "many"}, "COCI_MAX_REQUEUES"),
                                      ({"COCI_POLICY": "sometimes"}, "unknown policy"),
                                      ({"COCI_SIGNAL_LEAD_S": "-3"}, "COCI_SIGNAL_LEAD_S")])
def test_bad_values_name_the_variable(tmp_path: Path, env: dict, word: str) -> None:
    with pytest.raises(UsageError, match=word):
        resolve({"ckpt_dir": str(tmp_path)}, env)


def test_missing_checkpoint_directory_says_how_to_give_one() -> None:
    with pytest.raises(UsageError, match="COCI_CKPT_DIR") as e:
        resolve({}, {})
    assert e.value.hint and "--ckpt-dir" in e.value.hint
    with pytest.raises(UsageError, match="unknown session setting"):
        resolve({"ckpt": "x"}, {})
