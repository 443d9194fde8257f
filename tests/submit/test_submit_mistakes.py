"""coci-submit and the ordinary mistakes of issue 26: each one a clear `coci-submit: error:` with a
hint and its documented exit code, before anything is submitted (a fake sbatch records every call)."""
from __future__ import annotations

import re
from pathlib import Path

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


# -- 1: what follows the script is the script's; only --dry-run there is refused ----------------------
@pytest.mark.parametrize("args", [["--dry-run"], ["--lr", "1", "--dry-run"], ["--dry-run=1"],
                                  ["--policy", "fixed:5", "--dry-run"]])
def test_dry_run_after_the_script_is_refused_not_submitted(fake_slurm, capsys, args) -> None:
    """`coci-submit train.py --dry-run` submitted the job for real (the flag went to the script)."""
    err = _refused(fake_slurm, capsys, 2, r"--dry-run comes after the script train\.py, so it would go to the "
                   r"script and the job would be submitted for real", "train.py", *args)
    assert "put it before the script" in err and "train.py -- " in err, err


@pytest.mark.parametrize("dry", [(), ("--dry-run",)])
def test_script_options_sharing_a_name_with_ours_go_to_the_script(fake_slurm, capsys, dry) -> None:
    """The issue's command: examples/train.py has --policy and --ckpt-dir of its own, and they follow
    it, as with sbatch, srun, mpiexec, torchrun and python. One line on stderr names them."""
    rc, out, err = _run(capsys, *dry, "--partition", "gpu", "--nodes", "2", "--ckpt-dir", "D", "train.py",
                        "--steps", "1500", "--policy", "fixed:50", "--ckpt-dir=E", "--time", "10")
    assert rc == 0, err
    notes = [ln for ln in err.splitlines() if "note:" in ln]
    assert notes == ["coci-submit: note: --policy, --ckpt-dir, --time after train.py go to the script, "
                     "not to coci-submit (coci-submit's options go before the script)"], err
    script = out if dry else fake_slurm.sbatch_calls()[0]
    assert fake_slurm.sbatch_calls() == ([] if dry else [script])
    assert "train.py --steps 1500 --policy fixed:50 --ckpt-dir=E --time 10" in script, script
    lines = script.splitlines()
    assert "export COCI_POLICY=coci" in lines, script                 # coci-submit's own stay the defaults
    assert f"export COCI_CKPT_DIR={Path.cwd() / 'D'}" in lines, script  # the --ckpt-dir before the script
    assert not any(ln.startswith("#SBATCH --time") for ln in lines), script


def test_no_note_when_no_script_argument_shares_a_name(fake_slurm, capsys) -> None:
    rc, out, err = _run(capsys, "--dry-run", "train.py", "--lr", "1", "-p", "x", "--policyx", "--", "--policy")
    assert rc == 0, err
    assert "note:" not in err, err     # short options, other names and what follows a `--` are not named
    assert "train.py --lr 1 -p x --policyx -- --policy" in out, out


def test_double_dash_passes_own_options_to_the_script_on_purpose(fake_slurm, capsys) -> None:
    rc, out, err = _run(capsys, "--dry-run", "train.py", "--", "--dry-run", "--policy", "fixed:5")
    assert rc == 0, err
    assert fake_slurm.sbatch_calls() == []          # coci-submit's own --dry-run still holds
    assert "train.py --dry-run --policy fixed:5" in out, out
    assert "note:" not in err, err                  # `--` says they are meant for the script
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
    assert f"coci-submit: dry run: --time '{text}' read as " in err, err     # how it was understood


# -- 8: accepted silently, or refused blaming the wrong option -----------------------------------------
@pytest.mark.parametrize("argv,pattern", [
    (["--mpi", "foo"], r"--mpi 'foo' is not one of srun's MPI plugins"),
    (["--python", "/nonexistent/python"], r"--python /nonexistent/python does not exist"),
    (["--python", "no-such-python-here"], r"--python no-such-python-here is not on PATH"),
    (["--sbatch-arg", "nonsense"], r"--sbatch-arg 'nonsense': sbatch has no option --nonsense"),
    (["--sbatch-arg", "mail-tipe=END"], r"sbatch has no option --mail-tipe"),
])
def test_bad_values_are_refused_before_submitting(fake_slurm, capsys, argv, pattern) -> None:
    for dry in ((), ("--dry-run",)):
        _refused(fake_slurm, capsys, 2, pattern, *dry, *argv, "train.py")


def test_a_misspelled_sbatch_option_suggests_the_real_one(fake_slurm, capsys) -> None:
    err = _refused(fake_slurm, capsys, 2, r"sbatch has no option --mail-tipe", "--sbatch-arg", "mail-tipe=END",
                   "train.py")
    assert "did you mean --mail-type" in err, err


@pytest.mark.parametrize("name,text", [("run.sh", "#!/bin/bash\npython train.py\n"),
                                       ("run", "#!/bin/sh\nexec python train.py\n"),
                                       ("job.bash", "python train.py --lr 1\n")])
def test_a_shell_script_as_the_training_script_is_refused(fake_slurm, capsys, name, text) -> None:
    Path(name).write_text(text)
    err = _refused(fake_slurm, capsys, 2, rf"training script .*{re.escape(name)} is a shell script", name)
    assert "Python script" in err and "sbatch" in err, err


def test_a_python_script_with_a_syntax_error_is_refused_here(fake_slurm, capsys) -> None:
    Path("broken.py").write_text("import os\ndef f(:\n    pass\n")
    _refused(fake_slurm, capsys, 2, r"broken\.py is not valid Python: line 2", "broken.py")
    Path("ok").write_text("#!/usr/bin/env python3\nprint(1)\n")   # no suffix, a python shebang: fine
    rc, out, err = _run(capsys, "--dry-run", "ok")
    assert rc == 0, err


def test_a_script_name_with_a_space_gets_a_clean_job_name(fake_slurm, capsys) -> None:
    """`"my train.py"` failed blaming --job-name, which the user never gave."""
    Path("my train.py").write_text("print('hi')\n")
    rc, out, err = _run(capsys, "--dry-run", "my train.py", "--lr", "1")
    assert rc == 0, err
    assert "#SBATCH --job-name=my_train" in out.splitlines(), out
    assert "'" + str(Path.cwd() / "my train.py") + "' --lr 1" in out, out
    _refused(fake_slurm, capsys, 2, r"--job-name 'my run' has characters", "--job-name", "my run", "my train.py")


def test_a_bad_lead_from_profile_path_names_that_option(fake_slurm, capsys) -> None:
    err = _refused(fake_slurm, capsys, 2, r"cannot read profile /nonexistent/p\.json",
                   "--lead-from-profile", "/nonexistent/p.json", "train.py")
    assert "check the --lead-from-profile path" in err and "--profile path" not in err, err


# -- 3: another run's checkpoint directory, checked at submission --------------------------------------
def _session_run(ckpt: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A real (1-rank, CPU) Session run that leaves its run record in ckpt's event log."""
    import sys

    import torch

    from coci_hpc.session import Session
    monkeypatch.setattr(sys, "argv", argv)
    w = torch.zeros(2)
    s = Session({"w": w}, 4, ckpt_dir=ckpt, policy="fixed:2", environ={})
    for _ in s.steps():
        w += 1.0


def test_another_runs_directory_is_refused_at_submission(fake_slurm, capsys, monkeypatch) -> None:
    """`--dry-run --ckpt-dir DIR` onto another run's directory exited 0; the job failed on the node."""
    ck = Path.cwd() / "ck"
    _session_run(ck, [str(Path.cwd() / "train.py"), "--seed", "0", "--steps", "4"], monkeypatch)
    capsys.readouterr()
    for dry in (("--dry-run",), ()):
        err = _refused(fake_slurm, capsys, 5, r"checkpoint directory .*ck belongs to another run: .*"
                       r"\(other arguments: --seed 0 -> 7\)", *dry, "--ckpt-dir", "ck", "train.py", "--seed", "7",
                       "--steps", "4")
        assert "--resume-from-other-run" in err
    # the same run, trained longer, is accepted; so is the other run when asked for on purpose
    rc, out, err = _run(capsys, "--dry-run", "--ckpt-dir", "ck", "train.py", "--seed", "0", "--steps", "8")
    assert rc == 0, err
    rc, out, err = _run(capsys, "--dry-run", "--resume-from-other-run", "--ckpt-dir", "ck", "train.py", "--seed", "7")
    assert rc == 0, err


# -- 7: a dry run needs no slurmctld and shows the command -----------------------------------------------
@pytest.mark.parametrize("sinfo", ["exec sleep 30",
                                   "echo 'slurm_load_partitions: Unable to contact slurm controller' >&2; exit 1"])
def test_dry_run_without_slurmctld_renders_and_says_what_it_did_not_check(fake_slurm, capsys, sinfo) -> None:
    """It needed a live slurmctld: 9.5 s of silence, then exit 3."""
    import time
    fake_slurm.sinfo(sinfo)
    t0 = time.monotonic()
    rc, out, err = _run(capsys, "--dry-run", "-p", "gpu", "train.py", "--lr", "1")
    assert rc == 0, err
    assert time.monotonic() - t0 < 8                          # 3 s for sinfo, not its own retries
    assert out.startswith("#!/bin/bash") and "#SBATCH --partition=gpu" in out
    assert f"#   {__import__('shlex').quote(__import__('sys').executable)} {Path.cwd() / 'train.py'} --lr 1" in out
    assert "coci-submit: dry run: not checked: partition 'gpu' (cannot list the cluster's partitions" in err, err
    assert "nothing submitted; the ranks would run " in err and "train.py --lr 1" in err
    assert fake_slurm.sbatch_calls() == []


def test_dry_run_with_no_slurm_installed(fake_slurm, capsys, monkeypatch, tmp_path) -> None:
    (tmp_path / "empty-bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))   # no sinfo, srun, sbatch
    rc, out, err = _run(capsys, "--dry-run", "train.py")
    assert rc == 0, err
    assert "not checked: that Slurm answers" in err and "`srun` is not on PATH" in err, err
    rc, out, err = _run(capsys, "train.py")                    # a real submission still needs Slurm
    assert rc == 3, err


def test_dry_run_with_slurm_up_checks_the_partition(fake_slurm, capsys) -> None:
    rc, out, err = _run(capsys, "--dry-run", "-p", "gpu", "train.py")
    assert rc == 0 and "not checked" not in err, err
    _refused(fake_slurm, capsys, 2, r"partition 'gpux' does not exist", "--dry-run", "-p", "gpux", "train.py")
