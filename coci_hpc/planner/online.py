"""The planner as the training loop uses it: observe losses, re-plan on drift, serialise.

``OnlinePlanner.to_state()`` is a JSON-able dict, so the checkpoint store can keep it as
"planner state" in a checkpoint's user extras and ``from_state`` resumes after a restart.
"""
from __future__ import annotations

import json

from coci_hpc.planner.convergence import ConvergenceTracker
from coci_hpc.planner.costs import Costs
from coci_hpc.planner.failures import FailureModel
from coci_hpc.planner.plan import Checkpoint, Plan
from coci_hpc.planner.policies import PlanContext, make_policy


class OnlinePlanner:
    def __init__(self, policy: str, failure_model: FailureModel, nodes: int, costs: Costs,
                 horizon_s: float, *, refit_every: int = 50, drift_tol: float = 0.05,
                 time_since_failure_s: float | None = None, survivor_coverage: float = 0.0) -> None:
        """``time_since_failure_s``: wall time since the failure that made this a restart (None:
        a fresh start, or unknown); with a decreasing hazard the default policy checkpoints more
        often right after a failure. It ages with training time from t = 0.
        ``survivor_coverage``: the share of failures a survivors' save covers (PlanContext)."""
        self.policy_spec = policy
        self.survivor_coverage = float(survivor_coverage)
        self.time_since_failure_s = time_since_failure_s
        self.policy = make_policy(policy)
        self.failure_model = failure_model
        self.nodes = int(nodes)
        self.costs = costs
        self.horizon_s = float(horizon_s)
        self.tracker = ConvergenceTracker(refit_every=refit_every, drift_tol=drift_tol)
        self.plan: Plan = self._make_plan(0.0, 0)
        self.replans = 0

    def _make_plan(self, t_now: float, step_now: int) -> Plan:
        o = self.tracker.outcome
        fm = self.failure_model
        age = None if self.time_since_failure_s is None else self.time_since_failure_s + t_now
        ctx = PlanContext.from_model(fm, self.costs, self.horizon_s, self.nodes, t_now=t_now,
                                     step_now=step_now, fit=o.fit, fit_reason=o.reason,
                                     time_since_failure_s=age, survivor_coverage=self.survivor_coverage)
        return self.policy.plan(ctx)

    def observe(self, step: int, time_s: float, loss: float) -> bool:
        """Record a loss; returns True when the plan was remade (curve drifted or first fit)."""
        refit = self.tracker.add(step, time_s, loss)
        first_fit = refit and self.tracker.fit is not None and self.plan.fit is None
        if self.tracker.replan_needed or first_fit:
            self.replan(step, time_s)
            return True
        return False

    def replan(self, step: int, time_s: float, costs: Costs | None = None) -> Plan:
        """Re-plan from now (e.g. with newly measured costs)."""
        if costs is not None:
            self.costs = costs
        self.plan = self._make_plan(float(time_s), int(step))
        self.tracker.acknowledge()
        self.replans += 1
        return self.plan

    def next_checkpoint(self, time_s: float) -> Checkpoint | None:
        nxt = self.plan.next_checkpoint(time_s)
        if nxt is None and time_s >= self.plan.t_now + self.plan.horizon_s:
            # past the horizon: extend the plan rather than stop protecting the job
            step = self.tracker.samples[-1][0] if self.tracker.samples else 0
            self.replan(step, time_s)
            nxt = self.plan.next_checkpoint(time_s)
        return nxt

    def should_checkpoint(self, step: int, last_ckpt_step: int) -> bool:
        """True when a planned checkpoint step lies in (last_ckpt_step, step]."""
        # Called every training step: stop at the first planned step after the last checkpoint
        # (plans are in time order) instead of scanning the whole plan when nothing is due.
        nxt = self.plan.next_step(last_ckpt_step)
        return nxt is not None and nxt <= step

    def _model_json(self) -> str:
        """The failure model as JSON, made once per model (it never changes in place). A real
        history's model holds its incidents (LANL system 2: 5000, ~800 KB): as a dict it was
        rebuilt and flattened into every checkpoint and every memory-tier copy, 0.2-0.45 s of
        rank 0's time each (and the copy time the two-tier plan measures); one string is not."""
        cached = getattr(self, "_model_json_cache", None)     # from_state() skips __init__
        if cached is None or cached[0] is not self.failure_model:
            cached = (self.failure_model, json.dumps(self.failure_model.to_dict(), separators=(",", ":")))
            self._model_json_cache = cached
        return cached[1]

    def to_state(self) -> dict:
        return {"version": 1, "policy": self.policy_spec, "nodes": self.nodes,
                "horizon_s": self.horizon_s, "costs": self.costs.to_dict(),
                "failure_model_json": self._model_json(), "tracker": self.tracker.to_state(),
                "plan": self.plan.to_dict(), "replans": self.replans,
                "time_since_failure_s": self.time_since_failure_s,
                "survivor_coverage": self.survivor_coverage}

    @classmethod
    def from_state(cls, state: dict) -> OnlinePlanner:
        if state.get("version") != 1:
            raise ValueError(f"unknown planner state version {state.get('version')!r}")
        obj = cls.__new__(cls)
        obj.policy_spec = state["policy"]
        obj.policy = make_policy(state["policy"])
        # "failure_model" (a dict): checkpoints written before the model was kept as one string
        obj.failure_model = FailureModel.from_dict(json.loads(state["failure_model_json"])
                                                   if "failure_model_json" in state else state["failure_model"])
        obj.nodes = int(state["nodes"])
        obj.costs = Costs.from_dict(state["costs"])
        obj.horizon_s = float(state["horizon_s"])
        obj.tracker = ConvergenceTracker.from_state(state["tracker"])
        obj.plan = Plan.from_dict(state["plan"])
        obj.replans = int(state.get("replans", 0))
        obj.time_since_failure_s = state.get("time_since_failure_s")
        obj.survivor_coverage = float(state.get("survivor_coverage") or 0.0)
        return obj
