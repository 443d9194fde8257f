"""Fault-tolerance costs measured by the runtime and handed to the planner."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from coci_hpc.errors import PlannerError


@dataclass(frozen=True)
class Costs:
    """Ts and Tr in seconds, plus the time of one training step when known.

    ``ckpt_s`` (Ts) is what a checkpoint blocks training for (blocking snapshot + persist that is
    not overlapped). ``restart_s`` (Tr) is requeue latency + restore. ``step_time_s`` converts plan
    times into step numbers.
    """

    ckpt_s: float
    restart_s: float
    step_time_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ckpt_s", "restart_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PlannerError(f"{name} must be a finite number >= 0, got {v!r}",
                                   hint="measure the cost in seconds, e.g. --ckpt-cost 12.5")
        if self.ckpt_s <= 0:
            raise PlannerError("checkpoint cost Ts must be > 0 seconds",
                               hint="pass the measured blocking time of one checkpoint (--ckpt-cost)")
        st = self.step_time_s
        if st is not None and (not math.isfinite(st) or st <= 0):
            raise PlannerError(f"step_time_s must be > 0, got {st!r}",
                               hint="leave it out or give the mean seconds per training step")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        return cls(ckpt_s=float(d["ckpt_s"]), restart_s=float(d["restart_s"]),
                   step_time_s=None if d.get("step_time_s") is None else float(d["step_time_s"]))
