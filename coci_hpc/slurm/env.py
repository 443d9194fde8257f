"""The one place that reads ``SLURM_*``: a frozen view of the job this process runs in.

Everything else takes a :class:`JobEnvironment`; tests build one from a plain dict.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

# attribute -> (variable, type). Table-driven so that a new field is one line, not a new getter.
_TABLE: dict[str, tuple[str, type]] = {
    "job_id": ("SLURM_JOB_ID", str),
    "array_job_id": ("SLURM_ARRAY_JOB_ID", str),
    "array_task_id": ("SLURM_ARRAY_TASK_ID", str),
    "job_name": ("SLURM_JOB_NAME", str),
    "partition": ("SLURM_JOB_PARTITION", str),
    "nodelist": ("SLURM_JOB_NODELIST", str),
    "num_nodes": ("SLURM_JOB_NUM_NODES", int),
    "node_name": ("SLURMD_NODENAME", str),
    "ntasks": ("SLURM_NTASKS", int),
    "procid": ("SLURM_PROCID", int),
    "step_num_tasks": ("SLURM_STEP_NUM_TASKS", int),  # tasks of this srun step (unset in the batch script)
    "localid": ("SLURM_LOCALID", int),
    "restart_count": ("SLURM_RESTART_COUNT", int),
    "step_id": ("SLURM_STEP_ID", str),  # "0", "1", ... under srun; "batch" in the batch script
    # The srun step's own nodes: fewer than the job's under --spare-nodes (the spares idle).
    "step_nodelist": ("SLURM_STEP_NODELIST", str),
    "step_num_nodes": ("SLURM_STEP_NUM_NODES", int),
    "submit_dir": ("SLURM_SUBMIT_DIR", str),
}


@dataclass(frozen=True)
class JobEnvironment:
    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    job_name: str | None = None
    partition: str | None = None
    nodelist: str | None = None
    num_nodes: int | None = None
    node_name: str | None = None
    ntasks: int | None = None
    procid: int | None = None
    step_num_tasks: int | None = None
    localid: int | None = None
    restart_count: int = 0
    step_id: str | None = None
    step_nodelist: str | None = None
    step_num_nodes: int | None = None
    submit_dir: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JobEnvironment:
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name, (var, typ) in _TABLE.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            try:
                values[name] = typ(raw)
            except ValueError:
                # Slurm never sets these to non-numbers; a hand-set one is ignored rather than fatal.
                continue
        return cls(**values)  # type: ignore[arg-type]

    @property
    def in_slurm_job(self) -> bool:
        return self.job_id is not None

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node of this step (the step's nodes: spare nodes run no rank); 1 when not known."""
        used_nodes = self.step_num_nodes or self.num_nodes
        return (self.ntasks // used_nodes) if self.ntasks and used_nodes else 1

    @property
    def requeue_id(self) -> str | None:
        """The id `scontrol requeue` takes: for an array task, ``<array job>_<task>``."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id


assert set(_TABLE) == {f.name for f in fields(JobEnvironment)}, "table and dataclass disagree"
