"""The relaunch loop: restart in place, keep the allocation and relaunch the ranks on spare nodes (``--spare-nodes K``).

Restart in place: keep the allocation and relaunch the ranks on spare nodes (``--spare-nodes K``).

With spare nodes, coci-submit asks Slurm for N+K nodes with ``--no-kill`` and submitit runs a
:class:`Relauncher` once, in the batch shell (``use_srun=False``), instead of one copy of the
script per task. The relauncher starts the ranks itself, ``srun --no-kill`` on N healthy nodes of
the allocation, and when that step fails (a node lost, a rank that exits non-zero: NCCL/CUDA error,
crash) it starts them again on N healthy nodes, excluding the ones Slurm reports down, the SCR
``scr_srun`` model. Each relaunch resumes from the newest committed checkpoint: the Session does
that by itself, as after a requeue. Requeue stays the fallback: fewer than N healthy nodes left, or
``--max-restarts`` in-place restarts spent on node failures. A run that keeps crashing with every
node healthy ends after ``--max-restarts`` with the reason (:class:`~coci_hpc.errors.GaveUpError`).

Preemption and the time limit are the Session's: it saves and requeues (``scontrol requeue``) at a
step boundary, and the relauncher, which saw the signal too (or the step end with status 0), does
not relaunch.

:func:`decide` is the whole policy, pure; :class:`Relauncher` is the loop and its I/O; the rank
step's supervision (srun, its lost tasks) is the Slurm boundary's
(:func:`coci_hpc.slurm.srun_step.watch_step`). coci-submit's one entry point into the runtime is
:mod:`coci_hpc.runtime.entry`.
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coci_hpc import settings
from coci_hpc.errors import GaveUpError, SlurmError
from coci_hpc.runtime import peernotice
from coci_hpc.runtime.events import FILENAME as EVENTS_FILE
from coci_hpc.runtime.events import (
    EventLog,
    Relaunch,
    RelaunchAction,
    RelaunchCause,
    current_attempt,
    read_records,
    session_gave_up,
)
from coci_hpc.runtime.signals import DEFAULT_SIGNALS, SignalRecorder
from coci_hpc.slurm import commands
from coci_hpc.slurm.env import JobEnvironment
from coci_hpc.slurm.srun_step import LEFT_SETTLE_S, START_GRACE_S, StepLoss, silent_nodes, watch_step

__all__ = ["DEFAULT_MAX_RESTARTS", "LEFT_SETTLE_S", "START_GRACE_S", "Decision", "Relauncher", "StepLoss",
           "choose_nodes", "decide", "silent_nodes", "watch_step"]

DEFAULT_MAX_RESTARTS = settings.MAX_RESTARTS
# A node whose task srun reported lost ("n2: task 1: Killed") is suspect: its rank died, and the
# node itself may be going (a crash, then slurmctld marking it DOWN: SlurmdTimeout later on a real
# cluster, 1 s later with `devcluster fail --hard --delay 1`). The loop now decides well under a
# second after the loss (the survivors are told at once, runtime/peernotice.py), before Slurm
# may know. So a relaunch takes healthy nodes that lost no task first (the spare: nothing is
# waited for), and only when it needs a suspect node does it wait until this many seconds after
# the loss and ask Slurm again (the old fixed wait, 2 s, only where it can change the answer).
DEFAULT_SETTLE_S = 2.0
ENV_RESTARTS = settings.INPLACE_RESTARTS.name
# Seconds a rank step may go on after srun reported one of its tasks lost (killed, exited non-zero,
# node failure) before the loop ends it. The survivors normally save and exit within the peer
# deadline (5 s) plus a save meant to fit Slurm's KillWait (30 s by default, the value here); one
# stuck in a collective with the dead rank (seen here: a node lost during a checkpoint write, and
# right after a restart) would otherwise hold the allocation until the time limit.
DEFAULT_STEP_GRACE_S = 30.0


@dataclass(frozen=True)
class Decision:
    """What to do after the rank step ended: ``done``, ``stop``, ``relaunch``, ``requeue``, ``give_up``."""

    action: str
    reason: str
    nodes: tuple[str, ...] = ()
    cause: RelaunchCause | None = None      # why the step failed


def choose_nodes(held: Sequence[str], unhealthy: Mapping[str, str], needed: int,
                 suspect: Collection[str] = ()) -> tuple[str, ...] | None:
    """``needed`` healthy nodes of the allocation, in Slurm's order; None when too few. Healthy
    nodes that are not ``suspect`` (lost a task in the last step) are taken first."""
    healthy = [n for n in held if n not in unhealthy]
    if len(healthy) < needed:
        return None
    take = set([n for n in healthy if n not in suspect][:needed])
    take.update([n for n in healthy if n in suspect][:needed - len(take)])
    return tuple(n for n in healthy if n in take)


def decide(*, rc: int, signaled: bool, held: Sequence[str], unhealthy: Mapping[str, str], needed: int,
           restarts_done: int, max_restarts: int, gave_up: str | None = None,
           suspect: Collection[str] = ()) -> Decision:
    """The relaunch policy for one ended rank step. Pure.

    ``held``: the nodes the job holds now; ``unhealthy``: those Slurm reports down/drained/not
    responding (with their state). ``restarts_done``: in-place restarts already made in this job.
    ``gave_up``: the Session's own verdict when the step's ranks gave up (its no-progress guard or
    --max-requeues, recorded in the event log): final, never relaunched. ``suspect``: healthy nodes
    where srun reported a task lost; a spare is preferred to them (:func:`choose_nodes`).
    """
    if rc == 0:
        return Decision("done", "the ranks ended with status 0")
    if signaled:
        # Preemption, the time limit or scancel: the Session saved and requeued (or was cancelled).
        return Decision("stop", f"the ranks ended with status {rc} after a signal to the job: "
                                "Slurm's stop, not a failure to restart from")
    if gave_up:
        return Decision("give_up", f"the training session gave up: {gave_up}")
    lost = sorted(unhealthy)
    cause = RelaunchCause.NODE_FAILURE if lost else RelaunchCause.CRASH
    what = f"node(s) {','.join(f'{n} ({unhealthy[n]})' for n in lost)} lost" if lost else \
        f"the ranks exited with status {rc} (no node down)"
    nodes = choose_nodes(held, unhealthy, needed, suspect)
    if nodes is None:
        healthy = len(held) - len([n for n in held if n in unhealthy])
        return Decision("requeue", f"{what}; {healthy} healthy node(s) left in the allocation, {needed} "
                                   "needed: back to the queue", cause=cause)
    if restarts_done >= max_restarts:
        if lost:
            return Decision("requeue", f"{what}; the {max_restarts} in-place restart(s) of --max-restarts "
                                       "are spent: back to the queue", cause=cause)
        return Decision("give_up", f"{what}, again after {max_restarts} in-place restart(s) "
                                   f"(--max-restarts {max_restarts}); see the rank logs for the error",
                        cause=cause)
    swapped = sorted(n for n in suspect if n in held and n not in unhealthy and n not in nodes)
    why_not = f" (not {','.join(swapped)}: lost a task)" if swapped else ""
    return Decision("relaunch", f"{what}; restart {restarts_done + 1} of {max_restarts} in place "
                                f"on {','.join(nodes)}{why_not}", nodes, cause)


@dataclass
class Relauncher:
    """The callable submitit runs once in the batch shell when ``--spare-nodes`` is given."""

    script: str
    args: tuple[str, ...]
    nodes: int
    ntasks_per_node: int
    mpi: str
    python: str                      # shell-quoted, as coci-submit's --python
    log_dir: str
    max_restarts: int = DEFAULT_MAX_RESTARTS
    settle_s: float = DEFAULT_SETTLE_S
    step_grace_s: float = DEFAULT_STEP_GRACE_S
    env: dict[str, str] = field(default_factory=dict)
    # Called once the signals are recorded, before anything else (submit/: submitit's stale result).
    prepare: Callable[[], None] | None = None

    def rank_command(self) -> list[str]:
        return [*shlex.split(self.python), "-u", "-m", "coci_hpc.submit.rank", self.script, *self.args]

    def step_argv(self, nodes: Sequence[str]) -> list[str]:
        logs = Path(self.log_dir)
        return commands.rank_step_argv(nodes=nodes, ntasks_per_node=self.ntasks_per_node, mpi=self.mpi,
                                       stdout=str(logs / "%j_%t_log.out"), stderr=str(logs / "%j_%t_log.err"),
                                       command=self.rank_command())

    def run_step(self, argv: Sequence[str], env: Mapping[str, str], loss: StepLoss, nodes: Sequence[str] = ()) -> int:
        notice = env.get(peernotice.ENV)

        def post(line: str) -> None:
            if notice:
                try:
                    peernotice.post(notice, f"{line.strip()} (at {time.time():.3f})")
                except OSError as exc:    # the survivors' deadline still detects the loss
                    _say(f"could not post the peer notice {notice}: {exc}")
        return watch_step(argv, env, self.step_grace_s, on_loss=post, loss=loss,
                          training=peernotice.training_marker(notice) if notice else None,
                          nodes=nodes, tasks_per_node=self.ntasks_per_node,
                          left=peernotice.left_marker(notice) if notice else None)

    def notice_path(self, job_id: str, restart: int) -> str:
        """Where this launch's peer notice goes (:mod:`coci_hpc.runtime.peernotice`): the job's log
        folder, which every node sees; one name per launch, so a new step never reads an old notice."""
        return str(Path(self.log_dir) / f".{job_id}_{restart}_peer_notice")

    def _decide(self, job_id: str, rc: int, signaled: bool, nodes: Sequence[str], restarts: int,
                gave_up: str | None, suspect: Collection[str]) -> tuple[Decision, dict[str, str]]:
        held = commands.job_nodes(job_id) if rc != 0 else list(nodes)
        bad = commands.unhealthy_nodes(held) if rc != 0 else {}
        # A node Slurm already took out of the job (--no-kill shrinks it) is lost too.
        bad.update({n: "left the job" for n in nodes if rc != 0 and n not in held})
        d = decide(rc=rc, signaled=signaled, held=held, unhealthy=bad, needed=self.nodes, restarts_done=restarts,
                   max_restarts=self.max_restarts, gave_up=gave_up, suspect=suspect)
        return d, bad

    def __call__(self) -> int:
        # Record-only: a signal to the job means Slurm is stopping it (the Session saves and
        # requeues); chain=False replaces submitit's USR2 handler, which would requeue by itself.
        sig = SignalRecorder(DEFAULT_SIGNALS, chain=False).install()
        if self.prepare is not None:
            self.prepare()
        os.environ.update(self.env)
        job = JobEnvironment.from_env()
        if job.job_id is None:
            raise SlurmError("the relaunch loop runs inside a Slurm job (SLURM_JOB_ID is not set)",
                             hint="submit with coci-submit --spare-nodes K")
        ckpt = settings.CKPT_DIR.raw()
        held = commands.job_nodes(job.job_id)
        nodes = choose_nodes(held, commands.unhealthy_nodes(held), self.nodes)
        if nodes is None:
            _say(f"fewer than {self.nodes} healthy nodes in the allocation {held}: requeued")
            commands.requeue(job.requeue_id or job.job_id)
            return 0
        restarts = 0
        while True:
            _say(f"starting {self.nodes} node(s) x {self.ntasks_per_node} rank(s) on {','.join(nodes)}"
                 + (f" (in-place restart {restarts})" if restarts else ""))
            notice = self.notice_path(job.job_id, restarts)
            peernotice.clear(notice)
            env = {**os.environ, ENV_RESTARTS: str(restarts), peernotice.ENV: notice}
            loss = StepLoss()
            rc = self.run_step(self.step_argv(nodes), env, loss, nodes)
            ended = time.time()
            peernotice.clear(notice)
            gave_up = _session_gave_up(Path(ckpt)) if ckpt and rc != 0 else None
            suspect = set(loss.nodes)
            d, bad = self._decide(job.job_id, rc, bool(sig.received), nodes, restarts, gave_up, suspect)
            if d.action == "relaunch" and suspect & set(d.nodes) and loss.at is not None and not sig.received:
                # No spare left but the node that lost a task: give Slurm the time to mark it down if it
                # is going, then look again (a crash on a healthy node is relaunched there after it).
                wait = loss.at + self.settle_s - time.monotonic()
                if wait > 0:
                    _say(f"relaunching on {','.join(sorted(suspect & set(d.nodes)))}, which lost a task: "
                         f"asking Slurm again in {wait:.1f}s")
                    time.sleep(wait)
                    d, bad = self._decide(job.job_id, rc, bool(sig.received), nodes, restarts, gave_up, suspect)
            decided = time.time()
            _say(f"rank step ended (status {rc}): {d.action}: {d.reason}")
            if d.action == "done":
                return 0
            if d.action == "stop":
                return 0 if rc == 0 else rc
            if ckpt:
                _record(Path(ckpt), job.job_id, Relaunch(
                    restart=restarts + (d.action == "relaunch"), rc=rc, action=RelaunchAction(d.action), cause=d.cause,
                    reason=d.reason, lost=bad, nodes=list(d.nodes), step_ended_wall=ended,
                    decided_wall=decided, lost_task_on=sorted(suspect)))
            if d.action == "give_up":
                raise GaveUpError(d.reason, hint="fix the error in the rank logs, then submit the same command "
                                                 "again: it resumes from the newest checkpoint")
            if d.action == "requeue":
                commands.requeue(job.requeue_id or job.job_id)
                return 0  # Slurm ends this batch shell and starts the job again
            restarts += 1
            nodes = d.nodes


def _session_gave_up(ckpt: Path) -> str | None:
    """The Session's give-up message when the newest attempt in the log ended ``gave_up``."""
    return session_gave_up(read_records(ckpt / EVENTS_FILE) if ckpt.is_dir() else [])


def _record(ckpt: Path, job_id: str, record: Relaunch) -> None:
    """Append the relaunch to the run's event log (the Session writes the rest), as the failed
    attempt: the newest in the log, by the Session's own count (:func:`events.current_attempt`)."""
    if not ckpt.is_dir():
        return
    attempt = current_attempt(read_records(ckpt / EVENTS_FILE))
    EventLog(ckpt / EVENTS_FILE, attempt=attempt, job_id=job_id).write(record)


def _say(msg: str) -> None:
    print(f"coci-relaunch: {msg}", file=sys.stderr, flush=True)
