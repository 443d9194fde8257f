"""The submitit adapter: a :class:`SubmitSpec` becomes a ``submitit.SlurmExecutor`` and a submission.

submitit renders the batch script, keeps the job folder (script, pickles, one log pair per task) and
returns a ``Job``; this module only fills its parameters. Render-then-send: :func:`render` returns
the exact text :func:`submit` hands to ``sbatch`` (a test compares the two through a fake sbatch).
"""
from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from coci_hpc.errors import SlurmError, UsageError
from coci_hpc.runtime.entry import Relauncher
from coci_hpc.submit.runner import ScriptRunner, clear_stale_result
from coci_hpc.submit.spec import SubmitSpec, executor_parameters


@dataclass(frozen=True)
class Submission:
    """What the user needs after submitting: where to look."""

    job_id: str
    task_ids: tuple[str, ...]       # the job itself, or one id per array task (<job>_<task>)
    log_paths: tuple[Path, ...]     # rank 0's stdout and stderr of the first task
    batch_script: Path
    ckpt_dir: Path


def _executor(spec: SubmitSpec, *, need_srun: bool = True):
    try:
        import submitit
    except ImportError as exc:  # declared in pyproject; a broken venv is the likely cause
        raise SlurmError("submitit is not importable", hint="run `bash slurm/setup` (or pip install submitit)") from exc
    if need_srun and shutil.which("srun") is None:
        raise SlurmError("`srun` not found on PATH: coci-submit needs Slurm's client commands",
                         hint="run on a login node of the cluster (for the local one: `slurm/devcluster up`)")
    if spec.array is not None and spec.python != shlex.quote(sys.executable):
        # submitit's array path builds a second executor without our `python` (submitit 1.5.4).
        raise UsageError("--python cannot be combined with --array",
                         hint="run coci-submit with the interpreter the nodes should use: /path/to/python -m coci_hpc.cli.submit ...")
    cls = submitit.SlurmExecutor
    if not need_srun:
        class _RenderOnly(submitit.SlurmExecutor):
            """submitit refuses to build an executor where `srun` is missing; rendering needs none."""

            @classmethod
            def affinity(cls) -> int:
                return 1
        cls = _RenderOnly
    ex = cls(folder=str(spec.log_dir), python=spec.python)
    ex.update_parameters(**executor_parameters(spec))
    if spec.array is not None:
        # submitit's array path copies the executor with map_count set; the dry run does the same.
        ex.parameters["map_count"] = spec.array[0]
    return ex


def _runner(spec: SubmitSpec) -> ScriptRunner | Relauncher:
    if spec.spare_nodes:
        return Relauncher(str(spec.script), spec.script_args, nodes=spec.nodes,
                          ntasks_per_node=spec.ntasks_per_node, mpi=spec.mpi, python=spec.python,
                          log_dir=str(spec.log_dir), max_restarts=spec.max_restarts,
                          prepare=clear_stale_result)
    return ScriptRunner(str(spec.script), spec.script_args, spec.coci_env())


def render(spec: SubmitSpec) -> str:
    """The batch script that :func:`submit` would pass to sbatch for this spec (rendered here, so
    Slurm's commands need not be installed)."""
    ex = _executor(spec, need_srun=False)
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def submit(spec: SubmitSpec) -> Submission:
    """Submit through submitit; a failing sbatch is a SlurmError naming its message."""
    ex = _executor(spec)
    if spec.array is not None:
        ex.parameters.pop("map_count")
    runner = _runner(spec)
    try:
        if spec.array is None:
            jobs = [ex.submit(runner)]
        else:
            jobs = ex.submit_array([runner] * spec.array[0])
    except Exception as exc:  # submitit wraps sbatch failures in its own FailedJobError/CalledProcessError
        raise SlurmError(f"sbatch refused the job: {str(exc).strip()}",
                         hint="check the options against `sinfo` and `sacctmgr show assoc`; "
                              "`coci-submit --dry-run ...` prints the batch script") from exc
    first = jobs[0]
    base_id = str(first.job_id).split("_")[0]
    return Submission(job_id=base_id, task_ids=tuple(str(j.job_id) for j in jobs),
                      log_paths=(Path(first.paths.stdout), Path(first.paths.stderr)),
                      batch_script=Path(first.paths.submission_file), ckpt_dir=spec.ckpt_dir)
