"""Pre-submit checks: each failure is one error naming the problem and the fix, before sbatch runs.

Exit codes (``coci_hpc.cli.common`` maps the error classes): 2 usage (missing or non-Python
script, unknown partition, a --python that does not exist, bad --time or other option), 3 Slurm
unreachable (``sinfo`` fails; a dry run notes it instead), 5 checkpoint directory not creatable,
not writable, or another run's.
"""
from __future__ import annotations

import functools
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from coci_hpc.errors import CheckpointError, CheckpointOtherRun, SlurmError, UsageError
from coci_hpc.runtime import entry as runtime
from coci_hpc.slurm import commands
from coci_hpc.submit.runner import ARRAY_TASK
from coci_hpc.submit.spec import SubmitSpec

_SHELL_SUFFIXES = (".sh", ".bash", ".zsh", ".ksh", ".csh", ".tcsh")
_SHELL_HINT = ("coci-submit runs a Python script inside each rank's process (that is how its Session gets "
               "Slurm's signals): give the Python script your shell script runs, with its arguments, and set "
               "environment variables before coci-submit (they reach the job); a shell job belongs in sbatch "
               "(see slurm/templates/train_preemptible.sbatch)")


def check_script(script: Path, *, compile_here: bool = True) -> None:
    """The script exists and is Python: a shell script or a syntax error would fail only on the
    node, after queueing. ``compile_here``: also compile it with this interpreter (skipped when the
    nodes run another one, which may take newer syntax)."""
    if not script.exists():
        raise UsageError(f"training script {script} does not exist",
                         hint="give the path of your script after the options: coci-submit [OPTIONS] train.py [ARGS]")
    if not script.is_file():
        raise UsageError(f"training script {script} is not a file", hint="give the .py file, not a directory")
    try:
        source = script.read_bytes()
    except OSError as exc:
        raise UsageError(f"training script {script} cannot be read: {exc.strerror or exc}",
                         hint="check its permissions") from exc
    first = source.split(b"\n", 1)[0]
    if script.suffix.lower() in _SHELL_SUFFIXES or (first.startswith(b"#!") and b"python" not in first):
        what = first.decode(errors="replace").strip() if first.startswith(b"#!") else script.suffix
        raise UsageError(f"training script {script} is a shell script ({what}), not Python", hint=_SHELL_HINT)
    if not compile_here:
        return
    try:
        compile(source, str(script), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise UsageError(f"training script {script} is not valid Python: line {exc.lineno}: {exc.msg}",
                         hint="fix the script (`python -m py_compile SCRIPT` shows the same), or, if it is not a "
                              "Python script: " + _SHELL_HINT) from None
    except ValueError as exc:  # NUL bytes: a binary
        raise UsageError(f"training script {script} is not a Python source file ({exc})",
                         hint="give the .py file that trains") from None


def check_python(python: str) -> None:
    """``--python``: the interpreter the nodes run must exist; the login node sees the same
    filesystem and (sbatch exports the environment) the same PATH on most clusters."""
    try:
        words = shlex.split(python)
    except ValueError as exc:
        raise UsageError(f"--python {python!r} cannot be read as a command: {exc}",
                         hint="give the interpreter's path, e.g. --python /opt/venv/bin/python") from None
    if not words:
        raise UsageError("--python is empty", hint="give the interpreter's path, e.g. --python /opt/venv/bin/python")
    exe = words[0]
    hint = ("give the Python the nodes should run (a path every node sees, e.g. your venv's bin/python), "
            "or leave --python out to use this one")
    if "/" in exe:
        path = Path(exe)
        if not path.is_file():
            raise UsageError(f"--python {exe} does not exist", hint=hint)
        if not os.access(path, os.X_OK):
            raise UsageError(f"--python {exe} is not executable", hint=hint)
    elif shutil.which(exe) is None:
        raise UsageError(f"--python {exe} is not on PATH", hint=hint)


def check_partition(partition: str | None, runner: commands.Runner = commands.run_command) -> None:
    """An unknown partition names the real ones. None (the cluster's default) still needs Slurm up."""
    try:
        names = commands.partition_names(runner)
    except SlurmError as exc:
        raise SlurmError(f"cannot list the cluster's partitions: {exc.message}",
                         hint=exc.hint or "is slurmctld up? (`scontrol ping`; the local cluster: "
                                          "`slurm/devcluster up`)") from exc
    if partition is not None and partition not in names:
        raise UsageError(f"partition {partition!r} does not exist on this cluster",
                         hint=f"use one of: {', '.join(names) or '(sinfo lists none)'}")


def check_ckpt_dir(ckpt_dir: Path, *, create: bool) -> None:
    """The checkpoint directory must be creatable and writable by this user.

    With ``create`` it is made (the job would make it anyway); without (a dry run) the nearest
    existing ancestor is probed instead, so a dry run leaves no directories behind. Writability is
    proved by writing a file, not by ``os.access``: root passes ``os.access`` on a read-only mount.
    """
    hint = "pass --ckpt-dir on a filesystem you can write that every node sees (e.g. your scratch)"
    probe_dir = ckpt_dir
    try:
        if create:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
        else:
            while not probe_dir.exists():
                probe_dir = probe_dir.parent
        if not probe_dir.is_dir():
            raise CheckpointError(f"checkpoint directory {ckpt_dir} cannot be created: "
                                  f"{probe_dir} is not a directory", hint=hint)
        fd, name = tempfile.mkstemp(prefix=".coci-submit-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {ckpt_dir} is not {'creatable' if create else 'writable'}: "
                              f"{exc.strerror or exc}", hint=hint) from exc


def check_run_ownership(spec: SubmitSpec) -> None:
    """One run, one directory, checked at submission as the Session checks it at start
    (:mod:`coci_hpc.runtime.runrecord`): a job onto another run's checkpoint directory would queue,
    start and be refused on the node. Each array task has its own directory (``task<ID>``)."""
    if spec.resume_from_other_run:
        return
    dirs: list[tuple[Path, tuple[str, ...]]] = [(spec.ckpt_dir, spec.script_args)]
    if spec.array is not None:
        dirs = [(spec.ckpt_dir / f"task{i}", tuple(a.replace(ARRAY_TASK, str(i)) for a in spec.script_args))
                for i in range(spec.array[0])]
    for ckpt, args in dirs:
        try:
            recorded = runtime.recorded_run(runtime.read_events(ckpt))
        except OSError as exc:
            raise CheckpointError(f"cannot read the event log in {ckpt}: {exc.strerror or exc}",
                                  hint="check the directory's permissions, or pass another --ckpt-dir") from exc
        # The Session compares sys.argv, which coci-submit's runner sets to the absolute script + args.
        diff = runtime.difference(recorded, runtime.current_run([str(spec.script), *args], 0))
        if diff is not None:
            raise CheckpointOtherRun(f"checkpoint directory {ckpt} belongs to another run: {diff}",
                                     hint=runtime.RUN_RECORD_HINT)


# A dry run asks Slurm briefly: sinfo retries a down slurmctld for about 10 s in silence.
DRY_RUN_SLURM_TIMEOUT_S = 3.0


def run_all(spec: SubmitSpec, *, dry_run: bool, runner: commands.Runner = commands.run_command) -> list[str]:
    """Every pre-submit check, cheapest first. Returns what a dry run could not check (a submission
    raises instead): a dry run needs no running Slurm."""
    check_script(spec.script, compile_here=spec.python == shlex.quote(sys.executable))
    check_python(spec.python)
    check_ckpt_dir(spec.ckpt_dir, create=not dry_run)
    check_run_ownership(spec)
    if not dry_run:
        check_partition(spec.partition, runner)
        return []
    if runner is commands.run_command:
        runner = functools.partial(commands.run_command, timeout=DRY_RUN_SLURM_TIMEOUT_S)
    try:
        check_partition(spec.partition, runner)
    except SlurmError as exc:
        what = f"partition {spec.partition!r}" if spec.partition else "that Slurm answers"
        lines = [ln.strip() for ln in exc.message.splitlines() if ln.strip()]
        # sinfo's last line is the one that says why (a "fatal:", "Unable to contact ...").
        why = lines[0] if len(lines) < 2 else f"{lines[0].split(':')[0]}: ... {lines[-1]}"
        return [f"{what} ({why})"]
    return []
