"""Pre-submit checks: each failure is one error naming the problem and the fix, before sbatch runs.

Exit codes (``coci_hpc.cli.common`` maps the error classes): 2 usage (missing script, unknown
partition, bad --time or other option), 3 Slurm unreachable (``sinfo`` fails), 5 checkpoint
directory not creatable or not writable.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from coci_hpc.errors import CheckpointError, SlurmError, UsageError
from coci_hpc.slurm import commands
from coci_hpc.submit.spec import SubmitSpec


def check_script(script: Path) -> None:
    if not script.exists():
        raise UsageError(f"training script {script} does not exist",
                         hint="give the path of your script after the options: coci-submit [OPTIONS] train.py [ARGS]")
    if not script.is_file():
        raise UsageError(f"training script {script} is not a file", hint="give the .py file, not a directory")


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


def run_all(spec: SubmitSpec, *, dry_run: bool, runner: commands.Runner = commands.run_command) -> None:
    """Every pre-submit check, cheapest first."""
    check_script(spec.script)
    check_ckpt_dir(spec.ckpt_dir, create=not dry_run)
    check_partition(spec.partition, runner)
