"""The planner inside the training loop: it measures costs, feeds losses and decides WHEN to save.

The planner itself (:mod:`coci_hpc.planner`) is pure: numbers in, a plan out. This class gives it
the numbers the runtime alone can measure, and turns its plan into a save/no-save decision that is
the same on every rank:

- Ts (checkpoint cost) is measured by taking one checkpoint early, after ``warmup_steps`` steps,
  as the COCI paper does; the plan is (re)made from that measurement. That checkpoint's own state
  cannot hold its cost (it is written before the cost is known), so a job resumed from it
  measures Ts again; from the second checkpoint on, measured costs travel in the state.
- Tr (restart cost) is measured across a requeue: the wall time from the stop-save (written into
  this object's saved state) to the moment training resumes, which covers requeue latency, job
  start and restore. A crash is not a stop-save, so its lost work is not mistaken for Tr.
  Under coci-submit's relaunch loop (``--spare-nodes``, ``in_place=True``) a failure is restarted
  inside the allocation instead: once such a restart was measured (failure -> first resumed step,
  :meth:`restarted_in_place`), Tr is that, not the queue's, which the job then rarely pays.
- Time is training time with checkpoint stalls excluded (the planner's axis), summed from step
  times, and saved, so a resumed job continues the same time axis.
- Losses reach the planner as one mean per ``observe_every_s`` of training time, not per step: a
  refit (every 50 observations) costs ~0.1 s on the training thread, so per-step feeding would
  cost 0.1 s per 50 steps; this way it is at most ~0.2 % of training time.
- Only rank 0 runs the planner (ranks see different local losses and clocks); its decision is
  broadcast, because a save is collective and ranks that disagreed would deadlock.

It is a stateful object (``state_dict``/``load_state_dict``), so put it in the checkpointed state::

    sched = CheckpointSchedule("young", failures.from_mtbf(70 * 3600), nodes=8, horizon_s=86400)
    state = {"model": model, ..., "planner": sched}
    ...
    sched.observe(step, loss, step_seconds)
    if sched.due(step):
        t = time.perf_counter(); mgr.save(step, state); sched.saved(step, time.perf_counter() - t)
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from coci_hpc.comm import Comm
from coci_hpc.errors import UsageError
from coci_hpc.planner.costs import DEFAULT_RESTART_S, Costs
from coci_hpc.planner.failures import FailureModel
from coci_hpc.planner.online import OnlinePlanner
from coci_hpc.planner.policies import Fixed, make_policy

# Before any restart was seen, Tr is the planner's one default; replaced by the measured value
# after the first requeue.
ASSUMED_RESTART_S = DEFAULT_RESTART_S

# the memory tier's planner: the copies' measured stalls -> (memory every k, disk every D) steps
TwoTierPlanFn = Callable[[list[float]], "tuple[int | None, int] | None"]


class _Measured:
    """What every schedule measures in the loop (step time, save time, persist time, restart time)
    and carries in its checkpointed state; subclasses only decide which step to save after."""

    def __init__(self, policy: str, comm: Comm | None, observe_every_s: float = 1.0,
                 in_place: bool = False) -> None:
        self.comm = Comm.wrap(comm)
        self.policy = policy
        self.in_place = bool(in_place)          # failures restart in place (spare nodes)
        self.inplace_restart_costs: list[float] = []
        self.train_time_s = 0.0
        self.step_times: list[float] = []
        self.ckpt_costs: list[float] = []
        self.restart_costs: list[float] = []
        self.persist_costs: list[float] = []
        self.last_saved_step = 0
        self.last_saved_time_s = 0.0
        self.observe_every_s = float(observe_every_s)
        self._stop_wall: float | None = None   # set in the state of a stop-save only
        self.survivor_coverage = 0.0           # share of failures a survivors' save covers (rank 0)
        # rank 0: the two-tier plan's disk interval in steps while a memory tier holds the
        # recent steps (None: the schedule's own plan); set from the planner's thread, read here
        self.two_tier_disk_every: int | None = None

    # -- the loop's calls --------------------------------------------------------------------------
    def observe(self, step: int, loss: float, step_seconds: float) -> None:
        self.train_time_s += step_seconds
        self.step_times.append(step_seconds)
        del self.step_times[:-200]  # a recent median is what converts plan times to steps

    def due(self, step: int) -> bool:
        """Collective: whether to checkpoint after ``step`` (rank 0 decides, everyone follows).

        Args:
            step: The step just finished.
        """
        return bool(self.comm.bcast(self.decide(step) if self.comm.rank == 0 else None))

    def decide(self, step: int) -> bool:
        raise NotImplementedError

    def persisted(self, seconds: float | None) -> None:
        """Record the background persist latency of a two-phase save (rank 0's view)."""
        if seconds is not None and math.isfinite(seconds):
            self.persist_costs.append(float(seconds))
            del self.persist_costs[:-20]

    def saved(self, step: int, seconds: float) -> None:
        """Collective: record a finished save and its blocking time (the slowest rank's).

        Args:
            step: The step saved.
            seconds: How long the save blocked training on this rank.
        """
        self.last_saved_step, self.last_saved_time_s = step, self.train_time_s
        self.ckpt_costs.append(float(self.comm.allreduce_max(seconds)))
        self._replan()

    def stopping(self) -> None:
        """Call right before the stop-save (preemption or time limit): Tr is measured from here."""
        self._stop_wall = time.time()

    def after_failure(self, seconds_since_failure: float) -> None:
        """This attempt restarted after an unannounced failure that long ago (planner schedules use it)."""

    def restarted_in_place(self, seconds: float) -> None:
        """Rank 0: this attempt was restarted in place that long after the failure (failure -> first
        resumed step, measured by the Session); the plan is remade with it as Tr."""
        if self.comm.rank != 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self.inplace_restart_costs.append(float(seconds))
        del self.inplace_restart_costs[:-20]
        if self.ckpt_costs:
            self._replan()

    def use_two_tier(self, plan: tuple[int | None, int] | None) -> None:
        """Rank 0: the two-tier plan ``(memory every k steps, disk every D steps)``
        (:mod:`coci_hpc.planner.two_tier`). While it keeps a memory tier, a planner schedule saves
        to disk every D steps instead of at its own single-tier plan (which counts every failure
        as a rollback to disk; with the memory tier on, only one that takes a rank and its partner
        is). ``None``, or a plan that dropped the memory tier: back to the schedule's own plan. A
        ``fixed:N`` schedule keeps N (the user's choice wins)."""
        if self.comm.rank != 0:
            return
        if plan is None or plan[0] is None:
            self.two_tier_disk_every = None
            return
        if int(plan[1]) < 1:
            raise UsageError(f"a disk interval must be >= 1 step, got {plan[1]!r}")
        self.two_tier_disk_every = int(plan[1])

    def following(self, plan_fn: TwoTierPlanFn) -> TwoTierPlanFn:
        """``plan_fn`` (the memory tier's two-tier planner, ``runtime.memtier.plan_with``) with its
        every result also handed to :meth:`use_two_tier`: the disk interval the plan prints is the
        one this schedule keeps."""
        def fn(copy_s: list[float]) -> tuple[int | None, int] | None:
            out = plan_fn(copy_s)
            self.use_two_tier(out)
            return out
        return fn

    def restart_cost_s(self) -> float:
        """Tr for the plan: the measured in-place restart when failures restart in place and one was
        measured, else the measured requeue (stop-save -> resumed), else the planner's default."""
        if self.in_place and self.inplace_restart_costs:
            return statistics.median(self.inplace_restart_costs)
        return statistics.median(self.restart_costs) if self.restart_costs else ASSUMED_RESTART_S

    def use_survivor_coverage(self, coverage: float) -> None:
        """Rank 0: the share of failures that lose ~one step (survivors' saves) instead of the work
        since the last checkpoint (:func:`coci_hpc.runtime.survivors.coverage_estimate`)."""
        self.survivor_coverage = min(1.0, max(0.0, float(coverage)))

    def resumed(self, step: int) -> float | None:
        """Collective; call once state is restored from the checkpoint of ``step``.

        Args:
            step: The step of the checkpoint restored.

        Returns:
            The measured restart cost when that checkpoint was a stop-save, else None.
        """
        # The saved state was captured before saved() ran for that very checkpoint.
        self.last_saved_step, self.last_saved_time_s = int(step), self.train_time_s
        tr = None
        if self._stop_wall is not None:
            tr = float(self.comm.allreduce_max(max(0.0, time.time() - self._stop_wall)))
            self.restart_costs.append(tr)
            self._stop_wall = None
        if self.ckpt_costs:
            self._replan()
        return tr

    def _replan(self) -> None:
        pass

    def costs(self) -> Costs:
        ts = statistics.median(self.ckpt_costs) if self.ckpt_costs else 0.0
        tr = self.restart_cost_s()
        st = statistics.median(self.step_times) if self.step_times else None
        persist = statistics.median(self.persist_costs) if self.persist_costs else 0.0
        return Costs(max(ts, 1e-3), tr, st, persist_s=persist)

    @property
    def measured(self) -> bool:
        """Whether a save has been timed (before that, :meth:`costs` holds placeholders)."""
        return bool(self.ckpt_costs)

    def save_s(self) -> float | None:
        """A save's measured length (snapshot + background write); None before one was timed."""
        if not self.measured:
            return None
        c = self.costs()
        return c.ckpt_s + c.persist_s

    def next_step(self) -> int | None:
        return None

    # -- checkpointed state (JSON only; identical on every rank: rank 0's) ---------------------------
    def _own_state(self) -> dict[str, Any]:
        return {"version": 1, "policy": self.policy, "train_time_s": self.train_time_s,
                "step_times": list(self.step_times), "ckpt_costs": list(self.ckpt_costs),
                "restart_costs": list(self.restart_costs), "persist_costs": list(self.persist_costs),
                "inplace_restart_costs": list(self.inplace_restart_costs),
                "last_saved_step": self.last_saved_step,
                "last_saved_time_s": self.last_saved_time_s,
                "stop_wall": self._stop_wall, "planner": None}

    def state_dict(self) -> dict[str, Any]:
        return self.comm.bcast(self._own_state())

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own view, with no collective (a survivors' save, where rank 0 may be gone)."""
        return self._own_state()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("version") != 1:
            raise UsageError(f"unknown checkpoint-schedule state version {d.get('version')!r}",
                             hint="resume with the coci_hpc version that wrote the checkpoint")
        self.policy = d["policy"]
        self.train_time_s = float(d["train_time_s"])
        self.step_times = [float(x) for x in d["step_times"]]
        self.ckpt_costs = [float(x) for x in d["ckpt_costs"]]
        self.restart_costs = [float(x) for x in d["restart_costs"]]
        self.persist_costs = [float(x) for x in d.get("persist_costs", [])]
        self.inplace_restart_costs = [float(x) for x in d.get("inplace_restart_costs", [])]
        self.last_saved_step = int(d["last_saved_step"])
        self.last_saved_time_s = float(d.get("last_saved_time_s", self.train_time_s))
        self._stop_wall = None if d.get("stop_wall") is None else float(d["stop_wall"])


class FixedSchedule(_Measured):
    """``fixed:N``: a checkpoint every N steps, with the planner schedule's interface and
    measurements (so the session has one code path, and the signal-lead check has costs to use)."""

    def __init__(self, every: int, *, comm: Comm | None = None, in_place: bool = False) -> None:
        if every < 1:
            raise UsageError(f"fixed:{every}: the interval must be >= 1 step", hint="e.g. fixed:100")
        super().__init__(f"fixed:{every}", comm, in_place=in_place)
        self.every = int(every)

    def decide(self, step: int) -> bool:
        return self.comm.rank == 0 and step % self.every == 0


class CheckpointSchedule(_Measured):
    """The planner in a loop of your own: measures costs, takes losses, says when to save.

    Put it in the checkpointed state (it has ``state_dict``/``load_state_dict``), call
    :meth:`observe` every step, :meth:`due` to ask whether to save after a step, :meth:`saved`
    after each save and :meth:`resumed` after a restore. Only rank 0 plans; :meth:`due` broadcasts
    its decision. See the module docstring for how Ts and Tr are measured.

    Args:
        policy: The planner's policy: ``coci`` (default of the Session), ``young``, ``daly``,
            ``checkfreq[:P]``, ``coci-paper[:capped]`` (``fixed:N`` is ``FixedSchedule``). A bad
            spec raises ``UsageError`` on every rank.
        failure_model: The cluster's failure model, e.g.
            ``coci_hpc.planner.failures.from_mtbf(70 * 3600)`` or one learned from Slurm's
            accounting.
        nodes: Nodes the job runs on (failures of any of them interrupt it).
        horizon_s: Training time still to plan for, in seconds.
        comm: Communicator (default: MPI's world when launched by MPI, else one process).
        warmup_steps: Steps before the first checkpoint, which measures the save cost Ts.
        refit_every: Loss observations between refits of the convergence curve.
        observe_every_s: Training seconds over which losses are averaged into one observation.
        in_place: Failures restart in place (coci-submit ``--spare-nodes``): once measured, the
            in-place restart is the restart cost Tr instead of the queue's.
    """

    def __init__(self, policy: str, failure_model: FailureModel, nodes: int, horizon_s: float, *,
                 comm: Comm | None = None, warmup_steps: int = 20, refit_every: int = 50,
                 observe_every_s: float = 1.0, in_place: bool = False) -> None:
        make_policy(policy)  # fail now, on every rank, on a bad spec
        if warmup_steps < 1:
            raise UsageError(f"warmup_steps must be >= 1, got {warmup_steps}",
                             hint="the first checkpoint is taken after warmup_steps to measure Ts")
        super().__init__(policy, comm, observe_every_s, in_place=in_place)
        self.failure_model, self.nodes = failure_model, int(nodes)
        self.horizon_s, self.warmup_steps, self.refit_every = float(horizon_s), int(warmup_steps), refit_every
        self.planner: OnlinePlanner | None = None
        self._pending = (0.0, 0, -float("inf"))  # loss sum, count, train time of the last observation
        self._since_failure_s: float | None = None  # this attempt follows an unannounced failure

    # -- the loop's calls --------------------------------------------------------------------------
    def observe(self, step: int, loss: float, step_seconds: float) -> None:
        """Every step: the step's loss and wall time (rank 0's feed the planner).

        Args:
            step: The step just finished.
            loss: Its loss (NaN is ignored).
            step_seconds: Its wall time, without checkpoint stalls.
        """
        super().observe(step, loss, step_seconds)
        if self.comm.rank != 0:
            return
        total, n, last_t = self._pending
        if math.isfinite(loss):
            total, n = total + float(loss), n + 1
        if self.train_time_s - last_t < self.observe_every_s:
            self._pending = (total, n, last_t)
            return
        self._pending = (0.0, 0, self.train_time_s)
        if self.planner is not None and self.planner.observe(step, self.train_time_s, total / n if n else math.nan):
            self._replan()  # the planner re-planned from now; anchor the new plan at the last checkpoint

    def decide(self, step: int) -> bool:
        """Local, rank 0's decision for ``step`` (False on other ranks). A caller that already has a
        per-step collective (the Session's) folds this into it instead of paying :meth:`due`'s bcast."""
        if self.comm.rank != 0:
            return False
        if self.planner is None:
            return step >= self.last_saved_step + self.warmup_steps and not self.ckpt_costs
        self.planner.next_checkpoint(self.train_time_s)  # extends a plan past its horizon
        every = self.two_tier_disk_every
        if every is not None:
            # the memory tier holds the recent steps: disk saves at the two-tier plan's interval
            return step >= self.last_saved_step + every
        return self.planner.should_checkpoint(step, self.last_saved_step)

    def after_failure(self, seconds_since_failure: float) -> None:
        """Rank 0: this attempt restarted after an unannounced failure that long ago (wall time).

        With a decreasing hazard (Weibull shape < 1) the default policy checkpoints more often
        right after a failure; the planner ages that offset along its training-time axis."""
        if self.comm.rank != 0 or not math.isfinite(seconds_since_failure):
            return
        self._since_failure_s = max(0.0, float(seconds_since_failure)) - self.train_time_s
        if self.planner is not None:
            self.planner.time_since_failure_s = self._since_failure_s
            if self.ckpt_costs:
                self._replan()

    def use_survivor_coverage(self, coverage: float) -> None:
        super().use_survivor_coverage(coverage)
        if self.comm.rank == 0 and self.planner is not None and \
                self.planner.survivor_coverage != self.survivor_coverage:
            self.planner.survivor_coverage = self.survivor_coverage
            if self.ckpt_costs:
                self._replan()

    def use_failure_model(self, model: FailureModel) -> None:
        """Rank 0: a failure model that arrived after the start (the partition's history, read in
        the background); the plan is remade from the last checkpoint, the loss fit is kept."""
        self.failure_model = model
        if self.comm.rank == 0 and self.planner is not None:
            self.planner.failure_model = model
            self._replan()

    # -- planning ------------------------------------------------------------------------------------
    def _replan(self) -> None:
        """Plan from the last checkpoint, not from now: a re-plan must not postpone protection."""
        if self.comm.rank != 0:
            return
        if self.planner is None:
            self.planner = OnlinePlanner(self.policy, self.failure_model, self.nodes, self.costs(),
                                         self.horizon_s, refit_every=self.refit_every,
                                         time_since_failure_s=self._since_failure_s,
                                         survivor_coverage=self.survivor_coverage)
        self.planner.replan(self.last_saved_step, self.last_saved_time_s, self.costs())

    def next_step(self) -> int | None:
        """Rank 0's next planned checkpoint step (for logs); None on other ranks or before a plan."""
        if self.planner is None:
            return None
        nxt = self.planner.next_checkpoint(self.train_time_s)
        return None if nxt is None else nxt.step

    # -- checkpointed state ---------------------------------------------------------------------------
    def _own_state(self) -> dict[str, Any]:
        return {**super()._own_state(), "planner": None if self.planner is None else self.planner.to_state()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.planner = None if d.get("planner") is None or self.comm.rank != 0 else \
            OnlinePlanner.from_state(d["planner"])


def make_schedule(policy: str, failure_model: Any, *, nodes: int, horizon_s: float,
                  comm: Comm | None = None, in_place: bool = False) -> _Measured:
    """The schedule for a policy spec: ``fixed:N`` needs no failure model (``failure_model`` is
    then not called); the planner's policies get ``failure_model()``. ``in_place``: failures are
    restarted inside the allocation (coci-submit --spare-nodes), see :meth:`_Measured.restart_cost_s`."""
    p = make_policy(policy)
    if isinstance(p, Fixed):
        return FixedSchedule(p.n, comm=comm, in_place=in_place)
    return CheckpointSchedule(policy, failure_model(), nodes=nodes, horizon_s=horizon_s, comm=comm,
                              in_place=in_place)


Schedule = _Measured


class ScheduleState:
    """The Session's own part of the checkpoint: the planner's measured costs and plan."""

    def __init__(self, schedule: _Measured) -> None:
        self.schedule = schedule

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "schedule": self.schedule.state_dict()}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        # A checkpoint written before fixed:N had a schedule holds None: nothing measured to restore.
        if d.get("schedule") is not None and d["schedule"].get("policy") == self.schedule.policy:
            self.schedule.load_state_dict(dict(d["schedule"]))

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own view, no collective (a survivors' save, where rank 0 may be gone)."""
        return {"version": 1, "schedule": self.schedule.local_state_dict()}
