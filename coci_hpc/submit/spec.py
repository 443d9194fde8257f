"""What ``coci-submit`` was asked to do, validated into one frozen :class:`SubmitSpec`.

Pure: strings in, a spec (or a :class:`~coci_hpc.errors.UsageError` naming the option) out. No
filesystem, no Slurm; the checks that need them live in :mod:`coci_hpc.submit.checks`.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coci_hpc import settings
from coci_hpc.errors import UsageError
from coci_hpc.slurm.timefmt import read_limit


def parse_array(text: str) -> tuple[int, int | None]:
    """``--array`` -> (number of tasks, max running at once or None).

    submitit runs arrays as tasks 0..N-1 (its own pickles and ``%A_%a`` log names), so the forms it
    can run are ``N`` (tasks 0..N-1) and ``0-M``, each with an optional ``%K`` throttle.
    """
    m = re.fullmatch(r"(?:(\d+)|0-(\d+))(?:%(\d+))?", text.strip())
    if not m:
        raise UsageError(f"--array {text!r} is not supported",
                         hint="coci-submit runs array tasks 0..N-1: give --array N or --array 0-M, "
                              "optionally with %K (at most K at once), e.g. --array 0-7%2")
    count = int(m.group(1)) if m.group(1) is not None else int(m.group(2)) + 1
    if count < 1:
        raise UsageError(f"--array {text!r} has no tasks", hint="give at least one task: --array 1")
    throttle = int(m.group(3)) if m.group(3) else None
    if throttle is not None and throttle < 1:
        raise UsageError(f"--array {text!r}: %0 runs nothing", hint="use %K with K >= 1")
    return count, throttle


_MEM_RE = re.compile(r"\d+[KMGT]?B?", re.IGNORECASE)
# srun's --mpi plugins (`srun --mpi=list`, Slurm 22.05 to 24.x); anything else fails only on the node.
MPI_PLUGINS = ("pmix", "pmix_v2", "pmix_v3", "pmix_v4", "pmix_v5", "pmi2", "cray_shasta", "none")

# sbatch options that coci-submit sets itself, or that have a first-class option of their own:
# a pass-through of them would silently fight the managed value.
_MANAGED = {
    "signal": "--signal-lead", "requeue": "(always on)", "no-requeue": "(coci-submit requeues)",
    "output": "--output-dir", "error": "--output-dir", "open-mode": "(always append)",
    "partition": "--partition", "nodes": "--nodes", "ntasks-per-node": "--ntasks-per-node",
    "gpus-per-node": "--gpus-per-node", "cpus-per-task": "--cpus-per-task", "mem": "--mem",
    "time": "--time", "account": "--account", "qos": "--qos", "constraint": "--constraint",
    "job-name": "--job-name", "array": "--array", "wrap": "(the script is the job)",
    # coci-submit starts nodes x ntasks-per-node ranks; a task count of its own would contradict it.
    "ntasks": "--nodes and --ntasks-per-node",
}

# sbatch's long options (sbatch(1), Slurm 22.05 to 24.11); an option not here is refused. sbatch takes any unambiguous prefix of
# one (getopt_long), so `--sig=USR1@60` is --signal: the pass-through check resolves prefixes the
# same way instead of trusting the spelling.
SBATCH_LONG_OPTIONS = frozenset("""
    account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint
    container container-id contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline
    delay-boot dependency distribution error exclude exclusive export export-file extra-node-info
    get-user-env gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres
    gres-flags hint hold ignore-pbs input job-name kill-on-invalid-dep licenses mail-type mail-user
    mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus network nice no-kill no-requeue nodefile
    nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket open-mode
    oom-kill-step output overcommit oversubscribe parsable partition power prefer priority profile propagate qos
    quiet reboot requeue reservation segment signal sockets-per-node spread-job stepmgr switches test-only
    thread-spec threads-per-core time time-min tmp tres-bind tres-per-task uid use-min-nodes verbose wait
    wait-all-nodes wckey wrap
""".split())

# sbatch's short options, case-sensitive (-N nodes, -n ntasks).
SBATCH_SHORT_OPTIONS = {
    "a": "array", "A": "account", "b": "begin", "B": "extra-node-info", "c": "cpus-per-task",
    "C": "constraint", "d": "dependency", "D": "chdir", "e": "error", "F": "nodefile", "G": "gpus",
    "H": "hold", "i": "input", "J": "job-name", "k": "no-kill", "L": "licenses", "m": "distribution",
    "M": "clusters", "n": "ntasks", "N": "nodes", "o": "output", "O": "overcommit", "p": "partition",
    "q": "qos", "Q": "quiet", "s": "oversubscribe", "S": "core-spec", "t": "time", "v": "verbose",
    "W": "wait", "w": "nodelist", "x": "exclude",
}


def _sbatch_option(text: str, given: str) -> str:
    """The sbatch long option that ``given`` (as typed, dashes stripped) names, resolved as sbatch does."""
    if len(given) == 1 and given in SBATCH_SHORT_OPTIONS:
        return SBATCH_SHORT_OPTIONS[given]
    key = given.lower().replace("_", "-")
    if key in SBATCH_LONG_OPTIONS:
        return key
    matches = sorted(o for o in SBATCH_LONG_OPTIONS if o.startswith(key))
    managed = [o for o in matches if o in _MANAGED]
    if len(matches) == 1 or (matches and len(managed) == len(matches)):
        return matches[0]
    if managed:  # sbatch would call it ambiguous; it may mean one coci-submit manages
        raise UsageError(f"--sbatch-arg {text!r} is ambiguous: it abbreviates {', '.join('--' + m for m in matches)}",
                         hint=f"spell the option out; {', '.join('--' + m for m in managed)} "
                              f"{'is' if len(managed) == 1 else 'are'} managed by coci-submit "
                              f"({', '.join(_MANAGED[m] for m in managed)})")
    if len(matches) > 1:
        raise UsageError(f"--sbatch-arg {text!r} is ambiguous: it abbreviates {', '.join('--' + m for m in matches)}",
                         hint="spell the option out")
    close = difflib.get_close_matches(key, sorted(SBATCH_LONG_OPTIONS), n=3, cutoff=0.6)
    raise UsageError(f"--sbatch-arg {text!r}: sbatch has no option --{key}",
                     hint=(f"did you mean {', '.join('--' + c for c in close)}? " if close else "")
                          + "see `sbatch --help`; coci-submit knows sbatch's options up to Slurm 24.x")


def parse_sbatch_arg(text: str) -> tuple[str, str | bool]:
    """One pass-through sbatch option -> (long option name, value).

    Takes sbatch's spellings: ``exclusive``, ``--exclusive``, ``mail-type=END``, ``-t=10``,
    ``-t10``, a prefix such as ``sig=USR1@60``. An option coci-submit manages is refused whatever
    the spelling (see ``_MANAGED``).
    """
    s = text.strip()
    if re.match(r"-[A-Za-z].", s):
        # One dash is a short option, as sbatch's getopt reads it: -t10, -t=10 (-exclusive is -e xclusive).
        given, eq, value = s[1], "=", s[2:].removeprefix("=")
    else:
        given, eq, value = s.lstrip("-").partition("=")
        given = given.strip()
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", given):
        raise UsageError(f"--sbatch-arg {text!r} is not an sbatch option",
                         hint="spell it as sbatch does, without or with dashes: --sbatch-arg exclusive, "
                              "--sbatch-arg mail-type=END")
    key = _sbatch_option(text, given)
    if key in _MANAGED:
        how = _MANAGED[key]
        raise UsageError(f"--sbatch-arg {text!r} sets --{key}, which coci-submit manages",
                         hint=f"leave it out {how}" if how.startswith("(") else f"use {how} instead")
    return key, (value if eq else True)


def _check_sbatch_conflicts(args: Sequence[tuple[str, str | bool]], *, gpus_per_node: int | None,
                            mem: str | None, cpus_per_task: int | None) -> None:
    """Pass-through options that Slurm refuses, or silently reinterprets, beside coci-submit's own."""
    for key, value in args:
        clash = None
        if gpus_per_node is not None and (key in ("gpus", "gpus-per-task", "gpus-per-socket")
                                          or (key == "gres" and "gpu" in str(value).lower())):
            clash = "--gpus-per-node"
        elif mem is not None and key in ("mem-per-cpu", "mem-per-gpu"):
            clash = "--mem"
        elif cpus_per_task is not None and key == "cpus-per-gpu":
            clash = "--cpus-per-task"
        if clash:
            shown = f"--{key}" + (f"={value}" if value is not True else "")
            raise UsageError(f"--sbatch-arg {shown} conflicts with coci-submit's {clash}",
                             hint=f"request the resource one way: either {clash} or --sbatch-arg {shown}")


@dataclass(frozen=True)
class SubmitSpec:
    """Everything a submission needs, validated. Paths are absolute."""

    script: Path
    script_args: tuple[str, ...]
    partition: str | None
    nodes: int
    ntasks_per_node: int
    time_min: int | None
    job_name: str
    output_dir: Path
    ckpt_dir: Path
    policy: str
    signal_lead_s: int
    max_requeues: int
    no_progress_limit: int
    mpi: str
    python: str
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    array: tuple[int, int | None] | None = None
    sbatch_args: tuple[tuple[str, str | bool], ...] = field(default_factory=tuple)
    time_unlimited: bool = False
    resume_from_other_run: bool = False
    spare_nodes: int = 0            # K extra nodes: restart in place on them (runtime/relaunch.py)
    max_restarts: int = settings.MAX_RESTARTS  # in-place restarts before the requeue fallback / giving up

    @property
    def total_nodes(self) -> int:
        """What the job asks Slurm for: the ranks' nodes plus the spares."""
        return self.nodes + self.spare_nodes

    @property
    def log_dir(self) -> Path:
        """submitit's job folder: the batch script, its pickles and one log pair per task."""
        return self.output_dir / "logs"

    def coci_env(self) -> dict[str, str]:
        """The environment the Session reads (its contract with coci-submit)."""
        return {
            settings.CKPT_DIR.name: str(self.ckpt_dir),
            settings.POLICY.name: self.policy,
            settings.MAX_REQUEUES.name: str(self.max_requeues),
            settings.NO_PROGRESS.name: str(self.no_progress_limit),
            settings.SIGNAL_LEAD.name: str(self.signal_lead_s),
            **({settings.RESUME_OTHER_RUN.name: "1"} if self.resume_from_other_run else {}),
        }


def command_digest(script: Path, script_args: Sequence[str]) -> str:
    """A short digest of the command (script path and arguments, ``%a`` unsubstituted): the default
    checkpoint directory is ``<output-dir>/ckpt-<digest>``, so a sweep point never resumes another's."""
    text = json.dumps([str(script), list(script_args)])
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _positive(name: str, value: int | None, *, zero_ok: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not zero_ok)):
        raise UsageError(f"{name} {value} must be {'>= 0' if zero_ok else '> 0'}",
                         hint=f"pass a {'non-negative' if zero_ok else 'positive'} integer to {name}")


def build_spec(*, script: str, script_args: Sequence[str], cwd: Path, python: str,
               partition: str | None = None, nodes: int = 1, ntasks_per_node: int = 1,
               time: str | None = None, job_name: str | None = None, output_dir: str | None = None,
               ckpt_dir: str | None = None, policy: str = settings.POLICY_DEFAULT, signal_lead: int = settings.SIGNAL_LEAD_S,
               max_requeues: int = settings.MAX_REQUEUES_SUBMIT, no_progress_limit: int = settings.NO_PROGRESS_LIMIT, mpi: str = "pmix",
               gpus_per_node: int | None = None, cpus_per_task: int | None = None,
               mem: str | None = None, account: str | None = None, qos: str | None = None,
               constraint: str | None = None, array: str | None = None,
               sbatch_args: Sequence[str] = (), resume_from_other_run: bool = False,
               spare_nodes: int = 0, max_restarts: int = settings.MAX_RESTARTS,
               validate_policy: Callable[[str], object] | None = None) -> SubmitSpec:
    """Validate the command line into a spec. Relative paths are taken from ``cwd``.

    Defaults chosen so that submitting the same command again resumes the same run, and another
    command (another seed of a sweep) gets another directory: ``--output-dir`` is
    ``./coci-runs/<job-name>`` and ``--ckpt-dir`` is ``<output-dir>/ckpt-<digest of script and args>``.
    """
    for name, v in (("--nodes", nodes), ("--ntasks-per-node", ntasks_per_node),
                    ("--cpus-per-task", cpus_per_task), ("--signal-lead", signal_lead),
                    ("--no-progress-limit", no_progress_limit)):
        _positive(name, v)
    _positive("--gpus-per-node", gpus_per_node, zero_ok=True)
    _positive("--max-requeues", max_requeues, zero_ok=True)
    _positive("--spare-nodes", spare_nodes, zero_ok=True)
    _positive("--max-restarts", max_restarts, zero_ok=True)
    if spare_nodes and array is not None:
        raise UsageError("--spare-nodes cannot be combined with --array",
                         hint="submit the sweep points as separate jobs to give each spare nodes, or drop --spare-nodes")
    if mem is not None and not _MEM_RE.fullmatch(mem):
        raise UsageError(f"--mem {mem!r} is not a Slurm memory size",
                         hint="give megabytes or a unit: --mem 4000, --mem 16G")
    if mpi not in MPI_PLUGINS:
        raise UsageError(f"--mpi {mpi!r} is not one of srun's MPI plugins",
                         hint=f"use one of {', '.join(MPI_PLUGINS)} (the cluster's: `srun --mpi=list`); "
                              "pmix is the default and what Open MPI under Slurm needs")
    if validate_policy is not None:
        validate_policy(policy)
    limit = read_limit(time) if time is not None else None
    time_min = None if limit is None or limit.seconds is None else math.ceil(limit.seconds / 60)
    if limit is not None and time_min is not None and signal_lead * 2 > time_min * 60:
        colon = (" (MM:SS is minutes and seconds: for 1 h 30 min write 1:30:00, 90 or 1h30m)"
                 if limit.form == "MM:SS" else "")
        raise UsageError(f"--signal-lead {signal_lead}s is more than half of --time {limit.reading()}",
                         hint=f"lower --signal-lead or raise --time: the job must train between warnings{colon}")
    script_path = (cwd / script).resolve() if not Path(script).is_absolute() else Path(script)
    # A script name Slurm or a path would mangle ("my train.py") gives a cleaned default name; only
    # a --job-name the user typed is refused for its characters.
    name = job_name or re.sub(r"[^\w.+-]+", "_", script_path.stem).strip("_") or "coci"
    if not re.fullmatch(r"[\w.+-]+", name):
        raise UsageError(f"--job-name {name!r} has characters Slurm or a path would mangle",
                         hint="use letters, digits, '.', '_', '+' and '-'")
    passed = tuple(parse_sbatch_arg(a) for a in sbatch_args)
    _check_sbatch_conflicts(passed, gpus_per_node=gpus_per_node, mem=mem, cpus_per_task=cpus_per_task)
    out = (cwd / (output_dir or f"coci-runs/{name}")).resolve()
    ckpt = (cwd / ckpt_dir).resolve() if ckpt_dir else out / f"ckpt-{command_digest(script_path, script_args)}"
    return SubmitSpec(
        script=script_path, script_args=tuple(script_args), partition=partition, nodes=nodes,
        ntasks_per_node=ntasks_per_node, time_min=time_min, job_name=name, output_dir=out,
        ckpt_dir=ckpt, policy=policy, signal_lead_s=signal_lead, max_requeues=max_requeues,
        no_progress_limit=no_progress_limit, mpi=mpi, python=python, gpus_per_node=gpus_per_node,
        cpus_per_task=cpus_per_task, mem=mem, account=account, qos=qos, constraint=constraint,
        array=parse_array(array) if array is not None else None,
        sbatch_args=passed,
        time_unlimited=time is not None and time_min is None, resume_from_other_run=resume_from_other_run,
        spare_nodes=spare_nodes, max_restarts=max_restarts)


def command_comment(spec: SubmitSpec) -> list[str]:
    """The user's command, as comment lines of the batch script: the line that runs is submitit's
    generic ``python -m submitit.core._submit FOLDER``, where the script and its arguments appear nowhere."""
    ranks = spec.nodes * spec.ntasks_per_node
    lines = [f"# coci-submit: each of the {ranks} rank(s) runs, in submitit's process:",
             f"#   {spec.python} {shlex.join([str(spec.script), *spec.script_args])}"]
    if spec.array is not None:
        lines.append("#   (in each array task, %a in the arguments becomes the task id)")
    return lines


# A rank that dies in native code (a segfault in MPI, HDF5, gloo) otherwise leaves one line in the
# job's log, srun's "task 1: Segmentation fault", and nothing to say where: with Python's fault
# handler on, every rank prints each thread's Python stack on SIGSEGV, SIGBUS, SIGFPE, SIGABRT and
# SIGILL first. A value the user exported wins (an empty one switches it off).
FAULT_HANDLER_SETUP = ("# every rank prints its Python stacks if it crashes in native code",
                       'export PYTHONFAULTHANDLER="${PYTHONFAULTHANDLER-1}"')


def executor_parameters(spec: SubmitSpec, extra_env: Mapping[str, str] | None = None) -> dict:
    """The keyword arguments for ``submitit.SlurmExecutor.update_parameters`` (its schema)."""
    env = {**spec.coci_env(), **(extra_env or {})}
    params: dict = {
        "job_name": spec.job_name,
        "nodes": spec.nodes,
        "ntasks_per_node": spec.ntasks_per_node,
        # submitit turns this into --signal=USR2@<lead>: the Session's record-only handler gets it.
        "signal_delay_s": spec.signal_lead_s,
        "srun_args": [f"--mpi={spec.mpi}"],
        # submitit stamps every job with --wckey=submitit; a site that enforces wckeys rejects it.
        "wckey": None,
        # The Session requeues itself at a step boundary after its save; Slurm requeues on node
        # failure and preemption. Both need the job to be requeueable.
        "additional_parameters": {"requeue": True, **dict(spec.sbatch_args)},
        "setup": [*command_comment(spec), *FAULT_HANDLER_SETUP,
                  *(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()))],
    }
    if spec.spare_nodes:
        # N+K nodes that outlive a lost one (--no-kill); the relaunch loop runs once in the batch
        # shell (no srun around submitit's runner) and starts the ranks' srun steps itself.
        params["nodes"] = spec.total_nodes
        params["use_srun"] = False
        params["additional_parameters"]["no-kill"] = True
        params["setup"] = [
            f"# coci relaunch loop: the ranks run on {spec.nodes} of these {spec.total_nodes} nodes, started by",
            f"#   srun --no-kill --nodes={spec.nodes} --nodelist=<{spec.nodes} healthy nodes> --mpi={spec.mpi} "
            f"python -m coci_hpc.submit.rank {shlex.join([str(spec.script), *spec.script_args])}",
            f"# and again on the healthy ones when that step fails (up to --max-restarts {spec.max_restarts}"
            " in place), else scontrol requeue",
            *params["setup"]]
    # No --time: the partition's default limit (submitit would otherwise write its own 5 minutes).
    params["time"] = "INFINITE" if spec.time_unlimited else spec.time_min
    for key in ("partition", "gpus_per_node", "cpus_per_task", "mem", "account", "qos", "constraint"):
        value = getattr(spec, key)
        if value is not None:
            params[key] = value
    if spec.array is not None and spec.array[1] is not None:
        params["array_parallelism"] = spec.array[1]
    return params
