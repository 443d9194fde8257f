"""The training session: what a user's loop touches to become preemption-safe.

    session = coci_hpc.Session({"model": model, "optimizer": opt, "scheduler": sched, "loader": sampler},
                               total_steps=10_000)
    for step in session.steps():          # resumes from the latest checkpoint first
        loss = train_step()
        session.observe(loss)
    # only reached when training completed (a stop exits the process cleanly, see below)

What it does, on every rank, with nothing else written by the user:

- restores the newest committed checkpoint (state in place, RNG, loader position, scheduler);
- takes the checkpoint directory and policy from arguments, else coci-submit's ``COCI_*``
  environment (:mod:`coci_hpc.runtime.config`);
- chooses checkpoint steps with the planner (``fixed:N`` = every N steps), saves two-phase;
- owns USR1, USR2 and SIGTERM while it runs (record-only handlers, previous ones restored after);
  on a signal every rank stops at the next step boundary; rank 0 reads why from Slurm's record of
  the job (:func:`.runtime.attempts.stop_reason`: preemption, time limit, ``scancel``, a requeue by
  hand), every rank saves when the save fits before Slurm's kill (GraceTime of a preemption,
  KillWait otherwise), rank 0 requeues a preempted or timed-out job (never a cancelled one) and the
  process exits with status 0 (``SystemExit(0)`` raised out of the loop);
- writes ``<ckpt_dir>/events.jsonl`` (rank 0): attempts, how the previous one ended (from Slurm's
  record and this log), checkpoints, losses, stops, restart latency;
- gives up (``GaveUpError``, non-zero exit, no requeue) when this job was requeued more than
  ``max_requeues`` times after unannounced ends (node failures, crashes, requeues by hand; its own
  time-limit and preemption stops do not count) or when its restarts keep resuming from the same
  checkpoint;
- warns at the start when the signal lead cannot fit a step, a save and the requeue, and agrees on a
  stop at the very boundary after the signal (not one step later) when the lead is short.

Cost per step: one MAX-allreduce of 3 doubles into preallocated buffers (:mod:`.runtime.stepsync`),
a ``perf_counter`` and, on rank 0, one float stored into a preallocated loss buffer. No Slurm call,
no I/O (losses are flushed with checkpoints, stops, and every ``LOSS_FLUSH_S`` seconds).
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import numpy as np

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint.state import Leaf, collect
from coci_hpc.comm import Comm
from coci_hpc.errors import (
    CheckpointError,
    CheckpointOtherRun,
    CociError,
    GaveUpError,
    PeerLost,
    SlurmError,
    UsageError,
)
from coci_hpc.planner.failures import FailureModel, from_mtbf
from coci_hpc.runtime import attempts as att
from coci_hpc.runtime import errorexit, memtier, runrecord, signals
from coci_hpc.runtime.config import SessionConfig, resolve
from coci_hpc.runtime.data import session_state
from coci_hpc.runtime.distributed import default_comm
from coci_hpc.runtime.events import FILENAME, EventLog, last_attempt, read_events
from coci_hpc.runtime.optimeout import OpTimeout
from coci_hpc.runtime.peernotice import PeerNotice
from coci_hpc.runtime.preemption import DEFAULT_SIGNALS, SignalRecorder, requeue_with_retries
from coci_hpc.runtime.procinfo import process_start_wall
from coci_hpc.runtime.schedule import Schedule, make_schedule
from coci_hpc.runtime.stepsync import MIN_DEADLINE_S, StepSync
from coci_hpc.runtime.survivors import Survival, held_in_parts, sweep_torn, torn_steps
from coci_hpc.slurm import commands, sacct, scontrol
from coci_hpc.slurm.env import JobEnvironment
from coci_hpc.slurm.failure_cache import Pending, failure_model_for_job
from coci_hpc.slurm.failure_cache import describe as describe_history
from coci_hpc.slurm.hostlist import expand_hostlist

STATE_KEY = "coci_session"
ENV_INPLACE = "COCI_INPLACE_RESTARTS"   # set by submit/relaunch.py for the rank steps it starts
STOP = 1                    # stop level exchanged at the step boundary (MAX over ranks)
LOSS_BUFFER = 4096          # losses kept between flushes (rank 0), preallocated
LOSS_FLUSH_S = 5.0          # at most one losses record per this many seconds between checkpoints
DEFAULT_MTBF_H = 70.0       # per-node MTBF when the partition's history cannot be read
HISTORY_DAYS = 90


class _SessionState:
    """The session's own part of the checkpoint: the planner's measured costs and plan."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "schedule": self.schedule.state_dict()}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        # A checkpoint written before fixed:N had a schedule holds None: nothing measured to restore.
        if d.get("schedule") is not None and d["schedule"].get("policy") == self.schedule.policy:
            self.schedule.load_state_dict(dict(d["schedule"]))


# Open MPI prints its own alarming warning in the survivors' logs once a peer is gone, around coci's
# peer-lost line: say beside it that it is expected, so nobody chases it (issue 26).
PEER_LOST_MPI_NOTE = ("Open MPI may now warn that it \"failed to TCP connect to a peer MPI process\" and that the job "
                      "\"may now hang or fail\": expected after a lost peer; the survivors save and leave")


def _say(msg: str) -> None:
    print(f"coci: {msg}", file=sys.stderr, flush=True)


def _leave_after_peer_loss(in_place: bool) -> NoReturn:
    """End this process now: no MPI finalize or collective that would wait for the lost rank.
    Under the relaunch loop a non-zero status is what makes it restart the ranks in place."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1 if in_place else 0)


class Session:
    """A preemption-safe training loop: restore, plan checkpoints, stop, save and requeue.

    Create one per process (every rank, same arguments), then iterate :meth:`steps` and call
    :meth:`observe` with each step's loss. See the module docstring for what happens on a signal,
    a lost rank, a time limit or a preemption. Arguments left ``None`` come from the environment
    (the ``COCI_*`` variables coci-submit sets), else from the defaults; an explicit argument wins
    over the environment and rank 0 logs the conflict.

    Args:
        state: What to checkpoint, by name: modules, optimizers, LR schedulers, a ``GradScaler``,
            torchdata's ``StatefulDataLoader`` or a ``ResumableSampler``, tensors, numbers,
            strings and dicts/lists of them. Anything with
            ``state_dict()``/``load_state_dict()`` works. A plain ``DataLoader`` or a value the
            store cannot save (a lock, a file handle) is refused here with a ``UsageError``.
        total_steps: Steps of the whole run; the loop ends after step ``total_steps - 1``. May be
            given to :meth:`steps` instead. Lower than the latest checkpoint's step: refused.
        ckpt_dir: Checkpoint directory (holds the checkpoints and ``events.jsonl``);
            ``COCI_CKPT_DIR``. Required one way or the other. A directory recorded for another
            script or other arguments is refused (``CheckpointOtherRun``).
        policy: When to save: ``coci`` (default), ``young``, ``daly``, ``checkfreq[:P]``,
            ``fixed:N`` (every N steps), ``coci-paper[:capped]``; ``COCI_POLICY``.
        max_requeues: Give up after this many restarts of this job after unannounced ends (node
            failures, crashes, requeues by hand; the session's own time-limit and preemption
            stops do not count); ``COCI_MAX_REQUEUES``; default no limit.
        no_progress_limit: Give up when this many restarts in a row resumed from the same
            checkpoint; ``COCI_NO_PROGRESS_LIMIT``; default 3.
        signal_lead_s: Seconds between Slurm's warning signal and the time limit (sbatch's
            ``--signal=USR2@N``); used to classify a stop and to check that a step, a save and the
            requeue fit; ``COCI_SIGNAL_LEAD_S``; default 90.
        comm: Communicator to use (an mpi4py communicator or a ``coci_hpc.comm.Comm``). Default:
            MPI's world when launched by MPI, else a gloo group over an initialised
            ``torch.distributed`` of 2+ ranks, else one process.
        keep: Committed checkpoints to keep (older ones are deleted after a newer commit).
        async_save: Save two-phase (snapshot, then a background write) instead of blocking.
        failure_model: The failure model the planner uses. Default: the partition's, from Slurm's
            accounting (cached per partition, refreshed at most daily), or the planner's default
            outside a Slurm job.
        horizon_s: Planning horizon in seconds of training time (default 24 h).
        environ: Environment to read instead of ``os.environ`` (tests).
        runner: Runs Slurm commands instead of ``subprocess`` (tests).
        resume_from_other_run: Accept a checkpoint directory recorded for another command and make
            this command its run; ``COCI_RESUME_FROM_OTHER_RUN``; default off.
        peer_timeout_s: Least time a peer may keep the per-step agreement waiting before it counts
            as lost (the deadline is at least this and 10 typical steps); ``COCI_PEER_TIMEOUT_S``;
            default 5 s.
        survivors: On a lost rank, let the survivors save the last finished step and keep the
            partner copies that make it possible; ``COCI_SURVIVORS`` (``0`` turns it off);
            default on.
        init_from: Pretrained weights for ``state["model"]``, loaded only while the run has no
            checkpoint of its own (later ignored, and the log says so): a Hugging Face
            safetensors directory or file, a ``torch.save`` file (read with
            ``weights_only=True``), a DCP directory or a coci checkpoint. Each rank reads only
            its slice of a DTensor (FSDP2) parameter. See ``coci_hpc.interop.pretrained``.
        init_strict: With ``init_from``: refuse (one ``UsageError`` listing them) names that are
            missing, unexpected or of another shape; ``False`` loads what matches and logs the rest.

    Raises:
        UsageError: Bad configuration or a state that cannot be saved.
        CheckpointOtherRun: ``ckpt_dir`` belongs to another run.
    """

    def __init__(self, state: Mapping[str, Any], total_steps: int | None = None, *,
                 ckpt_dir: str | os.PathLike | None = None, policy: str | None = None,
                 max_requeues: int | None = None, no_progress_limit: int | None = None,
                 signal_lead_s: float | None = None, comm: Any = None, keep: int = 2,
                 async_save: bool = True, failure_model: FailureModel | None = None,
                 horizon_s: float = 24 * 3600.0, environ: Mapping[str, str] | None = None,
                 runner: commands.Runner | None = None, resume_from_other_run: bool | None = None,
                 peer_timeout_s: float | None = None, survivors: bool | None = None,
                 init_from: str | os.PathLike | None = None, init_strict: bool = True) -> None:
        self._init_wall = time.time()
        errorexit.install()        # a refusal below ends `python train.py` with one line and its exit code
        # Pretrained weights for state["model"] when the run has no checkpoint of its own yet
        # (coci_hpc.interop.pretrained: safetensors, torch.save, DCP or a coci checkpoint).
        self._init_from, self._init_strict = init_from, init_strict
        env = os.environ if environ is None else environ
        # coci-submit's relaunch loop (--spare-nodes) numbers its in-place restarts of the ranks
        # (0: its first launch); absent: not under that loop.
        self._in_place: int | None = int(env[ENV_INPLACE]) if env.get(ENV_INPLACE, "").isdigit() else None
        self._process_wall = process_start_wall()
        # How long a peer may keep the step agreement waiting before it counts as lost (at least
        # this, and 10 typical steps); survivors' saves on a peer loss (COCI_SURVIVORS=0: off).
        self._min_deadline = float(peer_timeout_s if peer_timeout_s is not None
                                   else env.get("COCI_PEER_TIMEOUT_S", MIN_DEADLINE_S))
        self._survivors = survivors if survivors is not None else env.get("COCI_SURVIVORS", "1") != "0"
        if STATE_KEY in state:
            raise UsageError(f"the state key {STATE_KEY!r} is the session's own", hint="rename that entry")
        self.job = JobEnvironment.from_env(environ)
        self._environ = environ
        explicit = {"ckpt_dir": None if ckpt_dir is None else os.fspath(ckpt_dir), "policy": policy,
                    "max_requeues": max_requeues, "no_progress_limit": no_progress_limit,
                    "signal_lead_s": signal_lead_s, "resume_from_other_run": resume_from_other_run}
        self.config: SessionConfig
        self.config, conflicts = resolve({k: v for k, v in explicit.items() if v is not None}, environ, self.job)
        self.comm = default_comm(environ) if comm is None else Comm.wrap(comm)
        self.rank = self.comm.rank
        self.total_steps = total_steps
        self.async_save = async_save
        self._runner = runner or commands.run_command
        if self.rank == 0:
            for c in conflicts:
                _say(f"config conflict: {c}")
        self.comm.run_step(lambda: self.config.ckpt_dir.mkdir(parents=True, exist_ok=True)
                           if self.rank == 0 else None, f"creating {self.config.ckpt_dir}")
        self.events_path = self.config.ckpt_dir / FILENAME
        _watch_uncaught(self)
        # Handlers first: a signal during the restore below must not kill the process.
        self.recorder = SignalRecorder(DEFAULT_SIGNALS, chain=False).install()
        try:
            self._setup(state, failure_model, horizon_s, keep)
        except BaseException:
            self.recorder.uninstall()      # a session that failed to start must not keep the signals
            raise

    def _setup(self, state: Mapping[str, Any], failure_model: FailureModel | None, horizon_s: float,
               keep: int) -> None:
        user_state = session_state(state)
        # On every rank, from the one collective flattening: what a survivors' save could not
        # rebuild (never a state_dict() on one rank: some are collective).
        self._parts = held_in_parts(_check_saveable(user_state))
        self._history_pending: Pending | None = None
        self.schedule: Schedule = make_schedule(
            self.config.policy, lambda: failure_model if failure_model is not None else self._failure_model(),
            nodes=self.job.step_num_nodes or self.job.num_nodes or self.comm.size, horizon_s=horizon_s,
            comm=self.comm, in_place=self._in_place is not None)
        self._state = {**user_state, STATE_KEY: _SessionState(self.schedule)}
        self.run_record = runrecord.current_run(sys.argv, self.comm.size)
        self._check_same_run()
        self.mgr = CheckpointManager(self.config.ckpt_dir, self.comm, keep=keep)
        # Under the relaunch loop, its notice that srun saw a rank of this step end (runtime/peernotice.py).
        self.sync = StepSync(self.comm, self._min_deadline, PeerNotice.from_env(self._environ))
        self._dt_ema = 0.0
        self._op_timeout = OpTimeout()     # gloo's per-op timeout follows the peer deadline (a silent host)
        used_nodes = self.job.step_num_nodes or self.job.num_nodes   # the step's: spare nodes run no rank
        per_node = (self.job.ntasks // used_nodes) if self.job.ntasks and used_nodes else 1
        self.survival = Survival(self._state, self.comm, ranks_per_node=per_node, enabled=self._survivors,
                                 skip=frozenset({STATE_KEY}))
        # Sharded state: the memory tier keeps every rank's shards on a partner (runtime/memtier.py).
        self.memtier = memtier.for_session(lambda: {**self._state, STATE_KEY: {"version": 1, "schedule": self.schedule._own_state()}},
                                           self.comm, per_node, self._parts, self._survivors and self.survival.enabled,
                                           self._environ, _say, plan_fn=memtier.plan_with(
                                               self.schedule, used_nodes or 1, horizon_s, _say))
        self.log = EventLog(self.events_path, attempt=1, job_id=self.job.job_id, enabled=self.rank == 0)
        self.step = 0                      # steps completed
        self._loss = math.nan
        self._loss_steps = np.zeros(LOSS_BUFFER, dtype=np.int64)
        self._loss_values = np.zeros(LOSS_BUFFER, dtype=np.float64)
        self._loss_n = 0
        self._last_flush = time.monotonic()
        self._pending_ckpt: tuple[int, float] | None = None   # async save in flight: (step, blocking_s)
        self._started = False
        self._blocking = False             # agree on a stop at the boundary itself (lead short for 2 steps)
        self._recheck_at = -1              # a boundary where every rank re-decides _blocking
        self._lost_lock = threading.Lock() # one survivors' save per process (main thread or guard timer)

    def _check_same_run(self) -> None:
        """One run, one directory (:mod:`.runtime.runrecord`): refused before anything is loaded."""
        recorded = runrecord.recorded_run(read_events(self.events_path)) if self.rank == 0 else None
        diff = self.comm.bcast(runrecord.difference(recorded, self.run_record) if self.rank == 0 else None)
        if diff is None:
            longer = runrecord.continuation(recorded, self.run_record) if self.rank == 0 else None
            if longer:
                _say(f"the same run with another step count ({longer}): resuming it")
            return
        if not self.config.resume_from_other_run:
            raise CheckpointOtherRun(f"checkpoint directory {self.config.ckpt_dir} belongs to another run: {diff}",
                                     hint=runrecord.HINT)
        if self.rank == 0:
            _say(f"resuming from another run's directory, as asked (resume_from_other_run): {diff}")

    # -- the user's calls ----------------------------------------------------------------------------
    def steps(self, total_steps: int | None = None) -> Iterator[int]:
        """Yield the step indices still to run (from the restored step to ``total_steps - 1``).

        The first iteration restores the newest committed checkpoint into the state. Between
        iterations the session agrees with the other ranks on stops and saves; a stop for a signal
        saves, requeues where Slurm would not, and raises ``SystemExit(0)`` out of the loop.

        Args:
            total_steps: Overrides the ``total_steps`` given to the constructor.

        Yields:
            The index of the step to train, starting at the restored step.

        Raises:
            UsageError: No ``total_steps``, a second call, or ``total_steps`` below the latest
                checkpoint's step (nothing is changed).
            GaveUpError: Too many requeues, or restarts that make no progress.
        """
        total = total_steps if total_steps is not None else self.total_steps
        if total is None or int(total) < 0:
            raise UsageError("steps() needs total_steps", hint="Session(..., total_steps=N) or session.steps(N)")
        if self._started:
            raise UsageError("session.steps() can run once per session", hint="create a new Session")
        self._started = True
        total = int(total)
        step = 0
        try:
            step = self._begin()
            if step > total:
                self.mgr.close()
                # A refusal, not the run's end: coci-status keeps showing how the run ended.
                self.log.write("end", step=step, status="refused", message="total_steps lower than the "
                               f"latest checkpoint's step ({total} < {step}); nothing was changed")
                raise UsageError(f"total_steps={total} is lower than the step of the latest checkpoint in "
                                 f"{self.config.ckpt_dir} ({step}): this run already went further, there "
                                 f"is nothing to train and nothing was changed",
                                 hint=f"pass total_steps >= {step} to continue that run, or a new "
                                      f"checkpoint directory to start a new one")
            t = time.perf_counter()
            while step < total:
                self._loss = math.nan
                yield step
                step += 1
                now = time.perf_counter()
                self._after_step(step, now - t, total)
                t = now
            self._finish(total)
        except GeneratorExit:
            # The loop body left early: a `break`, or an exception (a peer failure surfaces inside
            # the user's step, e.g. gloo's "Connection reset by peer" in loss.backward()). A
            # generator cannot see that exception, so ask the peers: a lost one does not answer.
            t_fail = time.time()       # when the failure surfaced here, before the probe's deadline
            if step < total and self.comm.size > 1 and not self.sync.probe(self.sync.deadline_s):
                self._peer_lost(self.step, f"an exception inside the step, then: {self.sync.lost_why}", t_fail)
            raise
        finally:
            self._op_timeout.restore()
            self.recorder.uninstall()
            self.survival.remove_hooks()
            signals.after_session()        # coci-submit's placeholders give the default action back

    def observe(self, loss: Any) -> None:
        """Record the step's loss; rank 0 feeds it to the planner and the event log.

        Args:
            loss: The step's loss, a float or a 0-d tensor (other ranks' values are ignored).
        """
        if self.rank == 0:
            self._loss = float(loss)

    @property
    def stop_requested(self) -> bool:
        """Local: a stop signal arrived on this rank (the loop stops at the next step boundary)."""
        return bool(self.recorder.received)

    # -- start of an attempt -------------------------------------------------------------------------
    def _begin(self) -> int:
        info = self._read_history() if self.rank == 0 else None
        t0 = time.perf_counter()
        resumed: int | None = None
        if self.mgr.latest_step() is not None:
            resumed = self.mgr.load_latest(self._state).step
            if self._init_from is not None and self.rank == 0:
                _say(f"init_from={os.fspath(self._init_from)} ignored: resumed from this run's own "
                     f"checkpoint step {resumed}")
        elif self._init_from is not None:
            self._load_pretrained()
        restore_s = time.perf_counter() - t0
        if resumed is not None:
            self.schedule.resumed(resumed)
        self.step = resumed or 0
        verdict, blocking = None, False
        if self.rank == 0:
            assert info is not None
            verdict = self._record_start(info, resumed, restore_s)
            sweep_torn(self.config.ckpt_dir)      # only now that attempt_start is written: see sweep_torn
            memtier.sweep(self.config.ckpt_dir)   # the memory tier's staging of earlier failures, likewise
            blocking = verdict is None and self._lead_check(warn=True)
        verdict, self._blocking, self.log.attempt = self.comm.bcast((verdict, blocking, self.log.attempt))
        self.survival.boundary(self.step)
        if verdict is not None:
            self.mgr.close()
            raise GaveUpError(verdict, hint="fix the cause shown in the previous attempts' logs, then "
                                            "resubmit (raise --max-requeues / COCI_NO_PROGRESS_LIMIT if "
                                            "the restarts were expected)")
        self._recheck_at = self.step + 3           # once the first steps of this attempt are timed
        # From now on no collective of ours (the store's included) waits for ever on a dead peer:
        # each is polled against the peer deadline (coci_hpc.comm), and an MPI-IO call that
        # cannot be polled is guarded by a timer that starts the survivors' save (_stuck).
        self.comm.peer_deadline_s = self.sync.deadline_s
        self.comm.on_stuck = self._stuck
        if self.sync.notice is not None:
            self.comm.peer_notice = self.sync.notice.posted
        if self.rank == 0 and self.sync.notice is not None:
            self.sync.notice.mark_training()       # the relaunch loop's grace for a survivors' save applies
        if not self._blocking:
            # The first boundary's agreement is sent now (the pipeline is one step deep).
            self.sync.send(STOP if self.recorder.received else 0, self.schedule.decide(self.step + 1), False)
        return self.step

    def _load_pretrained(self) -> None:
        from coci_hpc.interop.pretrained import load_pretrained

        if "model" not in self._state:
            raise UsageError("init_from needs the model under the state key 'model'",
                             hint="pass Session({'model': model, ...}, init_from=PATH)")
        assert self._init_from is not None
        report = load_pretrained(self._init_from, self._state["model"], strict=self._init_strict,
                                 log=_say if self.rank == 0 else None)
        if self.rank == 0:
            _say(f"init_from: loaded {len(report.loaded)} tensors from {report.source} ({report.kind})")

    def _read_history(self) -> dict[str, Any]:
        events = read_events(self.events_path)
        self.log.attempt = last_attempt(events) + 1
        rows: list[sacct.SlurmAttempt] = []
        sacct_error = None
        jid = self.job.requeue_id
        # An in-place restart is the same Slurm attempt: sacct says nothing about the previous
        # one (the relaunch record does), and the query would sit on the restart's critical path.
        if jid is not None and not self._in_place:
            try:
                rows = sacct.job_attempts(jid, self._runner)
            except (SlurmError, OSError) as exc:
                sacct_error = str(exc)
        # A survivors' save killed before its manifest (SIGKILL at KillWait, a second failure):
        # its staging goes once this attempt is recorded, its data file at the next save (an
        # uncommitted leftover).
        recorded = {e.get("step") for e in att.previous_records(events) if e.get("event") == "peer_lost"}
        torn = [s for s in torn_steps(self.config.ckpt_dir) if s not in recorded]   # recorded: a fallback
        if torn:
            _say(f"the survivors' save of step(s) {torn} never committed (killed before its manifest); "
                 f"resuming from the latest committed checkpoint instead")
        return {"events": events, "rows": rows, "sacct_error": sacct_error, "torn": torn}

    def _survivor_coverage(self, events: list[dict[str, Any]]) -> float:
        """Rank 0: the share of failures the planner may count as ~one step lost (survivors' saves)."""
        from coci_hpc.runtime import survivors as sv

        return sv.coverage_estimate(events, self.survival.enabled and (not self._parts or self.memtier is not None))

    def _record_start(self, info: dict[str, Any], resumed: int | None, restore_s: float) -> str | None:
        events, rows = info["events"], info["rows"]
        prev = att.previous_records(events)
        rc = self.job.restart_count
        prev_slurm = rows[-2] if rc > 0 and len(rows) >= 2 else None
        if rc > 0 and len(rows) < 2 and info["sacct_error"] is None:
            info["sacct_error"] = f"sacct lists {len(rows)} attempt(s) of job {self.job.requeue_id}"
        prev_end = att.classify_previous(prev, prev_slurm, restart_count=rc, sacct_error=info["sacct_error"])
        lost = att.steps_lost(prev, resumed) if prev_end.reason != "none" else None
        if info.get("torn"):        # the torn save's step was finished by every rank (no record says so)
            lost = max(lost or 0, max(info["torn"]) - (resumed or 0))
        if prev_end.reason in ("node_failure", "crash", "rank_failure") and prev_end.end_wall:
            self.schedule.after_failure(time.time() - prev_end.end_wall)
        coverage = self._survivor_coverage(events)
        self.schedule.use_survivor_coverage(coverage)
        from coci_hpc.runtime import survivors as sv
        verdict = att.give_up_reason(events, resumed, prev_end.reason, job_id=self.job.job_id, restart_count=rc,
                                     max_requeues=self.config.max_requeues,
                                     no_progress_limit=self.config.no_progress_limit,
                                     in_place_restart=self._in_place or 0)
        nodes = expand_hostlist(self.job.step_nodelist or self.job.nodelist or "") \
            if (self.job.step_nodelist or self.job.nodelist) else []
        self.log.write("attempt_start", nodes=nodes, ranks=self.comm.size, run=self.run_record,
                       policy=self.config.policy,
                       restart_count=rc, prev_end=prev_end.to_dict(), resumed_step=resumed, steps_lost=lost,
                       torn_survivors_saves=info.get("torn") or [],
                       config_sources=dict(self.config.sources), slurm_id=self.job.requeue_id,
                       survivor_coverage=coverage,
                       survivors_off=sv.parts_reason(self._parts) if self._parts and self.memtier is None else None,
                       memory_tier_every=None if self.memtier is None else self.memtier.every,
                       in_place_restart=self._in_place, process_wall=self._process_wall,
                       session_wall=self._init_wall)
        _say(att.describe_start(self.log.attempt, self.job.job_id, rc, nodes, self.comm.size, prev_end.reason,
                                prev_end.detail, resumed, lost))
        if self._parts and self.survival.enabled and self.memtier is None:
            _say(f"on a lost rank: no survivors' save, back to the last checkpoint: {sv.parts_reason(self._parts)}")
        if verdict is not None:
            self.log.write("end", step=resumed, status="gave_up", message=verdict)
            _say(f"giving up: {verdict}")
            return verdict
        if resumed is not None:
            cur = rows[-1] if rows and rows[-1].state == "RUNNING" else None
            # In place, the "requeue" part is the relaunch loop's (failure -> these processes
            # exist): Slurm's row started with the allocation, long before.
            began = self._process_wall if self._in_place else (cur.start if cur else None)
            lat = att.latency_split(prev_end.end_wall, began, self._init_wall, time.time(), restore_s)
            if self._in_place and prev_end.reason != "none" and lat["total"] is not None:
                self.schedule.restarted_in_place(float(lat["total"]))
            self.log.write("resumed", step=resumed, restart_latency_s=lat)
            _say(f"resumed from step {resumed}: {att.describe_latency(lat)}")
        return None

    # -- the step boundary ---------------------------------------------------------------------------
    def _after_step(self, step: int, dt: float, total: int) -> None:
        self.step = step
        if self._history_pending is not None and self._history_pending.done():
            self._use_fresh_history()
        if self.rank == 0:
            self._record_loss(step)
        self.schedule.observe(step, self._loss if self.rank == 0 else math.nan, dt)
        self.survival.boundary(step)
        if self.memtier is not None:
            self.memtier.boundary(step)
        self._dt_ema = dt if self._dt_ema == 0.0 else 0.9 * self._dt_ema + 0.1 * dt
        self.sync.deadline_s = max(self._min_deadline, 10.0 * self._dt_ema)
        self.comm.peer_deadline_s = self.sync.deadline_s
        self._op_timeout.observe(self.sync.deadline_s)
        t_wait = time.time()
        try:
            if self._blocking:                      # this boundary's own agreement, completed at once
                self.sync.send(STOP if self.recorder.received else 0,
                               self.schedule.decide(step) if step < total else False, self._busy())
            # What every rank agreed on (at the previous boundary when pipelined: the one collective).
            level, save, busy = self.sync.receive()
        except PeerLost as exc:
            self._peer_lost(step, f"the step agreement after step {step}: {exc.message}", t_wait)
        try:
            if self.mgr.persist_in_flight and not busy:
                self._settle()
            if level >= STOP and step < total:      # a stop at the very end is just the end
                self._stop(step)
            if save and step < total:               # the last step gets the final save instead
                self._save(step)
                self._recheck_at = step
            if step == self._recheck_at and step < total:
                self._blocking = bool(self.comm.bcast(self._lead_check(warn=False) if self.rank == 0 else None))
        except PeerLost as exc:
            # A peer vanished while a checkpoint's collectives were in flight: the survivors save
            # this boundary's state (the step that save was writing); the torn save never commits.
            self._save_collective_lost(step, exc)
        if not self._blocking:
            self.sync.send(STOP if self.recorder.received else 0,
                           self.schedule.decide(step + 1) if step + 1 < total else False, self._busy())

    def _save_collective_lost(self, step: int, exc: PeerLost) -> None:
        waited = self.comm.peer_deadline_s or 0.0
        self._peer_lost(step, f"a checkpoint collective after step {step} did not complete: {exc.message}",
                        time.time() - waited)

    def _stuck(self, what: str) -> None:
        """The guard timer (coci_hpc.comm.Comm.guard): the main thread is inside an MPI-IO call
        that a lost peer never joins. Save from the survivors from here; never returns."""
        waited = self.comm.peer_deadline_s or 0.0
        self._peer_lost(self.step, f"a checkpoint write after step {self.step} is stuck: {what}",
                        time.time() - waited)

    def _busy(self) -> bool:
        return self.mgr.persist_in_flight and not self.mgr.persist_done

    def _lead_check(self, *, warn: bool) -> bool:
        """Rank 0: whether to agree on a stop at the boundary itself (True when the signal lead cannot
        cover two steps, a save and the requeue: the pipelined agreement stops one step later).
        With ``warn``, says so when even one step does not fit. Other ranks return False."""
        if self.rank != 0 or (not self.job.in_slurm_job and self.config.signal_lead_s is None):
            return False                   # a run by hand has no warning signal to fit in
        lead = self.config.signal_lead_s if self.config.signal_lead_s is not None else att.DEFAULT_SIGNAL_LEAD_S
        c = self.schedule.costs()
        save_s = c.ckpt_s + c.persist_s if self.schedule.measured else None
        verdict = att.lead_check(lead, c.step_time_s, save_s, att.REQUEUE_ALLOWANCE_S)
        if warn and verdict.warning:
            _say(verdict.warning)
            self.log.write("lead_warning", message=verdict.warning, lead_s=lead, step_s=c.step_time_s, save_s=save_s)
        return verdict.stop_at_boundary

    def _save(self, step: int, kind: str = "planned") -> None:
        self._settle()
        t0 = time.perf_counter()
        if self.async_save and kind == "planned":
            self.mgr.save_async(step, self._state)
            blocking = time.perf_counter() - t0
            self._pending_ckpt = (step, blocking)
        else:
            self.mgr.save(step, self._state)
            blocking = time.perf_counter() - t0
            self._flush_losses()
            self.log.write("checkpoint", step=step, kind=kind, blocking_s=blocking, persist_s=None)
        self.schedule.saved(step, blocking)

    def _settle(self) -> None:
        """The one way an in-flight two-phase save ends: wait for its commit, then record it."""
        if not self.mgr.persist_in_flight and self._pending_ckpt is None:
            return
        # A rank whose background write is done waits in the commit's first collective for the
        # slowest rank's write: that is not a lost peer, so the deadline grows by twice the
        # writes measured so far (0 before the first).
        base = self.comm.peer_deadline_s
        if base is not None and self.mgr.persist_in_flight:
            self.comm.peer_deadline_s = base + 2.0 * self.schedule.costs().persist_s
        try:
            self.mgr.wait()
        finally:
            self.comm.peer_deadline_s = base
        if self._pending_ckpt is None:
            return
        step, blocking = self._pending_ckpt
        self._pending_ckpt = None
        persist = self.mgr.async_stats.get("persist_s")
        self.schedule.persisted(persist)
        self._flush_losses()
        self.log.write("checkpoint", step=step, kind="planned", blocking_s=blocking, persist_s=persist)

    def _stop_plan(self) -> att.StopPlan:
        """Rank 0: why we stop, from Slurm's record of the job (one ``scontrol show job``, plus the
        partition's GraceTime for a preemption or KillWait for an end from outside)."""
        first = self.recorder.first
        signame = first.name if first is not None else "?"
        now = time.time()
        signal_wall = now - (time.monotonic() - first.monotonic) if first is not None else now
        record, grace, kill_wait = None, None, None
        if self.job.in_slurm_job:
            try:
                record = scontrol.show_job(self.job.requeue_id or "", self._runner)
            except (SlurmError, ValueError, OSError) as exc:
                _say(f"`scontrol show job` failed ({exc}); deciding without Slurm's record")
            try:
                if record is not None and record.preempted and (record.partition or self.job.partition):
                    grace = scontrol.grace_time_s(record.partition or self.job.partition or "", self._runner)
                if signame == "SIGTERM" and (record is None or not record.preempted or grace == 0):
                    kill_wait = scontrol.kill_wait_s(self._runner)
            except (SlurmError, ValueError, OSError):
                kill_wait = kill_wait if kill_wait is not None else scontrol.DEFAULT_KILL_WAIT_S
        return att.stop_reason(signame, record, now_wall=time.time(), signal_wall=signal_wall,
                               restart_count=self.job.restart_count, in_slurm_job=self.job.in_slurm_job,
                               signal_lead_s=self.config.signal_lead_s, grace_time_s=grace, kill_wait_s=kill_wait)

    def _stop(self, step: int) -> None:
        first = self.recorder.first
        signame = first.name if first is not None else "?"
        decision = None
        if self.rank == 0:
            plan = self._stop_plan()
            c = self.schedule.costs()
            save_s = c.ckpt_s + c.persist_s if self.schedule.measured else None
            fits = plan.save_fits(time.time(), save_s)
            decision = (plan.reason, plan.detail, plan.requeue, fits)
        reason, detail, requeue, fits = self.comm.bcast(decision)
        requeue = requeue and self.job.in_slurm_job
        self._settle()
        saved = self.mgr.latest_step() == step
        if not saved and fits:
            self.schedule.stopping()
            self._save(step, kind="stop")
            saved = True
        elif not saved:
            detail += "; no save: it would not end before Slurm's kill"
        self._flush_losses()
        rc = self.job.restart_count
        self.log.write("stop", step=step, reason=reason, signal=signame, requeued=requeue, detail=detail,
                       restart_count=rc, saved=saved)
        if requeue:
            def ask() -> None:
                if self.rank == 0:
                    requeue_with_retries(self.job.requeue_id or "", self._runner)
            # The others wait for rank 0's `scontrol requeue` (with its retries): not a lost peer.
            deadline, self.comm.peer_deadline_s = self.comm.peer_deadline_s, max(60.0, self.sync.deadline_s)
            try:
                self.comm.run_step(ask, "requeue")
            except PeerLost:
                raise
            except CociError as exc:
                self.log.write("end", step=step, status="error", message=str(exc))
                raise
            self.comm.peer_deadline_s = deadline
        self.mgr.close()
        if self.rank == 0:
            _say(f"stopped at step {step} ({reason}: {detail}): "
                 + ("checkpoint saved" if saved else f"resumes from step {self.mgr.latest_step() or 0}")
                 + (", job requeued" if requeue else "; Slurm requeues the job" if reason in att.SLURM_REQUEUES
                    else "; not requeued (run again with the same arguments to resume)"))
        raise SystemExit(0)

    def _record_loss(self, step: int) -> None:
        n = self._loss_n
        self._loss_steps[n], self._loss_values[n] = step, self._loss
        self._loss_n = n + 1
        if self._loss_n == LOSS_BUFFER or time.monotonic() - self._last_flush > LOSS_FLUSH_S:
            self._flush_losses()

    def _flush_losses(self) -> None:
        n = self._loss_n
        if self.rank == 0 and n:
            self.log.write("losses", steps=self._loss_steps[:n].tolist(), values=self._loss_values[:n].tolist())
        self._loss_n = 0
        self._last_flush = time.monotonic()

    def _peer_lost(self, step: int, how: str, t_fail: float) -> None:
        """A peer rank is gone: save from the survivors (:mod:`.runtime.survivors`), record it,
        requeue the job (Slurm requeues a NODE_FAIL by itself; a crashed rank on a healthy node
        needs us) and leave the process at once, with no MPI collective or finalize that would
        wait for the dead rank. Never returns."""
        in_place = self._in_place is not None
        from coci_hpc.runtime import survivors as sv

        # The main thread (a deadline missed) and the guard timer (an MPI-IO call stuck) may both
        # get here: the first one saves and ends the process, the second waits for that end.
        self._lost_lock.acquire()
        self.comm.lost = True
        newer = self._newer_attempt()
        if newer is not None:
            # A process left over from an attempt Slurm has already replaced: its host stopped
            # (a hung kernel, a paused VM) past SlurmdTimeout, the job was requeued and started
            # elsewhere, and the host ran again before slurmd killed what it had left. Saving,
            # recording or `scontrol requeue` now would act on the live run: requeue it, log a
            # failure it did not have. Leave as quietly as a killed process.
            _say(f"rank {self.rank}: peer lost at step {step} ({how}), but attempt {newer} of this run has "
                 f"started since this attempt ({self.log.attempt}) began: this process was left behind and "
                 f"leaves without saving, recording or requeueing")
            _leave_after_peer_loss(in_place)
        try:
            t_detect = time.time()
            # A background persist of a regular save may still be writing (its step directory is
            # replaced below when it is the same step): let it finish first, locally, bounded.
            self.mgr.quiesce(timeout_s=5.0)
            _say(f"rank {self.rank}: peer lost at step {step}: {how}. {PEER_LOST_MPI_NOTE}")
            sv_ = self.survival
            boundary = sv_.snapshot.step
            root = self.config.ckpt_dir
            out: Any = None
            reason = ""
            if not sv_.enabled:
                reason = sv_.why_not
            elif sv_.opt_steps != sv_.snapshot.opt_steps:
                reason = f"this rank's optimizer had already stepped past step {boundary} when the failure surfaced"
            elif sv_.own_for(boundary) is None:
                reason = f"this rank holds no copy of its own per-rank state for step {boundary}"
            if self.memtier is not None:      # sharded state: its newest whole memory-tier step, else disk
                out = memtier.survivors_save(root, boundary, self.memtier, self._tuning(), self.mgr.keep, window_s=3.0)
            elif not reason:
                own_copy = sv_.own_for(boundary)
                assert sv_.partner is not None and own_copy is not None
                copy = sv_.partner.copy_for(boundary)       # decoded only now, off the per-step path
                own = own_copy.state()
                sv_.snapshot.rollback(self._state)
                sv.restore_own_rng(own)
                tuning = self._tuning()
                # Within Slurm's kill window: KillWait (5 s here, 30 s by default) after the node is DOWN.
                # The planner's state_dict() broadcasts rank 0's view: take this survivor's own instead.
                local = {**self._state, STATE_KEY: {"version": 1, "schedule": self.schedule._own_state()}}
                out = sv.save(root, boundary, local, self.rank, self.comm.size, own,
                              [copy] if copy is not None else [], tuning, self.mgr.keep, window_s=3.0,
                              parts=self._parts)
            else:
                staging = sv.staging_dir(root, boundary)
                staging.mkdir(mode=0o700, exist_ok=True)
                out = sv.Outcome(boundary, writer=sv.claim(root, boundary), reason=reason)
            if out.writer:
                latest = mf_latest(root)       # not mgr.latest_step(): that is a collective
                log = self.log if self.rank == 0 else EventLog(self.events_path, attempt=self.log.attempt,
                                                               job_id=self.job.job_id, enabled=True)
                if self.rank == 0:
                    self._flush_losses()
                # Which tier served: "survivors" (the last step), "memory" (the memory tier's), "disk".
                tier = getattr(out, "tier", "survivors" if out.committed else "disk")
                log.write("peer_lost", step=out.step if out.step is not None else boundary, tier=tier, how=how, survivor=self.rank, committed=out.committed,
                          lost_ranks=out.ranks_from_partner, reason=out.reason, failure_wall=t_fail,
                          detect_wall=t_detect, commit_wall=time.time() if out.committed else None,
                          save_s=out.write_s, fallback_step=None if out.committed else latest)
                if in_place and self.sync.notice is not None:
                    self.sync.notice.mark_left()    # the loop may end a silent peer's task now
                if out.committed:
                    _say(f"survivors' checkpoint of step {out.step} ({tier} tier) committed {time.time() - t_fail:.1f}s after "
                         f"the failure (ranks {out.ranks_from_partner} from their partners' copies)")
                else:
                    _say(f"no survivors' checkpoint ({out.reason}); falling back to the last regular checkpoint "
                         f"(step {latest})")
                if in_place:
                    _say("coci-submit's relaunch loop restarts the ranks in place (--spare-nodes): no requeue")
                elif self.job.in_slurm_job:
                    try:
                        requeue_with_retries(self.job.requeue_id or "", self._runner)
                        _say("job requeued")
                    except SlurmError as exc:
                        _say(f"requeue failed ({exc}); Slurm requeues a NODE_FAIL job by itself")
        except BaseException as exc:  # noqa: BLE001 - nothing may keep this rank from leaving
            import traceback
            traceback.print_exc()
            _say(f"rank {self.rank}: the survivors' save failed ({exc}); the previous checkpoint stays latest")
            if self.job.in_slurm_job:
                try:
                    requeue_with_retries(self.job.requeue_id or "", self._runner)
                except SlurmError:
                    pass
        _leave_after_peer_loss(in_place)

    def _tuning(self) -> Any:
        if self.mgr._tuning is not None:
            return self.mgr._tuning
        from coci_hpc.checkpoint.lustre import tuning_for
        return tuning_for(self.config.ckpt_dir, self.mgr.lustre, self.comm.size, self.mgr.access)

    def _newer_attempt(self) -> int | None:
        """The attempt of this run that started after this one, if any (from the event log: every
        attempt, requeued or restarted in place, writes ``attempt_start`` before its first step)."""
        try:
            newest = last_attempt(read_events(self.events_path))
        except OSError:
            return None
        return newest if newest > self.log.attempt else None

    def _finish(self, total: int) -> None:
        t_wait = time.time()
        try:
            self.sync.receive()            # complete the last boundary's allreduce on every rank
        except PeerLost:
            self._peer_lost(total, f"the last step agreement timed out ({self.sync.deadline_s:.1f}s)", t_wait)
        try:
            self._settle()
            if self.mgr.latest_step() != total:
                self._save(total, kind="final")
            self._flush_losses()
            self.mgr.close()
        except PeerLost as exc:
            self._save_collective_lost(total, exc)
        self.comm.peer_deadline_s, self.comm.on_stuck, self.comm.peer_notice = None, None, None
        self.log.write("end", step=total, status="completed", message="")

    # -- helpers -------------------------------------------------------------------------------------
    def _failure_model(self) -> FailureModel:
        """Rank 0: the partition's failure model, cached per partition and window and refreshed in
        the background (:mod:`coci_hpc.slurm.failure_cache`); nothing is asked outside a job."""
        default = from_mtbf(DEFAULT_MTBF_H * 3600)
        if self.rank != 0:
            return default                    # only rank 0 plans
        model, line, self._history_pending = failure_model_for_job(self.job, default, window_days=HISTORY_DAYS,
                                                                   runner=self._runner, environ=self._environ)
        _say(line + ("" if model is not default else f" (per-node MTBF {DEFAULT_MTBF_H:g} h)"))
        return model

    def _use_fresh_history(self) -> None:
        """Rank 0, at a step boundary: the background read of the history finished."""
        pending, self._history_pending = self._history_pending, None
        got = pending.result() if pending is not None else None
        if got is None:
            _say(f"failure history of partition {self.job.partition} unavailable "
                 f"({pending.error if pending else '?'}); keeping the model the attempt started with")
            return
        model, summary = got
        if hasattr(self.schedule, "use_failure_model"):
            self.schedule.use_failure_model(model)
        _say(describe_history(self.job.partition or "", summary) + "; the plan now uses it")


_active: list[weakref.ref[Session]] = []
_hooked = False


def _watch_uncaught(session: Session) -> None:
    """An exception the user's code lets out of the loop ends the attempt: it is written to the
    event log as the attempt's end (status "error"), so coci-status does not show it running.
    sys.excepthook sees it under python/srun; coci-submit's runner calls :func:`record_uncaught`."""
    global _hooked
    _active[:] = [weakref.ref(session)]
    if _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def hook(tp: type[BaseException], exc: BaseException, tb: Any) -> None:
        record_uncaught(exc)
        previous(tp, exc, tb)
    sys.excepthook = hook


def record_uncaught(exc: BaseException) -> None:
    """Write ``end`` status "error" for the session of this process whose loop did not end."""
    session = _active[0]() if _active else None
    if session is None or isinstance(exc, SystemExit) or session.rank != 0 or not hasattr(session, "log"):
        return
    try:
        mine = [e for e in read_events(session.events_path) if e.get("attempt") == session.log.attempt]
        if mine and mine[-1].get("event") in ("end", "stop"):
            return                          # the session recorded how it ended (gave up, stopped, ...)
        session.log.write("end", step=session.step, status="error",
                          message=f"{type(exc).__name__}: {exc}"[:2000])
    except OSError:                         # the log's directory is gone: nothing to record into
        pass


def _check_saveable(state: Mapping[str, Any]) -> list[Leaf]:
    """Refuse at Session() what the store could not save (a lock, a file, an arbitrary object: it
    would fail at the first checkpoint, maybe an hour later). Flattening takes views, no copies.
    Collective where a ``state_dict()`` is: every rank calls it here. Returns the leaves."""
    try:
        return collect(state, rng=False, defer_device=True)[1]
    except CheckpointError as exc:
        raise UsageError(f"this state cannot be checkpointed: {exc.message}",
                         hint=exc.hint or "keep tensors, numpy arrays, JSON values and objects with "
                                          "state_dict()/load_state_dict() in the state") from exc


def mf_latest(root: Any) -> int | None:
    from coci_hpc.checkpoint import manifest
    return manifest.latest_step(root)
