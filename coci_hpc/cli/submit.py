"""coci-submit: run a training script on Slurm, preemption-safe, through submitit.

    coci-submit [OPTIONS] SCRIPT [SCRIPT ARGS...]
    coci-submit --partition gpu --nodes 2 --time 4:00:00 train.py --lr 3e-4

Options use sbatch's own spelling and go BEFORE the script; everything after SCRIPT goes to the
script, as with sbatch, srun, mpiexec, torchrun and python: `coci-submit -p gpu train.py --policy
fixed:50` gives --policy to train.py (one line on stderr says so when a coci-submit option has that
name). Only --dry-run after SCRIPT is refused: meant for coci-submit, it would submit the job for
real; to pass it to the script, put `--` after SCRIPT (`train.py -- --dry-run`; that `--` is
dropped). Any other sbatch option: --sbatch-arg KEY[=VALUE] (repeatable). --dry-run prints the
batch script and submits nothing; it needs no running Slurm and says what it could not check.

Durations (--time) take 2h, 90m, 1d12h or Slurm's MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]; a bare
number is minutes, as in sbatch, and `1:30` is 1 min 30 s (say 1:30:00 or 1h30m for 90 minutes).

Exit codes: 0 submitted (or dry run printed), 2 bad usage (missing or non-Python script, unknown
partition, bad --time, --mpi, --python, --sbatch-arg or other option, --dry-run after SCRIPT),
3 Slurm unreachable or sbatch refused the job, 5 checkpoint directory not creatable or not
writable, or another run's (a changed step count is the same run; --resume-from-other-run to take
another run's checkpoint on purpose).
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from coci_hpc import settings
from coci_hpc.cli.common import UsageArgumentParser, run_cli
from coci_hpc.errors import UsageError
from coci_hpc.planner.policies import POLICY_NAMES, make_policy
from coci_hpc.planner.profile import Profile
from coci_hpc.runtime.attempts import LEAD_SPARE_S, suggested_lead_s
from coci_hpc.runtime.relaunch import DEFAULT_MAX_RESTARTS
from coci_hpc.slurm.timefmt import read_limit
from coci_hpc.submit import checks, executor
from coci_hpc.submit.spec import MPI_PLUGINS, build_spec

DEFAULT_SIGNAL_LEAD = settings.SIGNAL_LEAD_S

PROG = "coci-submit"


def _parser() -> argparse.ArgumentParser:
    p = UsageArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("sbatch options (sbatch's spelling)")
    s.add_argument("--partition", "-p", help="partition (default: the cluster's default)")
    s.add_argument("--nodes", "-N", type=int, default=1)
    s.add_argument("--ntasks-per-node", type=int, default=1, help="ranks per node (default 1)")
    s.add_argument("--gpus-per-node", type=int)
    s.add_argument("--cpus-per-task", "-c", type=int)
    s.add_argument("--mem", help="memory per node, Slurm's format (16G, 4000)")
    s.add_argument("--time", "-t", help="time limit: 2h, 90m, 1d12h or Slurm's MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS "
                                          "(default: the partition's)")
    s.add_argument("--account", "-A")
    s.add_argument("--qos", "-q")
    s.add_argument("--constraint", "-C")
    s.add_argument("--job-name", "-J", help="default: the script's name")
    s.add_argument("--array", "-a", help="N or 0-M, optionally %%K; each task checkpoints in <ckpt-dir>/task<ID>, "
                                         "and %%a in the script's arguments becomes its ID (--seed %%a)")
    s.add_argument("--sbatch-arg", action="append", default=[], metavar="KEY[=VALUE]",
                   help="any other sbatch option, repeatable: --sbatch-arg exclusive --sbatch-arg mail-type=END "
                        "(with dashes: --sbatch-arg=--exclusive)")
    c = p.add_argument_group("coci options")
    c.add_argument("--output-dir", help="logs and submitit's job folder (default ./coci-runs/<job-name>)")
    c.add_argument("--ckpt-dir", help="checkpoints and events.jsonl (default <output-dir>/ckpt-<digest of script "
                                      "and arguments>: the same command resumes, another gets its own)")
    c.add_argument("--resume-from-other-run", action="store_true",
                   help="let this command continue from the checkpoint of another command's run in --ckpt-dir "
                        "(refused otherwise: one run, one directory)")
    c.add_argument("--policy", default=settings.POLICY_DEFAULT, help="checkpoint policy: " + ", ".join(POLICY_NAMES))
    c.add_argument("--signal-lead", type=int, default=None,
                   help=f"seconds of warning before the time limit (--signal=USR2@N; default {settings.SIGNAL_LEAD_S})")
    c.add_argument("--lead-from-profile", metavar="PROFILE.json",
                   help="derive --signal-lead from a profile's step time and save cost (two steps + a save + "
                        "the requeue + 30 s: what a stop at the time limit's warning needs)")
    c.add_argument("--max-requeues", type=int, default=settings.MAX_REQUEUES_SUBMIT,
                   help=f"give up after this many requeues (default {settings.MAX_REQUEUES_SUBMIT})")
    c.add_argument("--no-progress-limit", type=int, default=settings.NO_PROGRESS_LIMIT,
                   help=f"give up after this many restarts in a row from the same checkpoint "
                        f"(default {settings.NO_PROGRESS_LIMIT})")
    c.add_argument("--spare-nodes", type=int, default=0, metavar="K",
                   help="ask for --nodes + K nodes (--no-kill) and restart in place on the healthy ones when a node "
                        "is lost or the ranks crash, instead of going back to the queue (default 0)")
    c.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help=f"in-place restarts with --spare-nodes before falling back to requeue (a lost node) or "
                        f"giving up (a crash with every node healthy) (default {DEFAULT_MAX_RESTARTS})")
    c.add_argument("--mpi", default="pmix", help="srun --mpi plugin that starts the ranks: " + ", ".join(MPI_PLUGINS)
                   + " (default pmix)")
    c.add_argument("--python", default=shlex.quote(sys.executable), help="interpreter on the nodes (default: this one)")
    c.add_argument("--dry-run", action="store_true", help="print the batch script; submit nothing")
    p.add_argument("script", nargs="?", help="the training script (a Python file)")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="its arguments, all of them the script's (put `--` after the script to pass it --dry-run)")
    return p


# Refused after the script though a script may have it too: meant for coci-submit, its absence submits
# the job for real, which cannot be taken back. Every other name after the script is the script's.
IRREVERSIBLE_IF_MISPLACED = ("--dry-run",)


def _own_long_options(p: argparse.ArgumentParser) -> frozenset[str]:
    return frozenset(o for act in p._actions for o in act.option_strings
                     if o.startswith("--") and o != "--help")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """argparse, plus the `--` that marks the script's arguments as meant for it.

    What follows the script is the script's (the launchers' convention), so argparse's REMAINDER
    takes it whole; argparse drops a `--` right after the script, so the split at `--` happens
    here, before argparse. The script's arguments up to a `--` of their own are then checked:
    --dry-run is refused, and a long option that coci-submit also has gets one line on stderr.
    """
    p = _parser()
    args = list(sys.argv[1:] if argv is None else argv)
    cut = args.index("--") if "--" in args else len(args)
    a = p.parse_args(args[:cut])
    after = args[cut + 1:]
    checked = list(a.script_args)
    if cut < len(args):
        if a.script is None:                 # coci-submit [OPTIONS] -- train.py ARGS
            if not after:
                p.error("the training script is missing after `--`")
            a.script, a.script_args = after[0], after[1:]
        elif not a.script_args:              # coci-submit [OPTIONS] train.py -- ARGS: the `--` is ours
            a.script_args = after
        else:                                # a `--` inside the script's arguments is the script's
            a.script_args = [*a.script_args, "--", *after]
    if a.script is None:
        p.error("the training script is missing: coci-submit [OPTIONS] train.py [ARGS]")
    names = [tok.split("=", 1)[0] for tok in checked if tok.startswith("--")]
    for name in IRREVERSIBLE_IF_MISPLACED:
        if name in names:
            shown = " ".join(shlex.quote(t) for t in checked)
            raise UsageError(
                f"{name} comes after the script {a.script}, so it would go to the script and the job "
                f"would be submitted for real",
                hint=f"for coci-submit's {name}, put it before the script: coci-submit {name} ... {a.script} ...; "
                     f"to pass it to the script on purpose, put `--` after the script: "
                     f"coci-submit [OPTIONS] {a.script} -- {shown}")
    own = _own_long_options(p)
    shared = list(dict.fromkeys(n for n in names if n in own))
    if shared:
        print(f"{PROG}: note: {', '.join(shared)} after {a.script} go{'es' if len(shared) == 1 else ''} to "
              f"the script, not to coci-submit (coci-submit's options go before the script)", file=sys.stderr)
    return a


def _main(argv: Sequence[str] | None) -> int:
    a = _parse(argv)
    lead = _signal_lead(a.signal_lead, a.lead_from_profile)
    spec = build_spec(
        script=a.script, script_args=a.script_args, cwd=Path.cwd(), python=a.python,
        partition=a.partition, nodes=a.nodes, ntasks_per_node=a.ntasks_per_node, time=a.time,
        job_name=a.job_name, output_dir=a.output_dir, ckpt_dir=a.ckpt_dir, policy=a.policy,
        signal_lead=lead, max_requeues=a.max_requeues, no_progress_limit=a.no_progress_limit,
        mpi=a.mpi, gpus_per_node=a.gpus_per_node, cpus_per_task=a.cpus_per_task, mem=a.mem,
        account=a.account, qos=a.qos, constraint=a.constraint, array=a.array,
        sbatch_args=a.sbatch_arg, resume_from_other_run=a.resume_from_other_run,
        spare_nodes=a.spare_nodes, max_restarts=a.max_restarts, validate_policy=make_policy)
    unchecked = checks.run_all(spec, dry_run=a.dry_run)
    if a.dry_run:
        print(executor.render(spec), end="")
        print(f"{PROG}: dry run: nothing submitted; the ranks would run "
              f"{spec.python} {shlex.join([str(spec.script), *spec.script_args])}", file=sys.stderr)
        if a.time is not None:
            print(f"{PROG}: dry run: --time {read_limit(a.time).reading()}", file=sys.stderr)
        if shutil.which("srun") is None:
            unchecked.append("Slurm's commands (`srun` is not on PATH here; a submission needs them)")
        for what in unchecked:
            print(f"{PROG}: dry run: not checked: {what}", file=sys.stderr)
        return 0
    sub = executor.submit(spec)
    ids = sub.job_id if len(sub.task_ids) == 1 else f"{sub.job_id} (array tasks {sub.task_ids[0]}..{sub.task_ids[-1]})"
    spares = f" (+{spec.spare_nodes} spare)" if spec.spare_nodes else ""
    print(f"submitted job {ids}: {spec.nodes} node(s){spares} x {spec.ntasks_per_node} rank(s)"
          f"{' on ' + spec.partition if spec.partition else ''}")
    print(f"  batch script   {sub.batch_script}")
    print(f"  rank 0 log     {sub.log_paths[0]}")
    print(f"  rank 0 errors  {sub.log_paths[1]}   (rank N: ..._N_log.*)")
    if spec.array is None:
        print(f"  checkpoints    {spec.ckpt_dir}")
        print(f"  history        coci-status {shlex.quote(str(spec.ckpt_dir))}")
    else:  # the Session gives each array task its own directory
        print(f"  checkpoints    {spec.ckpt_dir}/task<ID>  (ID 0..{spec.array[0] - 1})")
        print(f"  history        coci-status {shlex.quote(str(spec.ckpt_dir / 'task0'))}  (one per task)")
    return 0


def _signal_lead(explicit: int | None, profile_path: str | None) -> int:
    if profile_path is None:
        return DEFAULT_SIGNAL_LEAD if explicit is None else explicit
    if explicit is not None:
        raise UsageError("--signal-lead and --lead-from-profile both given", hint="keep one of them")
    prof = Profile.load(profile_path, option="--lead-from-profile")
    step_s = prof.measured_step_time()
    if step_s is None:
        raise UsageError(f"{profile_path} has no step time (step_time_s, or two samples with steps)",
                         hint="give --signal-lead N instead, or a profile recorded by a run")
    save_s = (prof.ckpt_cost_s or 0.0) + (prof.persist_s or 0.0)
    lead = suggested_lead_s(step_s, save_s)
    print(f"signal lead {lead}s from {profile_path}: 2 x {step_s:.1f}s steps + {save_s:.1f}s save + requeue "
          f"+ {LEAD_SPARE_S:.0f}s spare", file=sys.stderr)
    return lead


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
