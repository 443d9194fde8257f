"""What a rank does when a peer rank is gone (the step agreement's deadline missed, a checkpoint
collective that never completes, an MPI-IO call stuck): save from the survivors
(:mod:`coci_hpc.runtime.survivors`), record it, requeue the job (Slurm requeues a NODE_FAIL by
itself; a crashed rank on a healthy node needs us) and leave the process at once, with no MPI
collective or finalize that would wait for the dead rank. Under NCCL (``host_only``,
:mod:`.ncclwatch`) it first aborts the process groups and saves from host copies only."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from coci_hpc import settings
from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint.catalog import StepCatalog
from coci_hpc.comm import Comm
from coci_hpc.errors import PeerLost, SlurmError
from coci_hpc.runtime import events as ev
from coci_hpc.runtime import memtier, ncclwatch
from coci_hpc.runtime import survivors as sv
from coci_hpc.runtime.attemptbook import AttemptBook
from coci_hpc.runtime.events import EventLog, SavedFrom, Tier
from coci_hpc.runtime.losses import LossBuffer
from coci_hpc.runtime.peernotice import PeerNotice
from coci_hpc.runtime.preemption import requeue_with_retries
from coci_hpc.runtime.stepsync import MIN_DEADLINE_S, StepSync
from coci_hpc.slurm import commands
from coci_hpc.slurm.env import JobEnvironment

NO_HOST_COPY = ("no host copy of the state to save from: the memory tier is off (COCI_MEMTIER_K=0, too little host "
                "memory, or survivors' saves off), and under NCCL the survivors never read device memory after a lost "
                "peer (the stream may have run part of the next step); the run falls back to its last disk checkpoint")

# Open MPI prints its own alarming warning in the survivors' logs once a peer is gone, around coci's
# peer-lost line: say beside it that it is expected, so nobody chases it (issue 26).
PEER_LOST_MPI_NOTE = ("Open MPI may now warn that it \"failed to TCP connect to a peer MPI process\" and that the job "
                      "\"may now hang or fail\": expected after a lost peer; the survivors save and leave")


def _say(msg: str) -> None:
    print(f"coci: {msg}", file=sys.stderr, flush=True)


ENV_INPLACE = settings.INPLACE_RESTARTS.name   # set by runtime/relaunch.py for the rank steps it starts


def peer_settings(environ: Mapping[str, str] | None, peer_timeout_s: float | None,
                  survivors: bool | None) -> tuple[int | None, float, bool]:
    """(the relaunch loop's in-place restart number, None outside it; the least time a peer may
    keep the step agreement waiting before it counts as lost, at least this and 10 typical steps;
    whether the survivors save on a peer loss, ``COCI_SURVIVORS=0``: off). Arguments win."""
    env = os.environ if environ is None else environ
    # coci-submit's relaunch loop (--spare-nodes) numbers its in-place restarts of the ranks (0: its first launch).
    in_place = int(env[ENV_INPLACE]) if env.get(ENV_INPLACE, "").isdigit() else None
    least = float(peer_timeout_s if peer_timeout_s is not None else settings.PEER_TIMEOUT.raw(env) or MIN_DEADLINE_S)
    return in_place, least, survivors if survivors is not None else settings.SURVIVORS.raw(env) != "0"


def leave_after_peer_loss(in_place: bool) -> NoReturn:
    """End this process now: no MPI finalize or collective that would wait for the lost rank.
    Under the relaunch loop a non-zero status is what makes it restart the ranks in place."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1 if in_place else 0)


def mf_latest(catalog: StepCatalog) -> int | None:
    """The newest committed step, read by this rank alone (``mgr.latest_step()`` is a collective)
    from the manager's catalog listed afresh (rank 0 wrote the steps, maybe not this rank)."""
    catalog.refresh()
    return catalog.latest()


@dataclass(frozen=True)
class SessionParts:
    """What the peer-loss path uses of its Session. ``state`` is the checkpointed state (the
    session's own entry under ``session_key`` included); ``local_session_state`` gives that entry
    from this rank's own view (no collective: rank 0 may be the lost one); ``parts``: the leaves
    held in parts across ranks (:func:`.survivors.held_in_parts`); ``in_place``: the relaunch
    loop's restart number, None outside it."""

    comm: Comm
    mgr: CheckpointManager
    state: Mapping[str, Any]
    session_key: str
    local_session_state: Callable[[], Any]
    parts: list[str]
    root: Path
    log: EventLog
    book: AttemptBook
    losses: LossBuffer
    job: JobEnvironment
    runner: commands.Runner
    notice: PeerNotice | None
    in_place: int | None


class PeerLoss:
    """The Session's peer-loss path, with what it saves from: the survivors' boundary snapshot and
    partner copy (``survival``) and, for state held in parts, the memory tier (``survival.memtier``);
    :meth:`for_session` builds the three together."""

    def __init__(self, s: SessionParts, survival: sv.Survival, host_only: bool = False) -> None:
        self.comm, self.mgr, self.survival, self._state = s.comm, s.mgr, survival, s.state
        self._key, self._local_session_state, self._parts, self.root = (s.session_key, s.local_session_state,
                                                                        s.parts, s.root)
        self.log, self.book, self.losses, self.job, self._runner = s.log, s.book, s.losses, s.job, s.runner
        self.notice, self._in_place = s.notice, s.in_place
        self.rank = s.comm.rank
        self._lost_lock = threading.Lock()  # one survivors' save per process (main thread or guard timer)
        # Under NCCL (runtime/ncclwatch.py): abort the process groups first, and save from host copies only.
        self.host_only = host_only

    @classmethod
    def for_session(cls, s: SessionParts, *, enabled: bool, environ: Mapping[str, str] | None,
                    say: Callable[[str], None], plan_fn: Callable[[list[float]], tuple[int | None, int] | None],
                    skip: frozenset[str] = frozenset(), host_only: bool = False) -> PeerLoss:
        """Collective, at ``Session()``: the survivors' snapshot and partner copy (on when
        ``enabled``, MPI and 2+ ranks), the memory tier when state is held in parts
        (:func:`.memtier.for_session`, its interval from ``plan_fn`` unless ``COCI_MEMTIER_K`` fixes
        it) and the peer-loss path that saves from them. ``skip``: state entries the snapshot leaves out.
        ``host_only`` (under NCCL, :mod:`.ncclwatch`): the memory tier for every state, and a lost
        peer aborts the process groups and saves from its host copies only."""
        survival = sv.Survival(s.state, s.comm, ranks_per_node=s.job.ranks_per_node, enabled=enabled, skip=skip)
        loss = cls(s, survival, host_only=host_only)
        survival.memtier = memtier.for_session(loss.local_state, s.comm, s.job.ranks_per_node, s.parts,
                                               survival.enabled, environ, say, plan_fn, host_copies=host_only)
        return loss

    def local_state(self) -> dict[str, Any]:
        """The checkpointed state with the session's entry from this rank's own view (no collective)."""
        return {**self._state, self._key: self._local_session_state()}

    def after_exception(self, step: int, sync: StepSync) -> None:
        """The loop body left early: a peer failure surfaces inside the user's step (e.g. gloo's
        "Connection reset by peer" in loss.backward()), and a generator cannot see that exception,
        so ask the peers: a lost one does not answer (then this never returns)."""
        t_fail = time.time()       # when the failure surfaced here, before the probe's deadline
        if self._lost_lock.locked():
            # Another thread declared the loss (the NCCL watcher: its abort is what ended this step
            # with an exception): wait here for its save to end the process.
            self.handle(step, "an exception inside the step after the peer-loss path began", t_fail)
        if self.comm.size > 1 and not sync.probe(sync.deadline_s):
            self.handle(step, f"an exception inside the step, then: {sync.lost_why}", t_fail)

    def stuck(self, step: int, what: str) -> NoReturn:
        """The guard timer (coci_hpc.comm.Comm.guard): the main thread is inside an MPI-IO call
        that a lost peer never joins. Save from the survivors from here; never returns."""
        waited = self.comm.peer_deadline_s or 0.0
        self.handle(step, f"a checkpoint write after step {step} is stuck: {what}", time.time() - waited)

    def collective_lost(self, step: int, exc: PeerLost) -> NoReturn:
        waited = self.comm.peer_deadline_s or 0.0
        self.handle(step, f"a checkpoint collective after step {step} did not complete: {exc.message}",
                    time.time() - waited)

    def handle(self, step: int, how: str, t_fail: float) -> NoReturn:
        """A peer rank is gone: save from the survivors, record it, requeue, leave. Never returns."""
        in_place = self._in_place is not None
        # The main thread (a deadline missed) and the guard timer (an MPI-IO call stuck) may both
        # get here: the first one saves and ends the process, the second waits for that end.
        self._lost_lock.acquire()
        self.comm.lost = True
        aborted = self._abort() if self.host_only else None
        newer = self.book.newer_attempt()
        if newer is not None:
            # A process left over from an attempt Slurm has already replaced: its host stopped
            # (a hung kernel, a paused VM) past SlurmdTimeout, the job was requeued and started
            # elsewhere, and the host ran again before slurmd killed what it had left. Saving,
            # recording or `scontrol requeue` now would act on the live run: requeue it, log a
            # failure it did not have. Leave as quietly as a killed process.
            _say(f"rank {self.rank}: peer lost at step {step} ({how}), but attempt {newer} of this run has "
                 f"started since this attempt ({self.log.attempt}) began: this process was left behind and "
                 f"leaves without saving, recording or requeueing")
            leave_after_peer_loss(in_place)
        ahead, mine = mf_latest(self.mgr.catalog), self.survival.snapshot.step
        if ahead is not None and ahead > mine:
            # A checkpoint newer than the last step this rank finished committed while it was gone:
            # the others went on and saved without it (its host froze, the survivors saved, Slurm
            # is cancelling the attempt and its SIGCONT woke this process). It is the lost rank:
            # recording a loss of its own would blame the survivors in the next attempt's line.
            _say(f"rank {self.rank}: peer lost at step {step} ({how}), but step {ahead} was committed after "
                 f"this rank's last step ({mine}): this rank was the one left behind "
                 f"and leaves without saving, recording or requeueing")
            leave_after_peer_loss(in_place)
        try:
            t_detect = time.time()
            # A background persist of a regular save may still be writing (its step directory is
            # replaced below when it is the same step): let it finish first, locally, bounded.
            self.mgr.quiesce(timeout_s=5.0)
            _say(f"rank {self.rank}: peer lost at step {step}: {how}. {PEER_LOST_MPI_NOTE}")
            if aborted is not None:
                _say(f"rank {self.rank}: NCCL: {aborted.describe()}; the survivors save from host copies only")
                how = f"{how}; {aborted.describe()}"
            sv_ = self.survival
            boundary = sv_.snapshot.step
            root = self.root
            out: sv.Outcome | memtier.TierOutcome | None = None
            reason = ""
            if not sv_.enabled:
                reason = sv_.why_not
            elif self.host_only:
                # Under NCCL the device memory may hold a half-finished step after the abort: the host
                # copies (the memory tier's) are all there is to save from.
                reason = "" if sv_.memtier is not None else NO_HOST_COPY
            elif sv_.opt_steps != sv_.snapshot.opt_steps:
                reason = f"this rank's optimizer had already stepped past step {boundary} when the failure surfaced"
            elif sv_.own_for(boundary) is None:
                reason = f"this rank holds no copy of its own per-rank state for step {boundary}"
            if sv_.memtier is not None and sv_.enabled:
                # State held in parts: the memory tier's newest whole step, else the disk tier.
                out = memtier.survivors_save(root, boundary, sv_.memtier, self.mgr.local_tuning(), self.mgr.keep,
                                             window_s=3.0, catalog=self.mgr.catalog)
            elif not reason:
                own_copy = sv_.own_for(boundary)
                assert sv_.partner is not None and own_copy is not None
                copy = sv_.partner.copy_for(boundary)       # decoded only now, off the per-step path
                own = own_copy.state()
                sv_.snapshot.rollback(self._state)
                sv.restore_own_rng(own)
                tuning = self.mgr.local_tuning()
                # Within Slurm's kill window: KillWait (5 s here, 30 s by default) after the node is DOWN.
                # The planner's state_dict() broadcasts rank 0's view: take this survivor's own instead.
                out = sv.save(root, boundary, self.local_state(), self.rank, self.comm.size, own,
                              [copy] if copy is not None else [], tuning, self.mgr.keep, window_s=3.0,
                              parts=self._parts, catalog=self.mgr.catalog)
            else:
                out = sv.Outcome(boundary, writer=sv.claim(root, boundary), reason=reason)
            if out.writer:
                latest = mf_latest(self.mgr.catalog)       # not mgr.latest_step(): that is a collective
                log = self.log if self.rank == 0 else EventLog(self.log.path, attempt=self.log.attempt,
                                                               job_id=self.job.job_id, enabled=True)
                if self.rank == 0:
                    self.losses.flush()
                # Which tier served: "survivors" (the last step), "memory" (the memory tier's), "disk".
                tier = Tier(getattr(out, "tier", Tier.SURVIVORS if out.committed else Tier.DISK))
                # What the survivors wrote from (a committed outcome with a reason: the regular save had committed).
                saved_from = (None if not out.committed or out.reason else
                              SavedFrom.HOST if isinstance(out, memtier.TierOutcome) else SavedFrom.LIVE)
                step_of = out.step if isinstance(out, memtier.TierOutcome) and out.step is not None else boundary
                log.write(ev.PeerLost(step=step_of, tier=tier, how=how, survivor=self.rank, committed=out.committed,
                                   lost_ranks=out.ranks_from_partner, lost=out.lost or None, reason=out.reason,
                                   failure_wall=t_fail, detect_wall=t_detect,
                                   commit_wall=time.time() if out.committed else None,
                                   save_s=out.write_s, fallback_step=None if out.committed else latest,
                                   saved_from=saved_from))
                if in_place and self.notice is not None:
                    self.notice.mark_left()    # the loop may end a silent peer's task now
                if out.committed:
                    src = {SavedFrom.HOST: ", saved from host copies", SavedFrom.LIVE: ", saved from the survivors' state",
                           None: ""}[saved_from]
                    _say(f"survivors' checkpoint of step {step_of} ({tier} tier) committed {time.time() - t_fail:.1f}s after "
                         f"the failure (ranks {out.ranks_from_partner} from their partners' copies){src}")
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
        leave_after_peer_loss(in_place)

    def _abort(self) -> ncclwatch.Abort:
        """Under NCCL, before anything else: no device copy started from now on becomes a host copy
        (the memory tier is frozen), then every process group is aborted, so that the main thread's
        wait on the hung collective ends and NCCL's watchdog has nothing left to time out."""
        if self.survival.memtier is not None:
            self.survival.memtier.frozen = True
        return ncclwatch.abort_groups()
