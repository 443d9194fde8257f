"""The training session (:class:`Session`): it runs the loop (restore, steps, observe, save and
settle, finish); what happens around the loop belongs to the runtime objects it holds: the
attempt's records (:mod:`.runtime.attemptbook`), the stop (:class:`.runtime.preemption.StopController`,
shared with ``PreemptionGuard``), a lost peer (:mod:`.runtime.peerloss`), the per-step agreement
(:mod:`.runtime.stepsync`), the plan (:mod:`.runtime.schedule`), the losses (:mod:`.runtime.losses`).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.comm import Comm
from coci_hpc.errors import PeerLost, UsageError
from coci_hpc.planner.failures import FailureModel
from coci_hpc.runtime import errorexit, memtier, ncclwatch, progress, runrecord, signals
from coci_hpc.runtime.attemptbook import AttemptBook
from coci_hpc.runtime.config import resolve
from coci_hpc.runtime.data import check_saveable, session_state
from coci_hpc.runtime.distributed import default_comm
from coci_hpc.runtime.errorexit import record_uncaught  # noqa: F401 - coci-submit's runner calls it here
from coci_hpc.runtime.events import FILENAME, Checkpoint, CheckpointKind, End, EndStatus, EventLog
from coci_hpc.runtime.failurehistory import PartitionHistory
from coci_hpc.runtime.losses import LossBuffer
from coci_hpc.runtime.optimeout import OpTimeout
from coci_hpc.runtime.peerloss import PeerLoss, SessionParts, peer_settings
from coci_hpc.runtime.peernotice import PeerNotice
from coci_hpc.runtime.preemption import DEFAULT_SIGNALS, SignalRecorder, StopController
from coci_hpc.runtime.procinfo import process_start_wall
from coci_hpc.runtime.schedule import Schedule, ScheduleState, make_schedule
from coci_hpc.runtime.stepsync import StepSync
from coci_hpc.runtime.survivors import held_in_parts
from coci_hpc.slurm import commands
from coci_hpc.slurm.env import JobEnvironment

STATE_KEY = "coci_session"
STOP = 1                    # stop level exchanged at the step boundary (MAX over ranks)


def _say(msg: str) -> None:
    print(f"coci: {msg}", file=sys.stderr, flush=True)


class Session:
    """A preemption-safe training loop: restore, plan checkpoints, stop, save and requeue.

    Create one per process (every rank, same arguments), then iterate :meth:`steps` and call
    :meth:`observe` with each step's loss. Arguments left ``None`` come from the environment (the
    ``COCI_*`` variables coci-submit sets), else from the defaults; an explicit argument wins over
    the environment and rank 0 logs the conflict. On every rank, with nothing else written by the user:

    - restores the newest committed checkpoint (state in place, RNG, loader position, scheduler);
      chooses checkpoint steps with the planner (``fixed:N`` = every N steps), saves two-phase;
    - owns USR1, USR2 and SIGTERM while it runs (record-only handlers, previous ones restored
      after); on a signal every rank stops at the next step boundary, rank 0 reads why from
      Slurm's record of the job (preemption, time limit, ``scancel``, a requeue by hand), every
      rank saves when the save fits before Slurm's kill (GraceTime of a preemption, KillWait
      otherwise), rank 0 requeues a preempted or timed-out job (never a cancelled one) and the
      process exits with status 0 (``SystemExit(0)`` raised out of the loop);
    - on a lost rank the survivors save the last finished step, record it and leave; rank 0 writes
      ``<ckpt_dir>/events.jsonl`` (attempts and how they ended, checkpoints, losses, stops, latency);
    - gives up (``GaveUpError``) after ``max_requeues`` requeues after unannounced ends or
      restarts that keep resuming from the same checkpoint; warns when the signal lead cannot fit
      a step, a save and the requeue. Per step: a MAX-allreduce of 3 doubles, a 32-byte pwrite, no Slurm call.

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
            as lost (the deadline: at least this and 10 typical steps); ``COCI_PEER_TIMEOUT_S``, default 5 s.
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
        self._init_from, self._init_strict = init_from, init_strict
        self._in_place, self._min_deadline, self._survivors = peer_settings(environ, peer_timeout_s, survivors)
        self._process_wall = process_start_wall()
        if STATE_KEY in state:
            raise UsageError(f"the state key {STATE_KEY!r} is the session's own", hint="rename that entry")
        self.job, self._environ = JobEnvironment.from_env(environ), environ
        explicit = {"ckpt_dir": None if ckpt_dir is None else os.fspath(ckpt_dir), "policy": policy,
                    "max_requeues": max_requeues, "no_progress_limit": no_progress_limit,
                    "signal_lead_s": signal_lead_s, "resume_from_other_run": resume_from_other_run}
        self.config, conflicts = resolve({k: v for k, v in explicit.items() if v is not None}, environ, self.job)
        self.comm = default_comm(environ) if comm is None else Comm.wrap(comm)
        self.rank = self.comm.rank
        self.total_steps, self.async_save = total_steps, async_save
        self._runner = runner or commands.run_command
        for c in conflicts if self.rank == 0 else []:
            _say(f"config conflict: {c}")
        self.comm.run_step(lambda: self.config.ckpt_dir.mkdir(parents=True, exist_ok=True)
                           if self.rank == 0 else None, f"creating {self.config.ckpt_dir}")
        self.events_path = self.config.ckpt_dir / FILENAME
        errorexit.watch_uncaught(self)
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
        self._parts = held_in_parts(check_saveable(user_state))
        self.history = PartitionHistory(self.job, self._runner, self._environ, self.rank)
        self.schedule: Schedule = make_schedule(
            self.config.policy, lambda: failure_model if failure_model is not None else self.history.model(),
            nodes=self.job.step_num_nodes or self.job.num_nodes or self.comm.size, horizon_s=horizon_s,
            comm=self.comm, in_place=self._in_place is not None)
        self._state = {**user_state, STATE_KEY: ScheduleState(self.schedule)}
        self.run_record = runrecord.current_run(sys.argv, self.comm.size)
        self._start_events = runrecord.check_same_run(   # rank 0's parse of events.jsonl, reused at the start
            self.comm, self.events_path, self.run_record, self.config.ckpt_dir,
            resume_from_other_run=bool(self.config.resume_from_other_run), say=_say)
        self.mgr = CheckpointManager(self.config.ckpt_dir, self.comm, keep=keep)
        self.progress = progress.ProgressRecord(self.config.ckpt_dir, self.comm)   # last step finished, per rank
        # Under the relaunch loop, its notice that srun saw a rank of this step end (runtime/peernotice.py).
        self.sync = StepSync(self.comm, self._min_deadline, PeerNotice.from_env(self._environ), self.recorder.sigterm_at)
        self._op_timeout = OpTimeout()     # gloo's per-op timeout follows the peer deadline (a silent host)
        self.log = EventLog(self.events_path, attempt=1, job_id=self.job.job_id, enabled=self.rank == 0)
        self.losses = LossBuffer(self.log, enabled=self.rank == 0)
        self.book = AttemptBook(self.log, self.job, self._runner, self.config.ckpt_dir, in_place=self._in_place,
                                process_wall=self._process_wall, init_wall=self._init_wall, progress=self.progress)
        self.stopper = StopController(self.job, self.recorder, self.config.signal_lead_s, self._runner, say=_say)
        hangs = ncclwatch.backend_hangs()  # NCCL: a lost peer hangs the survivors instead of raising
        self.peer_loss = PeerLoss.for_session(   # with the survivors' copy and the memory tier (state held in parts)
            SessionParts(self.comm, self.mgr, self._state, STATE_KEY, self._state[STATE_KEY].local_state_dict,
                         self._parts, self.config.ckpt_dir, self.log, self.book, self.losses, self.job, self._runner,
                         self.sync.notice, self._in_place), enabled=self._survivors, environ=self._environ, say=_say,
            plan_fn=self.schedule.following(memtier.plan_with(self.schedule, horizon_s, _say, self._environ,
                                                              self.events_path, self.log)), skip=frozenset({STATE_KEY}),
            host_only=hangs)
        self.survival = self.peer_loss.survival
        self._nccl = ncclwatch.for_session(self.comm, self.sync, _say) if hangs else None   # watches while the loop runs
        self._watch = contextlib.ExitStack()   # the comm's watch on its peers while the loop runs
        self.step, self._loss, self._started = 0, math.nan, False   # steps completed, rank 0's loss, steps() ran
        self._pending_ckpt: tuple[int, float] | None = None   # async save in flight: (step, blocking_s)
        self._blocking = False             # agree on a stop at the boundary itself (lead short for 2 steps)
        self._recheck_at = -1              # a boundary where every rank re-decides _blocking
        self._pin_ahead = False            # page-lock the two-phase save's buffers at the next free boundary

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
        completed = False
        try:
            step = self._begin()
            if step > total:
                self.mgr.close()
                self.book.refuse_total(step, total)
            t = time.perf_counter()
            while step < total:
                self._loss = math.nan
                yield step
                step += 1
                now = time.perf_counter()
                self._after_step(step, now - t, total)
                t = now
            self._finish(total)
            completed = True
        except GeneratorExit:          # the loop body left early: a `break`, or an exception
            if step < total:
                self.peer_loss.after_exception(self.step, self.sync)
            raise
        finally:
            self._watch.close()
            self._op_timeout.restore()
            self.recorder.uninstall()
            self.survival.close()
            signals.after_session(completed)   # placeholders give the default action back; done: late warnings ignored

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
        info = self.book.read_history(self._start_events, self.mgr.catalog) if self.rank == 0 else None
        t0 = time.perf_counter()
        resumed = self.mgr.load_latest(self._state).step if self.mgr.latest_step() is not None else None
        if self._init_from is not None:            # pretrained weights while the run has no checkpoint
            from coci_hpc.interop.pretrained import init_state_from
            init_state_from(self._state, self._init_from, strict=self._init_strict, resumed=resumed,
                            log=_say if self.rank == 0 else None)
        restore_s = time.perf_counter() - t0
        if resumed is not None:
            self.schedule.resumed(resumed)
        self.step = resumed or 0
        verdict, blocking = None, False
        if self.rank == 0:
            assert info is not None
            verdict = self.book.record_start(info, resumed, restore_s, schedule=self.schedule, ranks=self.comm.size,
                                             run_record=self.run_record, config=self.config,
                                             survival=self.survival, parts=self._parts)
            blocking = verdict is None and self.stopper.agree_at_boundary(self.schedule, self.log, warn=True)
        verdict, self._blocking, self.log.attempt = self.comm.bcast((verdict, blocking, self.log.attempt))
        self.progress.begin(self.log.attempt, self.step)
        self.survival.boundary(self.step)
        if verdict is not None:
            self.mgr.close()
            raise self.book.give_up(verdict)
        self._recheck_at = self.step + 3           # once the first steps of this attempt are timed
        self._pin_ahead = self.async_save and _cuda_available()   # once, at this attempt's first boundary
        # From now on no collective of ours (the store's included) waits for ever on a dead peer
        # (coci_hpc.comm); an MPI-IO call that cannot be polled is guarded by PeerLoss.stuck.
        notice = self.sync.notice
        self._watch.enter_context(self.comm.watch(self.sync.deadline_s, lambda what: self.peer_loss.stuck(
            self.step, what), notice.posted if notice is not None else None))
        if self._nccl is not None:         # under NCCL: notices a lost peer while the main thread waits on the device
            self._watch.enter_context(self._nccl.running(lambda how, t: self.peer_loss.handle(self.step, how, t)))
        if self.rank == 0 and notice is not None:
            notice.mark_training()       # the relaunch loop's grace for a survivors' save applies
        if not self._blocking:
            # The first boundary's agreement is sent now (the pipeline is one step deep).
            self.sync.send(STOP if self.recorder.received else 0, self.schedule.decide(self.step + 1), False)
        return self.step

    # -- the step boundary ---------------------------------------------------------------------------
    def _after_step(self, step: int, dt: float, total: int) -> None:
        if self._nccl is not None:
            self._nccl.boundary()           # back from the step; held here once the watcher declared a loss
        self.step = step
        self.progress.mark(step)            # a few bytes into the page cache: what a crash leaves
        self.history.poll(self.schedule)
        if self.rank == 0:
            self.losses.record(step, self._loss)
        self.schedule.observe(step, self._loss if self.rank == 0 else math.nan, dt)
        self.survival.boundary(step)
        self.comm.peer_deadline_s = self.sync.follow(dt)    # inside the loop's watch: follows the step time
        self._op_timeout.observe(self.sync.deadline_s)
        t_wait = time.time()
        try:
            if self._blocking:                      # this boundary's own agreement, completed at once
                self.sync.send(STOP if self.recorder.received else 0,
                               self.schedule.decide(step) if step < total else False, self._busy())
            # What every rank agreed on (at the previous boundary when pipelined: the one collective).
            level, save, busy = self.sync.receive()
        except PeerLost as exc:
            self.peer_loss.handle(step, f"the step agreement after step {step}: {exc.message}", t_wait)
        try:
            if self.mgr.persist_in_flight and not busy:
                self._settle()
            if level >= STOP and step < total:      # a stop at the very end is just the end (never returns)
                self.stopper.stop(step, comm=self.comm, mgr=self.mgr, schedule=self.schedule, log=self.log,
                                  losses=self.losses, settle=self._settle, wait_s=max(60.0, self.sync.deadline_s),
                                  save=lambda st: self._save(st, kind=CheckpointKind.STOP))
            if save and step < total:               # the last step gets the final save instead
                self._save(step)
                self._recheck_at = step
            elif self._pin_ahead and step < total and not self.mgr.persist_in_flight:
                # Every rank at the same boundary, the optimizer's moments made by now: page-lock the
                # two-phase save's host buffers in the background, so its first save does not stall
                # for that (issue 32). The same on every rank (a GPU job is CUDA everywhere; persist_in_flight
                # ends on every rank at the same call).
                self._pin_ahead = False
                self.mgr.prepare_async(self._state)
            if step == self._recheck_at and step < total:
                self._blocking = bool(self.comm.bcast(  # the lead is short: agree at the boundary itself
                    self.stopper.agree_at_boundary(self.schedule, self.log, warn=False) if self.rank == 0 else None))
        except PeerLost as exc:
            # A peer vanished while a checkpoint's collectives were in flight: the survivors save
            # this boundary's state (the step that save was writing); the torn save never commits.
            self.peer_loss.collective_lost(step, exc)
        if not self._blocking:
            self.sync.send(STOP if self.recorder.received else 0,
                           self.schedule.decide(step + 1) if step + 1 < total else False, self._busy())

    def _busy(self) -> bool:
        return self.mgr.persist_in_flight and not self.mgr.persist_done

    def _save(self, step: int, kind: CheckpointKind = CheckpointKind.PLANNED) -> None:
        self._settle()
        t0 = time.perf_counter()
        two_phase = self.async_save and kind == CheckpointKind.PLANNED
        (self.mgr.save_async if two_phase else self.mgr.save)(step, self._state)
        blocking = time.perf_counter() - t0
        if two_phase:
            self._pending_ckpt = (step, blocking)
        else:
            self.losses.flush()
            self.log.write(Checkpoint(step=step, kind=kind, blocking_s=blocking, persist_s=None))
        self.schedule.saved(step, blocking)

    def _settle(self) -> None:
        """The one way an in-flight two-phase save ends: wait for its commit, then record it."""
        if not self.mgr.persist_in_flight and self._pending_ckpt is None:
            return
        # A rank whose background write is done waits in the commit's first collective for the
        # slowest rank's write: that is not a lost peer, so the deadline grows by twice the
        # writes measured so far (0 before the first).
        base = self.comm.peer_deadline_s
        grown = base + 2.0 * self.schedule.costs().persist_s if base is not None and self.mgr.persist_in_flight \
            else base
        with self.comm.deadline(grown):
            self.mgr.wait()
        if self._pending_ckpt is None:
            return
        (step, blocking), self._pending_ckpt = self._pending_ckpt, None
        persist = self.mgr.async_stats.get("persist_s")
        self.schedule.persisted(persist)
        self.losses.flush()
        self.log.write(Checkpoint(step=step, kind=CheckpointKind.PLANNED, blocking_s=blocking, persist_s=persist))

    def _finish(self, total: int) -> None:
        t_wait = time.time()
        try:
            self.sync.receive()            # complete the last boundary's allreduce on every rank
        except PeerLost:
            self.peer_loss.handle(total, f"the last step agreement timed out ({self.sync.deadline_s:.1f}s)", t_wait)
        try:
            self._settle()
            if self.mgr.latest_step() != total:
                self._save(total, kind=CheckpointKind.FINAL)
            self.losses.flush()
            self.mgr.close()
        except PeerLost as exc:
            self.peer_loss.collective_lost(total, exc)
        self._watch.close()                # the comm's deadline, stuck handler and notice as before
        self.log.write(End(step=total, status=EndStatus.COMPLETED, message=""))


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
