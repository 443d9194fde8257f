"""The pure spec (arrays, pass-through options) and the in-process script runner (time formats:
tests/slurm/test_timefmt.py)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coci_hpc.errors import UsageError
from coci_hpc.submit.spec import build_spec, executor_parameters, parse_array, parse_sbatch_arg

ROOT = Path(__file__).resolve().parents[2]


def test_array_forms() -> None:
    assert parse_array("4") == (4, None)
    assert parse_array("0-7%2") == (8, 2)
    for bad in ("1-3", "1,2", "0-3:2", "0", "3%0"):
        with pytest.raises(UsageError):
            parse_array(bad)


def test_sbatch_arg_forms() -> None:
    assert parse_sbatch_arg("exclusive") == ("exclusive", True)
    assert parse_sbatch_arg("--mail_type=END") == ("mail-type", "END")
    assert parse_sbatch_arg("comment=a=b") == ("comment", "a=b")
    with pytest.raises(UsageError, match="manages"):
        parse_sbatch_arg("--requeue")
    assert parse_sbatch_arg("-wn1") == ("nodelist", "n1")        # a short option, value attached
    assert parse_sbatch_arg("--time-min=10") == ("time-min", "10")  # an option, not a prefix of --time
    assert parse_sbatch_arg("--mail-t=ALL") == ("mail-type", "ALL")  # sbatch's unique-prefix rule


@pytest.mark.parametrize("text,managed", [
    ("-t=10", "time"), ("-t10", "time"), ("--t", "time"), ("t=10", "time"), ("sig=USR1@60", "signal"),
    ("--sig=B:USR1@60", "signal"), ("-p=gpu", "partition"), ("-pgpu", "partition"), ("--out=x", "output"),
    ("-n4", "ntasks"), ("ntasks=4", "ntasks"), ("--n=4", "ntasks"), ("-N2", "nodes"), ("--requ", "requeue"),
    ("-J", "job-name"), ("--arr=0-3", "array"), ("--acco=x", "account"),
])
def test_sbatch_arg_refuses_a_managed_option_whatever_the_spelling(text: str, managed: str) -> None:
    with pytest.raises(UsageError, match=f"sets --{managed}, which coci-submit manages"):
        parse_sbatch_arg(text)


@pytest.mark.parametrize("text", ["par=gpu", "--ti=5", "--me=4G"])
def test_sbatch_arg_refuses_a_prefix_that_may_mean_a_managed_option(text: str) -> None:
    with pytest.raises(UsageError, match="ambiguous") as e:
        parse_sbatch_arg(text)
    assert "managed by coci-submit" in (e.value.hint or "")


@pytest.mark.parametrize("own,passed,clash", [
    ({"gpus_per_node": 2}, "gres=gpu:2", "--gpus-per-node"),
    ({"gpus_per_node": 2}, "--gpus=4", "--gpus-per-node"),
    ({"gpus_per_node": 2}, "-G4", "--gpus-per-node"),
    ({"mem": "16G"}, "mem-per-cpu=2G", "--mem"),
    ({"mem": "16G"}, "--mem-per-gpu=8G", "--mem"),
    ({"cpus_per_task": 4}, "cpus-per-gpu=2", "--cpus-per-task"),
])
def test_sbatch_arg_refuses_what_conflicts_with_coci_submits_options(tmp_path: Path, own, passed, clash) -> None:
    with pytest.raises(UsageError, match=f"conflicts with coci-submit's {clash}"):
        build_spec(script="t.py", script_args=(), cwd=tmp_path, python="python", sbatch_args=[passed], **own)
    # without coci-submit's own option the same pass-through is fine
    spec = build_spec(script="t.py", script_args=(), cwd=tmp_path, python="python", sbatch_args=[passed])
    assert len(spec.sbatch_args) == 1


def test_unlimited_time_is_written_and_no_time_leaves_the_partition_default(tmp_path: Path) -> None:
    common = dict(script="t.py", script_args=(), cwd=tmp_path, python="python")
    assert executor_parameters(build_spec(**common))["time"] is None  # submitit writes no --time line
    assert executor_parameters(build_spec(**common, time="UNLIMITED"))["time"] == "INFINITE"
    spec = build_spec(**common, time="1-0", job_name="run1", output_dir="out", ckpt_dir="/abs/ck")
    assert executor_parameters(spec)["time"] == 1440
    assert spec.ckpt_dir == Path("/abs/ck") and spec.log_dir == tmp_path / "out/logs"
    assert spec.coci_env()["COCI_CKPT_DIR"] == "/abs/ck"


RUNNER_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from coci_hpc.submit.runner import ScriptRunner
    # submitit's handler, installed before the runner: it must never run.
    signal.signal(signal.SIGUSR2, lambda *a: (print("SUBMITIT HANDLER RAN", flush=True), sys.exit(9)))
    rc = ScriptRunner(sys.argv[1], ("--lr", "3e-4", "--steps"), {"COCI_CKPT_DIR": "/x/ck"})()
    print("runner returned", rc, flush=True)
""")

USER_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    print("argv", sys.argv[1:], "ckpt", os.environ["COCI_CKPT_DIR"], "name", __name__, flush=True)
    os.kill(os.getpid(), signal.SIGUSR2)      # a preemption while the script is still importing
    time.sleep(0.3)
    got = []
    prev = signal.getsignal(signal.SIGUSR2)
    def session_handler(s, f):      # the Session records, then chains to the handler it replaced
        got.append(s)
        prev(s, f)
    signal.signal(signal.SIGUSR2, session_handler)   # the Session takes over the signal
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)                          # the hand-over happens once, not in a loop
    print("session saw", [signal.Signals(s).name for s in got], flush=True)
    sys.exit(0)
""")


def test_runner_runs_the_script_in_process_and_hands_an_early_signal_to_the_session(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    p = subprocess.run([sys.executable, "-c", RUNNER_CHILD, str(script)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "argv ['--lr', '3e-4', '--steps'] ckpt /x/ck name __main__" in p.stdout
    assert "session saw ['SIGUSR2']" in p.stdout, p.stdout + p.stderr
    assert "SUBMITIT HANDLER RAN" not in p.stdout
    assert "runner returned 0" in p.stdout
    assert p.stderr.count("SIGUSR2 received while no training session runs") == 1, p.stderr


def test_runner_substitutes_the_array_task_id_in_the_arguments(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    script.write_text("import sys; print('argv', sys.argv[1:], flush=True)\n")
    child = RUNNER_CHILD.replace('("--lr", "3e-4", "--steps")', '("--seed", "%a", "--out=run%a/x")')
    env = {**os.environ, "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "43"}
    p = subprocess.run([sys.executable, "-c", child, str(script)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "argv ['--seed', '3', '--out=run3/x']" in p.stdout
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_ARRAY")}  # not an array task
    p = subprocess.run([sys.executable, "-c", child, str(script)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=env)
    assert "argv ['--seed', '%a', '--out=run%a/x']" in p.stdout, p.stdout + p.stderr


def test_runner_propagates_a_failing_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys; sys.exit(3)\n")
    p = subprocess.run([sys.executable, "-c", RUNNER_CHILD, str(script)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "runner returned" not in p.stdout


STALE_RESULT_CHILD = textwrap.dedent("""
import sys
from pathlib import Path
from submitit.core import submission, utils
from submitit.core.job_environment import JobPaths
from coci_hpc.submit.runner import ScriptRunner

folder, script = Path(sys.argv[1]), sys.argv[2]
folder.mkdir()
paths = JobPaths(folder, job_id="77", task_id=0)
utils.DelayedSubmission(ScriptRunner(script, (), {})).dump(paths.submitted_pickle)
stale = paths.result_pickle.with_suffix(paths.result_pickle.suffix + ".save_tmp")
stale.write_bytes(b"half a pickle: the attempt Slurm ended while rank 0 wrote its result")
submission.process_job(folder)             # what `python -m submitit.core._submit` runs
print("result", utils.pickle_load(paths.result_pickle), "stale left", stale.exists(), flush=True)
""")


def test_a_result_file_torn_by_an_earlier_attempt_does_not_fail_the_next_one(tmp_path: Path) -> None:
    """A requeue ends the tasks at once, sometimes inside submitit's write of rank 0's result;
    submitit then refuses the next attempt's write ("A temporary saved file already exists") and
    the job that trained to the end shows FAILED. The runner clears the leftover first."""
    script = tmp_path / "train.py"
    script.write_text("print('trained', flush=True)\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM")},
           "SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1"}
    p = subprocess.run([sys.executable, "-c", STALE_RESULT_CHILD, str(tmp_path / "job"), str(script)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "trained" in p.stdout
    assert "result ('success', 0) stale left False" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("spare", [0, 1])
def test_a_rank_that_segfaults_prints_its_python_stack(tmp_path: Path, spare: int) -> None:
    """The batch script's setup lines switch Python's fault handler on (plain and --spare-nodes
    jobs): a rank that dies in native code says where, in Python, it was. A value the user
    exported wins: an empty one switches it off."""
    spec = build_spec(script="t.py", script_args=[], cwd=tmp_path, python=sys.executable, nodes=2,
                      spare_nodes=spare)
    setup = "\n".join(executor_parameters(spec)["setup"])
    crash = tmp_path / "crash.py"
    crash.write_text("import ctypes\n\n\ndef load_shard():\n    ctypes.string_at(0)\n\n\nload_shard()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    on = subprocess.run(["bash", "-c", f"{setup}\n{shlex.quote(sys.executable)} {crash}"],
                        capture_output=True, text=True, env=env, timeout=60)
    assert on.returncode != 0
    assert "Fatal Python error: Segmentation fault" in on.stderr, on.stderr
    assert re.search(r'File ".*crash\.py", line 5 in load_shard', on.stderr), on.stderr
    off = subprocess.run(["bash", "-c", f"{setup}\n{shlex.quote(sys.executable)} {crash}"],
                         capture_output=True, text=True, env={**env, "PYTHONFAULTHANDLER": ""}, timeout=60)
    assert off.returncode != 0 and "load_shard" not in off.stderr, off.stderr
