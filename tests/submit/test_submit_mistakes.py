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
