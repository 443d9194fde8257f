"""The profile a training run records for the planner, as one typed object.

JSON (``coci-plan --profile``; the runtime writes it with :meth:`Profile.save`); every key but
``samples`` optional::

    {
      "samples": [{"step": 100, "time_s": 52.0, "loss": 2.11}, ...],
      "ckpt_cost_s": 12.5,        # Tb: blocking time of one save (measured)
      "persist_s": 40.0,          # P: background persist time of an asynchronous save (measured)
      "restart_cost_s": 140.0,    # Tr: requeue latency + restore (measured)
      "step_time_s": 0.52,        # seconds per step (else derived from the samples)
      "total_steps": 20000        # the run's last step, when known (the planner's horizon)
    }

``time_s`` is training time since the job started (checkpoint stalls excluded).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from coci_hpc.durable import write_atomic
from coci_hpc.errors import InputFormatError, UsageError

_NUMBERS = ("ckpt_cost_s", "persist_s", "restart_cost_s", "step_time_s")


@dataclass(frozen=True)
class Sample:
    step: int | None
    time_s: float
    loss: float


@dataclass(frozen=True)
class Profile:
    samples: tuple[Sample, ...] = ()
    ckpt_cost_s: float | None = None
    persist_s: float | None = None
    restart_cost_s: float | None = None
    step_time_s: float | None = None
    total_steps: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    # -- views the planner uses --------------------------------------------------------------
    @property
    def times(self) -> list[float]:
        return [s.time_s for s in self.samples]

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.samples]

    @property
    def steps(self) -> list[int | None]:
        return [s.step for s in self.samples]

    def t_now(self) -> float:
        finite = [t for t in self.times if math.isfinite(t)]
        return max(finite) if finite else 0.0

    def step_now(self) -> int:
        steps = [s for s in self.steps if s is not None]
        return max(steps) if steps else 0

    def measured_step_time(self) -> float | None:
        """The recorded step time, else the median seconds per step between samples."""
        if self.step_time_s is not None:
            return self.step_time_s
        pairs = [(s.step, s.time_s) for s in self.samples if s.step is not None]
        if len(pairs) < 2:
            return None
        st, t = np.array(pairs, dtype=float).T
        ds, dt = np.diff(st), np.diff(t)
        ok = ds > 0
        return float(np.median(dt[ok] / ds[ok])) if ok.any() else None

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"samples": [{"step": s.step, "time_s": s.time_s,
                          "loss": None if not math.isfinite(s.loss) else s.loss}
                         for s in self.samples]}
        for k in _NUMBERS + ("total_steps",):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    @classmethod
    def from_dict(cls, d: object, source: str = "profile") -> Profile:
        hint = "see the profile schema in coci-plan --help"
        if not isinstance(d, dict) or not isinstance(d.get("samples", []), list):
            raise InputFormatError("expected an object with a 'samples' list", source=source,
                                   hint=hint)
        samples = []
        for i, smp in enumerate(d.get("samples", [])):
            try:
                loss = float(smp["loss"]) if smp["loss"] is not None else math.nan
                step = int(smp["step"]) if smp.get("step") is not None else None
                samples.append(Sample(step, float(smp["time_s"]), loss))
            except (KeyError, TypeError, ValueError) as exc:
                raise InputFormatError(f"samples[{i}] needs numeric time_s and loss ({exc})",
                                       source=source,
                                       hint='e.g. {"step": 10, "time_s": 5.2, "loss": 2.1}') from exc
        nums = {}
        for key in _NUMBERS:
            v = d.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise InputFormatError(f"{key} must be a number", source=source,
                                       hint="seconds, e.g. 12.5")
            nums[key] = None if v is None else float(v)
        ts = d.get("total_steps")
        if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int) or ts < 1):
            raise InputFormatError("total_steps must be a positive integer", source=source,
                                   hint="the run's last step, e.g. 20000")
        extra = {k: v for k, v in d.items() if k not in _NUMBERS + ("samples", "total_steps")}
        return cls(tuple(samples), total_steps=ts, extra=extra, **nums)

    @classmethod
    def load(cls, path: str, option: str = "--profile") -> Profile:
        """Read a profile JSON; errors name ``option``, the flag that gave the path."""
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise UsageError(f"cannot read profile {path}: {exc.strerror}",
                             hint=f"check the {option} path") from exc
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputFormatError(f"not JSON: {exc.msg}", line=exc.lineno, source=path,
                                   hint="see the profile schema in coci-plan --help") from exc
        return cls.from_dict(d, source=path)

    def save(self, path: str) -> None:
        """Write durably (:func:`coci_hpc.durable.write_atomic`): a reader never sees half a profile."""
        write_atomic(path, json.dumps(self.to_dict(), indent=1, allow_nan=False))
