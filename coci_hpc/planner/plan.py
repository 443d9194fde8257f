"""The frozen plan every policy returns: checkpoint times/steps up to a horizon, JSON-able."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from coci_hpc.planner.convergence import CurveFit
from coci_hpc.planner.costs import Costs


@dataclass(frozen=True)
class Checkpoint:
    """A planned checkpoint at training time ``time_s`` (checkpoint stalls excluded) and ``step``
    (None when the step time is unknown)."""

    time_s: float
    step: int | None

    def to_dict(self) -> dict:
        return {"time_s": self.time_s, "step": self.step}


@dataclass(frozen=True)
class Plan:
    """Checkpoints from ``t_now`` to ``t_now + horizon_s``.

    ``effective_policy`` differs from ``policy`` when the policy fell back (e.g. coci without a
    usable convergence fit plans as young); ``fallback`` then states why.
    """

    policy: str
    effective_policy: str
    checkpoints: tuple[Checkpoint, ...]
    interval_s: float | None
    horizon_s: float
    t_now: float
    step_now: int
    job_rate: float
    costs: Costs
    fit: CurveFit | None = None
    fallback: str | None = None
    params: dict = field(default_factory=dict)

    @property
    def times(self) -> list[float]:
        return [c.time_s for c in self.checkpoints]

    def next_checkpoint(self, after_time_s: float | None = None) -> Checkpoint | None:
        """First planned checkpoint strictly after ``after_time_s`` (default: ``t_now``)."""
        t = self.t_now if after_time_s is None else after_time_s
        for c in self.checkpoints:
            if c.time_s > t:
                return c
        return None

    def next_step(self, after_step: int) -> int | None:
        for c in self.checkpoints:
            if c.step is not None and c.step > after_step:
                return c.step
        return None

    def to_dict(self) -> dict:
        mtbf = 1.0 / self.job_rate if self.job_rate > 0 else math.inf
        return {
            "policy": self.policy, "effective_policy": self.effective_policy,
            "interval_s": self.interval_s, "horizon_s": self.horizon_s,
            "t_now": self.t_now, "step_now": self.step_now,
            "job_rate_per_s": self.job_rate,
            "mtbf_hours": None if math.isinf(mtbf) else mtbf / 3600.0,
            "costs": self.costs.to_dict(),
            "fit": None if self.fit is None else self.fit.to_dict(),
            "fallback": self.fallback, "params": dict(self.params),
            "checkpoints": [c.to_dict() for c in self.checkpoints],
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(policy=d["policy"], effective_policy=d["effective_policy"],
                   checkpoints=tuple(Checkpoint(float(c["time_s"]), c["step"])
                                     for c in d["checkpoints"]),
                   interval_s=d["interval_s"], horizon_s=float(d["horizon_s"]),
                   t_now=float(d["t_now"]), step_now=int(d["step_now"]),
                   job_rate=float(d["job_rate_per_s"]), costs=Costs.from_dict(d["costs"]),
                   fit=None if d.get("fit") is None else CurveFit.from_dict(d["fit"]),
                   fallback=d.get("fallback"), params=dict(d.get("params") or {}))
