"""coci-submit and the ordinary mistakes of issue 26: each one a clear `coci-submit: error:` with a
hint and its documented exit code, before anything is submitted (a fake sbatch records every call)."""
from __future__ import annotations

import re

import pytest

from coci_hpc.cli.submit import main


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _refused(fake_slurm, capsys, code: int, pattern: str, *argv: str) -> str:
    rc, out, err = _run(capsys, *argv)
    assert rc == code, (rc, out, err)
    assert re.search(pattern, err), err
    assert "coci-submit: hint: " in err and "Traceback" not in err, err
    assert fake_slurm.sbatch_calls() == [], "nothing may be submitted after a refusal"
    return err


# -- 1: an option of coci-submit's after the script --------------------------------------------------
@pytest.mark.parametrize("args", [["--dry-run"], ["--lr", "1", "--partition=gpu"], ["--ckpt-dir", "x"],
                                  ["--time", "10"]])
def test_own_option_after_the_script_is_refused_not_submitted(fake_slurm, capsys, args) -> None:
    """`coci-submit train.py --dry-run` submitted the job for real (the flag went to the script)."""
    name = next(a for a in args if a.split("=")[0] in ("--dry-run", "--partition", "--ckpt-dir", "--time"))
    err = _refused(fake_slurm, capsys, 2, rf"{re.escape(name.split('=')[0])} comes after the script train\.py",
                   "train.py", *args)
    assert "put it before the script" in err and "train.py -- " in err, err


def test_double_dash_passes_own_options_to_the_script_on_purpose(fake_slurm, capsys) -> None:
    rc, out, err = _run(capsys, "--dry-run", "train.py", "--", "--dry-run", "--policy", "fixed:5")
    assert rc == 0, err
    assert fake_slurm.sbatch_calls() == []          # coci-submit's own --dry-run still holds
    assert "train.py --dry-run --policy fixed:5" in out, out
    rc, out, err = _run(capsys, "--dry-run", "--", "train.py", "--time", "3")
    assert rc == 0, err
    assert "train.py --time 3" in out, out


def test_missing_script_is_a_usage_error(fake_slurm, capsys) -> None:
    _refused(fake_slurm, capsys, 2, r"training script is missing", "--dry-run")


# -- 9: one time grammar, and errors that say how a value was read ------------------------------------
def test_time_1_30_refused_saying_it_was_read_as_minutes_and_seconds(fake_slurm, capsys) -> None:
    err = _refused(fake_slurm, capsys, 2, r"--time '1:30' read as MM:SS = 1 min 30 s", "-t", "1:30", "train.py")
    assert "1:30:00" in err and "1h30m" in err, err


@pytest.mark.parametrize("text,minutes", [("2h", 120), ("90m", 90), ("1d12h", 2160), ("1:30:00", 90)])
def test_time_takes_the_grammar_coci_plan_takes(fake_slurm, capsys, text, minutes) -> None:
    """coci-submit rejected `2h` while coci-plan --horizon took it."""
    rc, out, err = _run(capsys, "--dry-run", "--time", text, "train.py")
    assert rc == 0, err
    assert f"#SBATCH --time={minutes}" in out.splitlines(), out
