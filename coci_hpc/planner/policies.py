"""Checkpoint policies behind one interface.

Every policy turns a :class:`PlanContext` into a frozen :class:`~coci_hpc.planner.plan.Plan`
(checkpoint training-times and steps from ``t_now`` up to the horizon) and answers
``next_checkpoint``. Times are training time in seconds (checkpoint stalls excluded), so a plan
stays valid across restarts: after a rollback to checkpoint k the next target is k+1.

Policies (see :func:`make_policy`):

* ``coci`` (the default, :class:`CociDefault`): the exponential-optimal period for the job's
  failure rate (declustered, unannounced interruptions only) with the blocking cost Tb, never
  shorter than the asynchronous persist time P; the remaining horizon cut into the optimal
  number of equal chunks (Bougeret et al., no trailing checkpoint); after a restart, when the
  fitted per-node Weibull shape is < 1, intervals that grow with the time since the failure.
  On a learned history of fewer than 150 incidents, Daly's plan on the record rate. Measured
  against Daly on simulated and replayed histories in benchmarks/planner_bench.py (docs/benchmarks/planner.md).
* ``coci-paper`` (the COCI paper's equal-loss-drop rule, uncapped, as published),
  ``coci-paper:capped`` (gaps capped at 2x Young), ``coci-paper:dp=S[,T]`` (data-parallel).
  For reproduction; equal-loss-drop spacing costs more than Daly in wall time (docs/benchmarks/coci-paper.md).
* ``young``, ``daly``, ``checkfreq[:P]``, ``fixed:N``.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from coci_hpc.errors import PlannerError, UsageError
from coci_hpc.planner import horizon as endgame
from coci_hpc.planner.convergence import CurveFit
from coci_hpc.planner.costs import Costs
from coci_hpc.planner.failures import JEFFREYS_PRIOR_FAILURES, FailureModel
from coci_hpc.planner.hazard import JobHazard
from coci_hpc.planner.plan import Checkpoint, Plan

# The COCI paper's code fits theta1 and takes lambda and Ts per MINUTE; its Pe formula is not
# unit-free (it mixes a rate with a loss drop), so we evaluate it in the paper's unit.
COCI_TIME_UNIT_S = 60.0
MAX_CHECKPOINTS = 200_000


@dataclass(frozen=True)
class PlanContext:
    costs: Costs
    job_rate: float                 # job failures per second (n nodes * per-node rate)
    horizon_s: float                # plan covers (t_now, t_now + horizon_s]
    t_now: float = 0.0              # current training time
    step_now: int = 0
    fit: CurveFit | None = None
    fit_reason: str | None = None   # why there is no fit (for the fallback message)
    nodes: int = 1                  # the job's nodes (job_rate = nodes * per-node rate)
    weibull_shape: float | None = None        # per-node shape when the history prefers Weibull
    time_since_failure_s: float | None = None  # wall time since the failure that restarted the job
    # How much history the rate came from: incidents it was declustered into and the job rate
    # counted from the raw records (what Daly would use). None: the rate is given, not learned.
    incidents: int | None = None
    record_rate: float | None = None
    # The fraction of the failures in job_rate that the survivors' save covers (a lost rank or
    # node in data-parallel training: runtime/survivors.py): such a failure loses about one step,
    # not the work since the last checkpoint, so only the rest, job_rate * (1 - coverage),
    # drives the interval (the default policy's). 0: every failure rolls back to a checkpoint.
    survivor_coverage: float = 0.0

    def __post_init__(self) -> None:
        if not (self.job_rate > 0 and math.isfinite(self.job_rate)):
            raise PlannerError(f"job failure rate must be > 0 per second, got {self.job_rate!r}",
                               hint="give a failure history or --mtbf-hours")
        if not (self.horizon_s > 0 and math.isfinite(self.horizon_s)):
            raise PlannerError(f"horizon must be > 0 seconds, got {self.horizon_s!r}",
                               hint="e.g. --horizon 24h")
        c = self.survivor_coverage
        if not (isinstance(c, (int, float)) and 0.0 <= c <= 1.0):
            raise PlannerError(f"survivor_coverage must be a fraction in [0, 1], got {c!r}",
                               hint="the share of failures a survivors' save turns into a ~one-step loss")

    @classmethod
    def from_model(cls, model: FailureModel, costs: Costs, horizon_s: float, nodes: int,
                   **kw) -> PlanContext:
        """The context a failure model gives a job on ``nodes`` nodes: the declustered rate,
        the Weibull shape when the history chose it, and how much history that rests on."""
        learned = model.exposure_node_s > 0 and model.n_records is not None
        rec = None
        if learned:
            k_rec = max(model.n_records or 0, model.n_failures)
            rec = nodes * (k_rec if k_rec else JEFFREYS_PRIOR_FAILURES) / model.exposure_node_s
        return cls(costs, model.incident_job_rate(nodes), horizon_s, nodes=nodes,
                   weibull_shape=model.hazard_shape,
                   incidents=model.n_failures if learned else None, record_rate=rec, **kw)

    @property
    def mtbf_s(self) -> float:
        return 1.0 / self.job_rate

    @property
    def uncovered(self) -> float:
        """The fraction of failures that still roll back to the last checkpoint."""
        return 1.0 - float(self.survivor_coverage)

    def step_at(self, t: float) -> int | None:
        st = self.costs.step_time_s
        if st is None:
            return None
        return self.step_now + max(1, int(round((t - self.t_now) / st)))


def young_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Young (1974): sqrt(2 * Ts * M)."""
    return math.sqrt(2.0 * ckpt_s * mtbf_s)


def daly_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order estimate of the optimum compute time between checkpoints:
    sqrt(2dM) * [1 + (1/3) sqrt(d/2M) + (1/9) (d/2M)] - d  for d < 2M, else M."""
    d, m = ckpt_s, mtbf_s
    if d >= 2.0 * m:
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def checkfreq_interval(ckpt_s: float, max_overhead: float, step_time_s: float | None) -> float:
    """CheckFreq: the most frequent interval whose checkpoint overhead Ts/(T+Ts) <= p.

    With a step time the interval is a whole number of steps (CheckFreq works per iteration)."""
    if not 0 < max_overhead < 1:
        raise UsageError(f"checkfreq overhead bound must be in (0, 100) percent, got "
                         f"{max_overhead * 100:g}", hint="e.g. --policy checkfreq:3.5")
    t = ckpt_s * (1.0 - max_overhead) / max_overhead
    if step_time_s:
        t = math.ceil(t / step_time_s - 1e-9) * step_time_s
    return t


def coci_pe(theta1_per_s: float, ckpt_s: float, job_rate_per_s: float,
            unit_s: float = COCI_TIME_UNIT_S) -> float:
    """COCI's loss drop per checkpoint segment:
    Pe = (1 - exp(theta1*Ts)) * (1/(2*lambda) - 1/(2*theta1)), in the paper's time unit."""
    th = theta1_per_s * unit_s
    ts = ckpt_s / unit_s
    lam = job_rate_per_s * unit_s
    if th >= 0:
        raise PlannerError("COCI needs a decreasing loss curve (theta1 < 0)",
                           hint="use another policy or profile longer")
    return (1.0 - math.exp(th * ts)) * (1.0 / (2.0 * lam) - 1.0 / (2.0 * th))


class Policy(ABC):
    name: str = ""

    @abstractmethod
    def plan(self, ctx: PlanContext) -> Plan:
        ...

    def next_checkpoint(self, ctx: PlanContext) -> Checkpoint | None:
        return self.plan(ctx).next_checkpoint()

    def __repr__(self) -> str:
        return f"<policy {self.name}>"


def _uniform(ctx: PlanContext, interval: float) -> list[float]:
    n = int(math.floor(ctx.horizon_s / interval + 1e-9))
    if n > MAX_CHECKPOINTS:
        raise PlannerError(f"interval {interval:.3g} s gives {n} checkpoints within the horizon",
                           hint="shorten --horizon or check the costs and failure rate")
    return [ctx.t_now + interval * (i + 1) for i in range(n)]


def _checkpoints(ctx: PlanContext, times: list[float]) -> tuple[Checkpoint, ...]:
    out: list[Checkpoint] = []
    last_step = ctx.step_now
    for t in times:
        s = ctx.step_at(t)
        if s is not None:
            if s <= last_step:           # two targets inside one step: keep the first
                continue
            last_step = s
        out.append(Checkpoint(float(t), s))
    return tuple(out)


class UniformPolicy(Policy):
    """A policy with one interval; subclasses give it."""

    @abstractmethod
    def interval(self, ctx: PlanContext) -> float:
        ...

    def plan(self, ctx: PlanContext) -> Plan:
        iv = self.interval(ctx)
        return Plan(self.name, self.name, _checkpoints(ctx, _uniform(ctx, iv)), iv,
                    ctx.horizon_s, ctx.t_now, ctx.step_now, ctx.job_rate, ctx.costs, ctx.fit)


class Young(UniformPolicy):
    name = "young"

    def interval(self, ctx: PlanContext) -> float:
        return young_interval(ctx.costs.ckpt_s, ctx.mtbf_s)


class Daly(UniformPolicy):
    name = "daly"

    def interval(self, ctx: PlanContext) -> float:
        return daly_interval(ctx.costs.ckpt_s, ctx.mtbf_s)


class CheckFreq(UniformPolicy):
    def __init__(self, max_overhead_percent: float = 3.5) -> None:
        self.p = max_overhead_percent / 100.0
        self.name = "checkfreq" if max_overhead_percent == 3.5 else f"checkfreq:{max_overhead_percent:g}"

    def interval(self, ctx: PlanContext) -> float:
        return checkfreq_interval(ctx.costs.ckpt_s, self.p, ctx.costs.step_time_s)


class Fixed(UniformPolicy):
    def __init__(self, every_steps: int) -> None:
        if every_steps < 1:
            raise UsageError(f"fixed:N needs N >= 1, got {every_steps}", hint="e.g. fixed:500")
        self.n = int(every_steps)
        self.name = f"fixed:{self.n}"

    def interval(self, ctx: PlanContext) -> float:
        if ctx.costs.step_time_s is None:
            raise PlannerError(f"{self.name} needs the step time to turn steps into seconds",
                               hint="give step_time_s in the profile")
        return self.n * ctx.costs.step_time_s


class CociPaper(Policy):
    """The COCI paper's rule, kept for reproduction: checkpoints at equal convergence progress: checkpoint i where the fitted loss has dropped
    by i*Pe from its value now. Dense early, sparse late.

    Data-parallel variant (``theta_scale``, ``ts_scale``): the run continues under another
    configuration whose convergence per second is ``theta_scale`` times the profiled one and
    whose checkpoint cost is ``ts_scale`` times Ts, as in the paper.

    ``max_interval_factor`` caps any gap at that many Young intervals (``coci-paper:capped``,
    2.0): past the fitted curve's reach the extrapolation is not trusted to leave the job
    unprotected for hours. ``None`` (the default) is the paper's rule as published.
    Without a usable fit, it falls back to young and says why.
    """

    def __init__(self, theta_scale: float = 1.0, ts_scale: float = 1.0,
                 max_interval_factor: float | None = None) -> None:
        if theta_scale <= 0 or ts_scale <= 0:
            raise UsageError("coci-paper:dp scales must be > 0", hint="e.g. coci-paper:dp=4,1.5")
        self.theta_scale, self.ts_scale = float(theta_scale), float(ts_scale)
        self.max_interval_factor = max_interval_factor
        dp = (self.theta_scale, self.ts_scale) != (1.0, 1.0)
        self.name = f"coci-paper:dp={self.theta_scale:g},{self.ts_scale:g}" if dp else "coci-paper"
        if max_interval_factor is not None:
            self.name = "coci-paper:capped" if not dp else self.name + ":capped"

    def plan(self, ctx: PlanContext) -> Plan:
        fit = ctx.fit
        ts = ctx.costs.ckpt_s * self.ts_scale
        young = young_interval(ts, ctx.mtbf_s)
        if fit is None:
            why = ctx.fit_reason or "no convergence samples"
            p = Young().plan(ctx)
            return Plan(self.name, "young", p.checkpoints, p.interval_s, ctx.horizon_s, ctx.t_now,
                        ctx.step_now, ctx.job_rate, ctx.costs, None,
                        fallback=f"no usable convergence fit ({why}); planned as young")
        pe = coci_pe(fit.theta1 * self.theta_scale, ts, ctx.job_rate)
        scale = self.theta_scale

        def loss_at(t: float) -> float:          # the curve as walked under this configuration
            return float(fit.loss(ctx.t_now + scale * (t - ctx.t_now)))

        def time_at(loss: float) -> float:
            u = fit.time_at_loss(loss)
            return ctx.t_now + (u - ctx.t_now) / scale if math.isfinite(u) else math.inf

        l_now = loss_at(ctx.t_now)
        end = ctx.t_now + ctx.horizon_s
        cap = None if self.max_interval_factor is None else self.max_interval_factor * young
        min_iv = max(ts, ctx.costs.step_time_s or 0.0)   # never more often than once per Ts
        times: list[float] = []
        anchor, last, i = l_now, ctx.t_now, 1
        while len(times) < MAX_CHECKPOINTS:
            t = time_at(anchor - i * pe)
            if t - last < min_iv:
                # skip the targets that fall inside the minimum interval in one jump
                i = max(i + 1, math.ceil((anchor - loss_at(last + min_iv)) / pe - 1e-12))
                t = time_at(anchor - i * pe)
            if cap is not None and t - last > cap:
                # beyond the curve's reach (or a long gap): cap it, then measure the next
                # equal-progress drop from the loss reached there
                t = last + cap
                anchor, i = loss_at(t), 0
            if not math.isfinite(t) or t > end + 1e-9:
                break
            times.append(t)
            last = t
            i += 1
        params = {"pe": pe, "loss_now": l_now, "time_unit_s": COCI_TIME_UNIT_S,
                  "theta_scale": self.theta_scale, "ts_scale": self.ts_scale,
                  "max_interval_s": cap}
        return Plan(self.name, self.name, _checkpoints(ctx, times), None, ctx.horizon_s,
                    ctx.t_now, ctx.step_now, ctx.job_rate, ctx.costs, fit, None, params)


class CociDefault(Policy):
    """The default: Daly where failures are memoryless, better where there is structure.

    1. The exponential-optimal period for the job rate (the caller gives the rate of
       unannounced incidents that hit a job on its nodes) with the BLOCKING cost Tb, never below the persist time P
       of an asynchronous save (overhead ~ Tb/tau + lambda (tau/2 + P + R): P does not move the
       optimum, it only bounds it below) nor below one step.
    2. The remaining horizon is cut into the optimal number of equal chunks (Bougeret et al.,
       :mod:`coci_hpc.planner.horizon`), so no checkpoint lands just before the end unused.
    3. Hazard layer: with a per-node Weibull shape < 1, intervals follow Daly's rule at the mean
       hazard over the interval, from the time since the failure that restarted the job
       (``time_since_failure_s``; the failed node is fresh) or, without one, since ``t_now`` (:mod:`coci_hpc.planner.hazard`),
       and the last stretch is cut into equal chunks again at its mean hazard.
    0. A learned history (``ctx.incidents`` set, :meth:`PlanContext.from_model`) of fewer
       than ``min_incidents`` incidents gets Daly's own plan on the record rate instead.
    Survivors' saves: every rate above is the rate of failures that roll back to a checkpoint,
    ``job_rate * (1 - survivor_coverage)`` (a covered failure loses ~one step whatever the
    interval); at first order the interval grows by 1 / sqrt(1 - coverage) (coverage 0.9:
    x sqrt(10) ~ 3.2). Coverage 0 gives exactly the plan without it.
    The convergence fit does not move checkpoints; it predicts the horizon (coci-plan).
    """

    name = "coci"
    max_gap_factor = 20.0            # the hazard layer never leaves more than 20 Daly periods
    # incidents a learned history needs before anything but Daly's plan (see plan())
    min_incidents = 150

    def __init__(self) -> None:
        # hazard walks depend on (hazard, age, costs) only, not on where the job stands: a
        # simulation or a long job re-plans from the same age after every restart
        self._walks: dict[tuple, list[float]] = {}

    def _walk(self, hz: JobHazard, age0: float, tb: float, lo: float, hi: float, base: float,
              span: float) -> list[float]:
        """Checkpoint offsets from the age ``age0`` on, at least up to ``span``."""
        key = (hz, round(age0, 3), tb, lo, hi)
        offs = self._walks.get(key)
        if offs is None:
            if len(self._walks) > 256:
                self._walks.clear()
            offs = self._walks[key] = []
        t = offs[-1] if offs else 0.0
        tau = (offs[-1] - offs[-2]) if len(offs) > 1 else (offs[-1] if offs else base)
        while t < span and len(offs) < MAX_CHECKPOINTS:
            tau = hz.next_interval(age0 + t, tb, tau, lo, hi, daly_interval)
            t += tau
            offs.append(t)
        return offs

    def plan(self, ctx: PlanContext) -> Plan:
        c = ctx.costs
        # Only the failures the survivors' save does not cover lose the work since the last
        # checkpoint (the others lose ~one step whatever the interval): Daly's rule on that rate.
        # With coverage 0 this is the job rate itself, and the plan is exactly the one without it.
        keep = ctx.uncovered
        lam, tb, w = ctx.job_rate * keep, c.ckpt_s, ctx.horizon_s
        lo = max(c.persist_s, c.step_time_s or 0.0, 1e-6)
        if lam <= 0.0:
            return self._no_rollback(ctx, lo)
        if ctx.incidents is not None and ctx.incidents < self.min_incidents:
            # A short history: the incident rate, the Weibull shape and the end game's chunk
            # count would rest on a few dozen or hundred incidents. The refinements gain a few
            # per cent; the rate alone is uncertain by 1/sqrt(k) (8 % at 150) and drifts more
            # than that between the halves of a short window, and a lower rate than Daly's
            # then costs more than the refinements gain. Replays of LANL histories thinned and
            # cut to 15-300 records (benchmarks/planner_bench.py) lost up to 1.15x Daly below
            # ~150 incidents with the refinements on. So: Daly's own plan on the record rate.
            rec = ctx.record_rate * keep if ctx.record_rate is not None else lam
            return self._daly_fallback(ctx, rec, lo)
        daly = daly_interval(tb, 1.0 / lam)
        base = max(daly, lo)
        shape = ctx.weibull_shape
        hazard = shape is not None and 0 < shape < 1
        params: dict[str, Any] = {"daly_s": daly, "min_interval_s": lo, "persist_s": c.persist_s}
        if ctx.survivor_coverage:
            params.update(survivor_coverage=ctx.survivor_coverage, rollback_rate_per_s=lam)
        if not hazard:
            if w / base > MAX_CHECKPOINTS:
                raise PlannerError(f"interval {base:.3g} s gives over {MAX_CHECKPOINTS} "
                                   "checkpoints within the horizon",
                                   hint="shorten --horizon or check the costs and failure rate")
            k = endgame.chunks(lam, w, tb, c.restart_s, lo)
            iv = w / k
            times = [ctx.t_now + iv * i for i in range(1, k)]
            params.update(mode="exponential", chunks=k)
            return Plan(self.name, self.name, _checkpoints(ctx, times), iv, w, ctx.t_now,
                        ctx.step_now, ctx.job_rate, c, ctx.fit, None, params)
        assert shape is not None  # hazard implies a shape
        since = ctx.time_since_failure_s
        fresh = since is not None
        hz = JobHazard(ctx.job_rate / max(ctx.nodes, 1), float(shape), max(ctx.nodes, 1), fresh, keep)
        # without a known failure, every node is of unknown age, seen to survive from t_now
        age0 = float(since) if since is not None else 0.0
        end = ctx.t_now + w
        offsets = self._walk(hz, age0, tb, lo, self.max_gap_factor * base, base, w)
        times = [ctx.t_now + x for x in offsets if x < w]
        # end game: the last stretch (from the second-to-last checkpoint) in equal chunks
        s0 = times[-2] if len(times) >= 2 else ctx.t_now
        kept = times[:-1] if len(times) >= 2 else []
        span = end - s0
        lam_end = hz.mean_rate(age0 + s0 - ctx.t_now, span)
        k = endgame.chunks(lam_end, span, tb, c.restart_s, lo)
        times = kept + [s0 + span / k * i for i in range(1, k)]
        params.update(mode="hazard", weibull_shape=shape,
                      time_since_failure_s=ctx.time_since_failure_s, end_chunks=k)
        return Plan(self.name, self.name, _checkpoints(ctx, times), None, w, ctx.t_now,
                    ctx.step_now, ctx.job_rate, c, ctx.fit, None, params)


    def _no_rollback(self, ctx: PlanContext, lo: float) -> Plan:
        """Every failure is covered by the survivors' save: none rolls back to a checkpoint, so
        the plan has none before the horizon (stop-saves and the final save still happen)."""
        return Plan(self.name, self.name, (), ctx.horizon_s, ctx.horizon_s, ctx.t_now, ctx.step_now, ctx.job_rate,
                    ctx.costs, ctx.fit, None, {"mode": "all-covered", "survivor_coverage": ctx.survivor_coverage,
                                               "min_interval_s": lo})

    def _daly_fallback(self, ctx: PlanContext, rate: float, lo: float) -> Plan:
        """Daly's own plan (its interval, uniform, on the record rate): what the default does
        when the history is too short for its refinements to be more than noise."""
        iv = max(daly_interval(ctx.costs.ckpt_s, 1.0 / rate), lo)
        times = _uniform(ctx, iv)
        why = (f"{ctx.incidents} incident(s) in the history, fewer than "
               f"{self.min_incidents}: planned as daly on the record rate")
        return Plan(self.name, "daly", _checkpoints(ctx, times), iv, ctx.horizon_s, ctx.t_now,
                    ctx.step_now, rate, ctx.costs, ctx.fit, why,
                    {"mode": "daly-fallback", "incidents": ctx.incidents, "daly_s": iv,
                     "min_interval_s": lo, "persist_s": ctx.costs.persist_s,
                     **({"survivor_coverage": ctx.survivor_coverage} if ctx.survivor_coverage else {})})


POLICY_NAMES = ("coci", "coci-paper", "coci-paper:capped", "coci-paper:dp=THETA_SCALE[,TS_SCALE]",
                "young", "daly", "checkfreq[:PERCENT]", "fixed:N")


def make_policy(spec: str) -> Policy:
    """Parse a policy name as given on the command line."""
    s = spec.strip().lower()
    head, _, arg = s.partition(":")
    try:
        if head == "coci" and not arg:
            return CociDefault()
        if head == "coci-paper":
            capped = arg == "capped" or arg.endswith(":capped")
            arg = arg[:-len("capped")].rstrip(":") if capped else arg
            cap = 2.0 if capped else None
            if not arg:
                return CociPaper(max_interval_factor=cap)
            if arg.startswith("dp="):
                parts = [float(x) for x in arg[3:].split(",")]
                if len(parts) not in (1, 2):
                    raise ValueError(arg)
                return CociPaper(parts[0], parts[1] if len(parts) == 2 else 1.0,
                                 max_interval_factor=cap)
            raise ValueError(arg)
        if head == "young" and not arg:
            return Young()
        if head == "daly" and not arg:
            return Daly()
        if head == "checkfreq":
            return CheckFreq(float(arg) if arg else 3.5)
        if head == "fixed" and arg:
            return Fixed(int(arg))
    except ValueError:
        pass
    raise UsageError(f"unknown policy {spec!r}", hint="valid: " + ", ".join(POLICY_NAMES))
