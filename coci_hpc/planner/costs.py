"""Fault-tolerance costs measured by the runtime and handed to the planner."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from coci_hpc.errors import PlannerError

# Tr before any restart was measured: Slurm's 120 s requeue credential lifetime + 30 s restore.
# The one default (coci-plan without a measurement uses it and says so).
DEFAULT_RESTART_S = 150.0


@dataclass(frozen=True)
class Costs:
    """Tb, Tr and P in seconds, plus the time of one training step when known.

    ``ckpt_s`` (Tb) is what a checkpoint blocks training for (the snapshot, plus any persist
    that is not overlapped). ``persist_s`` (P) is how long an asynchronous save keeps writing in
    the background after training resumed: a failure in that time loses the save, and the next
    save cannot start before it ends; 0 for a synchronous save. ``restart_s`` (Tr) is requeue
    latency + restore. ``step_time_s`` converts plan times into step numbers.
    """

    ckpt_s: float
    restart_s: float
    step_time_s: float | None = None
    persist_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ckpt_s", "restart_s", "persist_s"):
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
    def from_dict(cls, d: dict) -> Costs:
        return cls(ckpt_s=float(d["ckpt_s"]), restart_s=float(d["restart_s"]),
                   step_time_s=None if d.get("step_time_s") is None else float(d["step_time_s"]),
                   persist_s=float(d.get("persist_s") or 0.0))
