"""coci-submit without a cluster: the dry-run script, the submitted script, and every pre-submit check.

A fake ``sbatch`` on PATH records each call, so "submits nothing" is checked, not assumed.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from coci_hpc.cli.submit import main
from coci_hpc.submit.spec import command_digest


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_dry_run_prints_the_batch_script_and_submits_nothing(fake_slurm, capsys) -> None:
    rc, out, err = _run(capsys, "--partition", "gpu", "--nodes", "2", "--time", "1:30:00", "--signal-lead", "60",
                        "--dry-run", "train.py", "--", "--lr", "3e-4", "--dry-run")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in ("#SBATCH --partition=gpu", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --requeue", "#SBATCH --signal=USR2@60", "#SBATCH --time=90",
                 "#SBATCH --job-name=train", "#SBATCH --open-mode=append"):
        assert want in lines, f"{want!r} missing from:\n{out}"
    assert not any("wckey" in ln for ln in lines), "submitit's --wckey=submitit must be dropped"
    cwd = Path.cwd()
    digest = command_digest(cwd / "train.py", ["--lr", "3e-4", "--dry-run"])
    assert f"export COCI_CKPT_DIR={cwd / 'coci-runs/train' / f'ckpt-{digest}'}" in lines
    assert "export COCI_POLICY=coci" in lines and "export COCI_SIGNAL_LEAD_S=60" in lines
    assert "export COCI_MAX_REQUEUES=10" in lines and "export COCI_NO_PROGRESS_LIMIT=3" in lines
    srun = [ln for ln in lines if ln.startswith("srun ")]
    assert len(srun) == 1, out
    assert " --mpi=pmix " in srun[0]
    assert srun[0].endswith(f"-u -m submitit.core._submit {cwd / 'coci-runs/train/logs'}")
    assert f"--output {cwd / 'coci-runs/train/logs'}/%j_%t_log.out" in srun[0]
    assert fake_slurm.sbatch_calls() == []
    # A dry run creates nothing either.
    assert not (cwd / "coci-runs").exists()


def test_dry_run_is_exactly_what_is_submitted(fake_slurm, capsys) -> None:
    args = ("--partition", "urgent", "--nodes", "2", "--time", "2-00", "--mpi", "none", "--mem", "4G",
            "--sbatch-arg", "exclusive", "--sbatch-arg=--mail-type=END", "--policy", "fixed:25",
            "--ckpt-dir", "runs/x", "train.py", "--steps", "7")
    rc, dry, err = _run(capsys, "--dry-run", *args)
    assert rc == 0, err
    rc, out, err = _run(capsys, *args)
    assert rc == 0, err
    calls = fake_slurm.sbatch_calls()
    assert calls == [dry]
    assert "#SBATCH --exclusive" in dry and "#SBATCH --mail-type=END" in dry
    assert "#SBATCH --time=2880" in dry and "--mpi=none" in dry and "#SBATCH --mem=4G" in dry
    assert "export COCI_POLICY=fixed:25" in dry
    ckpt = Path.cwd() / "runs/x"
    assert ckpt.is_dir()
    assert "submitted job 4242" in out
    assert f"checkpoints    {ckpt}" in out
    assert f"coci-status {ckpt}" in out
    assert re.search(r"rank 0 log\s+\S+/4242_0_log.out", out), out


def test_array_dry_run_is_what_is_submitted(fake_slurm, capsys) -> None:
    rc, dry, err = _run(capsys, "--dry-run", "--array", "0-3%2", "train.py")
    assert rc == 0, err
    assert "#SBATCH --array=0-3%2" in dry
    assert "%A_%a_0_log.out" in dry
    rc, out, err = _run(capsys, "--array", "0-3%2", "train.py")
    assert rc == 0, err
    assert fake_slurm.sbatch_calls() == [dry]
    assert "array tasks 4242_0..4242_3" in out and f"ckpt-{command_digest(Path.cwd() / 'train.py', [])}/task<ID>  (ID 0..3)" in out
    # submitit's array path: one pickle per task, each running the same script
    assert len(list((Path.cwd() / "coci-runs/train/logs").glob("4242_*_submitted.pkl"))) == 4


def test_array_with_another_python_is_refused(fake_slurm, capsys) -> None:
    other = Path.cwd() / "other-python"     # --python must exist: an executable stand-in
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    _assert_refused(fake_slurm, capsys, 2, r"--python cannot be combined with --array",
                    "--array", "2", "--python", str(other), "train.py")


def _assert_refused(fake_slurm, capsys, code: int, pattern: str, *argv: str) -> str:
    rc, out, err = _run(capsys, *argv)
    assert rc == code, (rc, out, err)
    assert re.search(pattern, err), err
    assert "coci-submit: hint: " in err, err
    assert fake_slurm.sbatch_calls() == [], "nothing may be submitted after a failed check"
    return err


def test_missing_script(fake_slurm, capsys) -> None:
    _assert_refused(fake_slurm, capsys, 2, r"training script .*/nope\.py does not exist", "nope.py", "--lr", "1")


def test_unknown_partition_names_the_real_ones(fake_slurm, capsys) -> None:
    err = _assert_refused(fake_slurm, capsys, 2, r"partition 'gpux' does not exist", "-p", "gpux", "train.py")
    assert "use one of: gpu, urgent" in err


@pytest.mark.parametrize("bad", ["1:2:3:4", "abc", "10:61", "1-25", "0", "1:60:00", "-5", "1-2:3:4:5"])
def test_bad_time(fake_slurm, capsys, bad: str) -> None:
    _assert_refused(fake_slurm, capsys, 2, rf"--time '{re.escape(bad)}' is (not a duration|zero)",
                    f"--time={bad}", "train.py")


def test_unwritable_ckpt_dir(fake_slurm, capsys, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for dry in ((), ("--dry-run",)):
        _assert_refused(fake_slurm, capsys, 5, r"checkpoint directory .*a-file/ckpt (is not creatable|cannot be created)",
                        *dry, "--ckpt-dir", str(blocker / "ckpt"), "train.py")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a read-only bind mount")
def test_read_only_ckpt_dir_even_for_root(fake_slurm, capsys, tmp_path) -> None:
    """root passes os.access everywhere; the check writes a probe file instead."""
    import subprocess
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-o", "bind,ro", str(ro), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("bind mounts not permitted here")
    try:
        _assert_refused(fake_slurm, capsys, 5, r"checkpoint directory .*ro/ckpt is not creatable",
                        "--ckpt-dir", str(ro / "ckpt"), "train.py")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_slurm_unreachable(fake_slurm, capsys) -> None:
    fake_slurm.sinfo("echo 'slurm_load_partitions: Unable to contact slurm controller' >&2; exit 1")
    _assert_refused(fake_slurm, capsys, 3, r"cannot list the cluster's partitions: `sinfo .* failed .*Unable to contact", "train.py")


@pytest.mark.parametrize("argv,pattern", [
    (["--sbatch-arg", "signal=USR1@10"], r"sets --signal, which coci-submit manages"),
    (["--sbatch-arg=--time=5"], r"sets --time"),
    (["--sbatch-arg=-t=10"], r"sets --time"),
    (["--sbatch-arg", "sig=USR1@60"], r"sets --signal"),
    (["--sbatch-arg", "par=gpu"], r"is ambiguous: it abbreviates --parsable, --partition"),
    (["--gpus-per-node", "1", "--sbatch-arg", "gres=gpu:1"], r"conflicts with coci-submit's --gpus-per-node"),
    (["--mem", "4G", "--sbatch-arg", "mem-per-cpu=1G"], r"conflicts with coci-submit's --mem"),
    (["--sbatch-arg", "ntasks=4"], r"sets --ntasks, which coci-submit manages"),
    (["--sbatch-arg", "bad key"], r"is not an sbatch option"),
    (["--array", "1,3,5"], r"--array '1,3,5' is not supported"),
    (["--policy", "often"], r"unknown policy 'often'"),
    (["--nodes", "0"], r"--nodes 0 must be > 0"),
    (["--mem", "lots"], r"--mem 'lots' is not a Slurm memory size"),
    (["--time", "2", "--signal-lead", "90"], r"--signal-lead 90s is more than half of --time '2' read as MM \(minutes"),
    (["--nodes", "two"], r"invalid int value"),
])
def test_other_bad_options(fake_slurm, capsys, argv, pattern) -> None:
    _assert_refused(fake_slurm, capsys, 2, pattern, *argv, "train.py")


def test_script_arguments_pass_untouched(fake_slurm, capsys) -> None:
    """Everything after `SCRIPT --` belongs to the script, even options coci-submit also has."""
    import pickle  # submitit's own submission pickle: we only read what we handed it
    rc, out, err = _run(capsys, "train.py", "--", "--nodes", "9", "--time", "x", "--", "-p")
    assert rc == 0, err
    pkl = next((Path.cwd() / "coci-runs/train/logs").glob("4242_submitted.pkl"))
    with pkl.open("rb") as f:
        delayed = pickle.load(f)
    runner = delayed.function
    assert runner.args == ("--nodes", "9", "--time", "x", "--", "-p")
    assert runner.script == str(Path.cwd() / "train.py")
    digest = command_digest(Path.cwd() / "train.py", runner.args)
    assert runner.env["COCI_CKPT_DIR"] == str(Path.cwd() / "coci-runs/train" / f"ckpt-{digest}")


def test_the_default_ckpt_dir_is_distinct_per_command(fake_slurm, capsys) -> None:
    """A sweep: train.py --seed 7 after --seed 0 must not resume seed 0's checkpoint."""
    (Path.cwd() / "other.py").write_text("")
    dirs = []
    for argv in (["train.py", "--seed", "0"], ["train.py", "--seed", "7"], ["train.py", "--seed", "0"],
                 ["--job-name", "train", "other.py", "--seed", "0"]):
        rc, out, err = _run(capsys, *argv)
        assert rc == 0, err
        dirs.append(re.search(r"checkpoints\s+(\S+)", out).group(1))
    assert dirs[0] == dirs[2]                           # the same command resumes the same run
    assert len({dirs[0], dirs[1], dirs[3]}) == 3         # another seed, another script: their own
    assert all(Path(d).parent == Path.cwd() / "coci-runs/train" for d in dirs)


def test_resume_from_other_run_reaches_the_session(fake_slurm, capsys) -> None:
    rc, dry, err = _run(capsys, "--dry-run", "--resume-from-other-run", "train.py")
    assert rc == 0, err
    assert "export COCI_RESUME_FROM_OTHER_RUN=1" in dry.splitlines()
    rc, dry, err = _run(capsys, "--dry-run", "train.py")
    assert "COCI_RESUME_FROM_OTHER_RUN" not in dry


def test_signal_lead_derived_from_a_profile(fake_slurm, capsys, tmp_path) -> None:
    # 60 s steps and 40 s saves: the default 90 s lead would end the job TIMEOUT (never requeued).
    prof = tmp_path / "profile.json"
    prof.write_text('{"samples": [], "step_time_s": 60.0, "ckpt_cost_s": 25.0, "persist_s": 15.0}')
    rc, out, err = _run(capsys, "--time", "1:00:00", "--lead-from-profile", str(prof), "--dry-run", "train.py")
    assert rc == 0, err
    assert "#SBATCH --signal=USR2@200" in out.splitlines() and "export COCI_SIGNAL_LEAD_S=200" in out
    assert "signal lead 200s from" in err
    rc, out, err = _run(capsys, "--signal-lead", "60", "--lead-from-profile", str(prof), "--dry-run", "train.py")
    assert rc != 0 and "both given" in err
    prof.write_text('{"samples": []}')
    rc, out, err = _run(capsys, "--lead-from-profile", str(prof), "--dry-run", "train.py")
    assert rc != 0 and "no step time" in err
    rc, out, err = _run(capsys, "--dry-run", "train.py")
    assert "#SBATCH --signal=USR2@90" in out.splitlines()                 # the default is unchanged
