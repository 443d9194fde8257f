"""The session's one collective per step: stop level, checkpoint decision and persist state in one
non-blocking MAX-allreduce of three numbers, into buffers allocated once.

- ``stop``: the stop level this rank's signals ask for (0 none, 1 leave, 2 stop-save-requeue; the
  MAX means any rank's signal stops every rank at the same step);
- ``save``: rank 0's planner decision for the NEXT step (other ranks send 0);
- ``busy``: this rank's background persist is still writing (the commit waits for the slowest).

Folding them replaces the guard's allreduce, the schedule's broadcast and the two-phase saver's
``poll`` with one small collective. It is pipelined: the allreduce started at one step boundary is
completed at the next, so no rank waits for the others' latency inside the step (a blocking
allreduce cost ~150 us per step with 2 ranks on this machine, the pipelined one ~the cost of
MPI progress). Every rank sees the same results at the same boundary, one step after they were
sent: a signal stops the loop one step later than a blocking allreduce would, and the planner
decides one step ahead (``save`` is "save after the next step"). At a boundary the session first
:meth:`receive` (and acts: commit, stop, save), then :meth:`send` the values for the next one,
so what it sends already reflects a save it just started.

It is also the session's failure detector: a peer that vanished (SIGKILL, its node gone) never
joins the allreduce, and under ``srun --mpi=pmix`` nothing else tells the survivors (Open MPI does
not abort them; verified, ../shared/slurm-on-one-machine.md). So completion is polled against a
deadline, ``deadline_s`` (the session sets max(10 x the typical step, ``min_deadline_s``)), and a
miss raises :class:`~coci_hpc.errors.PeerLost` instead of blocking forever. Under coci-submit's
relaunch loop the wait also looks for the loop's notice (:mod:`.peernotice`: srun saw a task of
this step end), which raises the same at once: a crash is detected in well under a second instead
of the deadline's 5 s, and a slow but live peer (no notice) still gets the whole deadline.

Slurm ending the step shortens the wait too (``ending``: when this rank got SIGTERM). A job that
lost nodes without spare nodes is cancelled by Slurm (NODE_FAIL): SIGTERM now, SIGKILL KillWait
later (5 s on the local cluster, 30 s by default), no sooner than the deadline would expire. A lone
survivor that waited out the whole deadline was killed before it could record that the disk tier
serves (issue 25). So once SIGTERM has come and a peer has been silent for ``ENDING_GRACE_STEPS``
typical steps (at least ``ENDING_GRACE_MIN_S``) since, the peer counts as lost. Live peers of a
SIGTERM-only preemption get the same signal and reach the boundary within a step, so they answer.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from coci_hpc import settings
from coci_hpc.comm import Comm, poll_until_done
from coci_hpc.errors import PeerLost
from coci_hpc.runtime.peernotice import PeerNotice

MIN_DEADLINE_S = settings.PEER_TIMEOUT_S  # what a peer gets to reach the boundary before it counts as lost
DEADLINE_STEPS = settings.PEER_TIMEOUT_STEPS  # ... and at least this many typical steps
ENDING_GRACE_MIN_S = 1.0  # after SIGTERM: what a silent peer still gets, at least ...
ENDING_GRACE_STEPS = 3.0  # ... and this many typical steps


class StepSync:
    def __init__(self, comm: Comm, deadline_s: float = MIN_DEADLINE_S, notice: PeerNotice | None = None,
                 ending: Callable[[], float | None] | None = None) -> None:
        self.comm = comm
        self.ending = ending       # time.monotonic() of this rank's SIGTERM, None before it
        self.deadline_s = float(deadline_s)
        self.min_deadline_s = float(deadline_s)
        self._dt_ema = 0.0
        self.notice = notice
        # Two send/receive pairs: one is in flight while the other is being filled.
        self._send = np.zeros((2, 3), dtype=np.float64)
        self._recv = np.zeros((2, 3), dtype=np.float64)
        self._slot = 0
        self._pending: Any = None
        self._have_prev = False
        self._mpi_max: Any = None
        self.lost = False          # a deadline was missed: no collective on this comm any more
        self.lost_why = ""         # how the loss was seen (PeerLost's message)
        if comm.mpi_comm is not None:
            from mpi4py import MPI

            self._mpi_max = MPI.MAX

    def follow(self, dt: float) -> float:
        """After a step of ``dt`` seconds: the deadline becomes max(``DEADLINE_STEPS`` typical steps,
        the least one)."""
        self._dt_ema = dt if self._dt_ema == 0.0 else 0.9 * self._dt_ema + 0.1 * dt
        self.deadline_s = max(self.min_deadline_s, DEADLINE_STEPS * self._dt_ema)
        return self.deadline_s

    def _start(self, send: np.ndarray, recv: np.ndarray) -> Any:
        start = getattr(self.comm, "iallreduce_max_array", None)
        if start is not None:          # a Comm subclass with its own backend (torch.distributed)
            return start(send, recv)
        if self.comm.mpi_comm is not None:
            return self.comm.mpi_comm.Iallreduce(send, recv, op=self._mpi_max)
        recv[:] = send
        return None

    def receive(self) -> tuple[int, bool, bool]:
        """Complete the allreduce sent at the previous boundary and return its agreed values
        (zeros when none was sent). Collective, like :meth:`send`."""
        if not self._have_prev:
            return 0, False, False
        self._wait()
        self._have_prev = False
        r = self._recv[self._slot ^ 1]
        return int(r[0]), bool(r[1] > 0), bool(r[2] > 0)

    def send(self, stop: int, save_next: bool, busy: bool) -> None:
        """Start this boundary's allreduce; the next boundary's :meth:`receive` completes it."""
        self._wait()
        send, recv = self._send[self._slot], self._recv[self._slot]
        send[0], send[1], send[2] = stop, save_next, busy
        self._pending = self._start(send, recv)
        self._have_prev = True
        self._slot ^= 1

    def probe(self, deadline_s: float | None = None) -> bool:
        """Are all peers still there? Completes what is in flight, then one more round, each
        against the deadline. True: everyone answered; False: some peer did not (``lost``)."""
        if self.comm.size == 1:
            return True
        try:
            self._wait(deadline_s)
            self._have_prev = False
            self._pending = self._start(self._send[self._slot], self._recv[self._slot])
            self._wait(deadline_s)
            return True
        except PeerLost as exc:
            self.lost_why = exc.message
            return False

    def ending_grace_s(self) -> float:
        """How long a silent peer may keep this rank waiting once Slurm is ending the step."""
        return min(self.deadline_s, max(ENDING_GRACE_MIN_S, ENDING_GRACE_STEPS * self._dt_ema))

    def early_exits(self, t0: float) -> Callable[[float], str | None] | None:
        """The early exits of one wait begun at ``t0``: the relaunch loop's notice, and SIGTERM (also the
        NCCL watcher's, runtime/ncclwatch.py)."""
        posted = self.notice.posted if self.notice is not None else None
        ending = self.ending
        if ending is None and posted is None:
            return None
        grace = self.ending_grace_s()

        def check(now: float) -> str | None:
            why = posted(now) if posted is not None else None
            if why is not None:
                return f"the relaunch loop saw it end: {why}"
            t_term = ending() if ending is not None else None
            if t_term is not None and now - max(t_term, t0) > grace:
                return (f"Slurm is ending this step (SIGTERM {now - t_term:.1f}s ago) and a peer has not "
                        f"answered for {now - max(t_term, t0):.1f}s")
            return None
        return check

    def _wait(self, deadline_s: float | None = None) -> None:
        req = self._pending
        if req is None:
            return
        if self.lost:
            raise PeerLost("a peer was already lost: no collective can complete")
        test = getattr(req, "Test", None) or getattr(req, "is_completed", None)
        if test is None:              # a handle that cannot be polled: wait as before
            req.wait()
            self._pending = None
            return
        if not test():        # usually done by the boundary: set up the polled wait only when it is not
            try:
                poll_until_done(
                    test, self.deadline_s if deadline_s is None else deadline_s,
                    self.early_exits(time.monotonic()),
                    lambda limit: (f"the step agreement did not complete within {limit:.1f}s: a peer rank "
                                   f"is gone (crashed, killed, or its node failed)"),
                    lambda waited, why: (f"a peer rank is gone after {waited:.2f}s of waiting for the step "
                                         f"agreement ({why})"))
            except PeerLost:
                self.lost = True      # the allreduce in flight can never complete
                raise
        if hasattr(req, "Wait"):
            req.Wait()            # completed: frees the MPI request
        else:
            req.wait()
        self._pending = None
