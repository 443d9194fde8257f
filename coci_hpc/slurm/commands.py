"""Thin adapters around Slurm commands. One runner, replaceable in tests; no policy here."""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from coci_hpc.errors import SlurmError
from coci_hpc.slurm import states
from coci_hpc.slurm.timefmt import printed_s

Runner = Callable[[Sequence[str]], str]


def run_command(argv: Sequence[str], timeout: float = 60.0) -> str:
    """Run a Slurm command and return its stdout; a missing command or non-zero exit is a SlurmError."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"`{argv[0]}` not found on PATH",
                         hint="run inside a Slurm allocation or on a login node with Slurm's client commands")
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"`{' '.join(argv)}` did not answer within {timeout:.0f}s",
                         hint="is slurmctld up? (`scontrol ping`)") from exc
    if p.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p.stdout


def partition_names(runner: Runner = run_command) -> list[str]:
    """The cluster's partition names, from ``sinfo`` (the default one without its ``*``)."""
    out = runner(["sinfo", "-h", "-o", "%P"])
    return sorted({p.strip().rstrip("*") for p in out.split() if p.strip()})


def requeue(job_id: str, runner: Runner = run_command) -> None:
    """Ask Slurm to requeue the job: it is ended now and starts again as the same job id."""
    runner(["scontrol", "requeue", job_id])


def job_active(job_id: str, runner: Runner = run_command) -> bool:
    """Whether Slurm still knows the job as queued or running (``squeue``; an unknown id is not)."""
    try:
        out = runner(["squeue", "-h", "-j", job_id, "-o", "%T"]).strip()
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return False
        raise
    return bool(out) and not all(s in states.NOT_ACTIVE for s in out.split())


def step_active(job_id: str, step_id: str, runner: Runner = run_command) -> bool | None:
    """Whether step ``job_id.step_id`` still runs (``squeue --steps``); None when Slurm cannot say.

    squeue lists the srun steps of running jobs; whether it lists the batch and extern steps
    depends on the Slurm version (22.05 does), so an unlisted one of those is unknown (None).
    """
    try:
        out = runner(["squeue", "-h", "--steps", "-j", job_id, "-o", "%i"])
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return False
        raise
    if f"{job_id}.{step_id}" in out.split():
        return True
    return False if step_id.isdigit() else None


def time_left_s(job_id: str, runner: Runner = run_command) -> float | None:
    """Seconds until the job's time limit, from Slurm (``squeue %L``); None when unlimited or unknown."""
    out = runner(["squeue", "-h", "-j", job_id, "-o", "%L"]).strip()
    return printed_s(out)


# sinfo's short states (%t) of a node that cannot take a step: down, drained or draining, failed,
# booting, in maintenance, unknown; a trailing "*" means it does not respond.
_UNHEALTHY = ("down", "drain", "drng", "fail", "boot", "maint", "unk", "inval", "futr", "pow", "npc")


def hostnames(nodelist: str, runner: Runner = run_command) -> list[str]:
    """A Slurm node list (``n[1-3]``) expanded, in Slurm's order (``scontrol show hostnames``)."""
    if not nodelist.strip():
        return []
    return runner(["scontrol", "show", "hostnames", nodelist]).split()


def job_nodes(job_id: str, runner: Runner = run_command) -> list[str]:
    """The nodes the job holds now (``squeue %N``): with ``--no-kill`` a DOWN node leaves this list."""
    return hostnames(runner(["squeue", "-h", "-j", job_id, "-o", "%N"]).strip(), runner)


def unhealthy_nodes(nodes: Sequence[str], runner: Runner = run_command) -> dict[str, str]:
    """The nodes of ``nodes`` that cannot take a step, with their sinfo state (``down*``, ``drain``...)."""
    if not nodes:
        return {}
    out = runner(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"])
    bad = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and (parts[1].endswith("*") or parts[1].rstrip("*~#!%$@^-").startswith(_UNHEALTHY)):
            bad[parts[0]] = parts[1]
    return bad


# srun's own lines (its stderr) when a task of the step ended abnormally or its node failed:
# "srun: error: n2: task 1: Killed", "... task 0: Exited with exit code 1", "srun: error: Node failure on n2".
# The group ``node`` names the node.
SRUN_TASK_LOSS = re.compile(r"^srun: error: (?:(?P<node>\S+): tasks? [\d,\-]+: |Node failure on (?P<down>\S+))")


def srun_lost_node(line: str) -> str | None:
    """The node named by one of srun's task-loss lines (:data:`SRUN_TASK_LOSS`), else None."""
    m = SRUN_TASK_LOSS.search(line)
    return None if m is None else (m.group("node") or m.group("down"))


SRUN_TASK_IDS = re.compile(r"^srun: error: \S+: tasks? (?P<ids>[\d,\-]+): ")


def srun_ended_tasks(line: str) -> tuple[str, int | None] | None:
    """The node and how many of its tasks one of srun's task-loss lines reports ended ("task 1",
    "tasks 0-1,3"); the count is None for "Node failure on NODE" (every task there). Else None."""
    node = srun_lost_node(line)
    if node is None:
        return None
    m = SRUN_TASK_IDS.search(line)
    if m is None:
        return node, None
    n = 0
    for part in m.group("ids").split(","):
        lo, _, hi = part.partition("-")
        n += int(hi) - int(lo) + 1 if hi else 1
    return node, n


def end_step_signals(srun: subprocess.Popen) -> None:
    """End a running srun step with every task in it: two SIGINTs to srun within a second make it
    SIGKILL the step's tasks (srun(1), "Force Terminated"); the step then ends and srun returns."""
    srun.send_signal(signal.SIGINT)
    time.sleep(0.3)
    srun.send_signal(signal.SIGINT)


def rank_step_argv(*, nodes: Sequence[str], ntasks_per_node: int, mpi: str, stdout: str, stderr: str,
                   command: Sequence[str]) -> list[str]:
    """The ``srun`` that starts the training ranks on exactly ``nodes``, inside the allocation.

    ``--no-kill``: a node lost during the step ends only its own tasks, so the survivors stay free to
    save (the node-failure design); ``--open-mode=append`` keeps every relaunch's output in one log.
    """
    return ["srun", "--no-kill", "--unbuffered", f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * ntasks_per_node}", f"--ntasks-per-node={ntasks_per_node}",
            f"--nodelist={','.join(nodes)}", f"--mpi={mpi}", "--open-mode=append",
            "--output", stdout, "--error", stderr, *command]
