"""The session's configuration: explicit arguments, else coci-submit's environment, else defaults.

One table (``_FIELDS``) names every setting and its row of :mod:`coci_hpc.settings` (the
``COCI_*`` variable, its type and its default), so a new setting is one line. An argument the script passes explicitly wins over the environment;
when both are set and differ, the conflict is reported (the session logs it on rank 0).
In a Slurm array job the checkpoint directory is ``<ckpt_dir>/task<SLURM_ARRAY_TASK_ID>``: the
tasks of one array share the submitted directory but never a checkpoint.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from coci_hpc import settings
from coci_hpc.errors import UsageError
from coci_hpc.planner.policies import make_policy
from coci_hpc.slurm.env import JobEnvironment

# field -> (environment variable, parser, default): the rows of coci_hpc.settings this config reads
_FIELDS: dict[str, tuple[str, Callable[[str], Any], Any]] = {
    field: (v.name, v.parse, v.default) for field, v in (
        ("ckpt_dir", settings.CKPT_DIR), ("policy", settings.POLICY),
        ("max_requeues", settings.MAX_REQUEUES),                     # None: no limit
        ("no_progress_limit", settings.NO_PROGRESS), ("signal_lead_s", settings.SIGNAL_LEAD),
        # the directory may hold another run's checkpoint (:mod:`.runrecord`); refused unless set
        ("resume_from_other_run", settings.RESUME_OTHER_RUN))}


@dataclass(frozen=True)
class SessionConfig:
    ckpt_dir: Path
    policy: str
    max_requeues: int | None
    no_progress_limit: int
    signal_lead_s: float | None
    sources: Mapping[str, str]          # field -> "argument" | "environment" | "default"
    resume_from_other_run: bool = False


assert set(_FIELDS) == {f.name for f in fields(SessionConfig)} - {"sources"}, "table and dataclass disagree"


def resolve(explicit: Mapping[str, Any], environ: Mapping[str, str] | None = None,
            job: JobEnvironment | None = None) -> tuple[SessionConfig, list[str]]:
    """Returns the configuration and one message per conflict between an argument and the environment."""
    env = os.environ if environ is None else environ
    unknown = set(explicit) - set(_FIELDS)
    if unknown:
        raise UsageError(f"unknown session setting(s) {sorted(unknown)}", hint=f"valid: {sorted(_FIELDS)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    conflicts: list[str] = []
    for name, (var, parse, default) in _FIELDS.items():
        raw = env.get(var)
        from_env = None
        if raw not in (None, ""):
            try:
                from_env = parse(raw)
            except ValueError:
                raise UsageError(f"{var}={raw!r} is not a valid {name}",
                                 hint=f"unset {var} or give a valid value") from None
        arg = explicit.get(name)
        if arg is not None:
            values[name], sources[name] = arg, "argument"
            if from_env is not None and str(from_env) != str(arg):
                conflicts.append(f"{name}: the script's {arg!r} wins over {var}={raw!r}")
        elif from_env is not None:
            values[name], sources[name] = from_env, "environment"
        else:
            values[name], sources[name] = default, "default"
    if values["ckpt_dir"] is None:
        raise UsageError("no checkpoint directory: pass ckpt_dir=... to Session or set COCI_CKPT_DIR",
                         hint="coci-submit --ckpt-dir DIR sets it; by hand: --ckpt-dir in your script")
    make_policy(str(values["policy"]))  # a bad spec fails here, with the valid list
    ckpt = Path(values["ckpt_dir"]).expanduser().absolute()
    job = job if job is not None else JobEnvironment.from_env(env)
    if job.array_task_id is not None:
        ckpt = ckpt / f"task{job.array_task_id}"
    cfg = SessionConfig(ckpt_dir=ckpt, policy=str(values["policy"]),
                        max_requeues=None if values["max_requeues"] is None else int(values["max_requeues"]),
                        no_progress_limit=int(values["no_progress_limit"]),
                        signal_lead_s=None if values["signal_lead_s"] is None else float(values["signal_lead_s"]),
                        sources=sources, resume_from_other_run=bool(values["resume_from_other_run"]))
    return cfg, conflicts
