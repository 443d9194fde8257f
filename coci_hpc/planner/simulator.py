"""Replay failure traces against checkpoint plans, a loss curve and early termination.

Every policy is run on the SAME traces and the same stop points (common random numbers), so
differences between policies are not sampling noise. A run:

* trains from progress 0 towards ``stop_s`` of training time (the job's useful work: the
  whole job when it completes, less when an exploratory job is stopped early);
* at each planned checkpoint time it stalls for Ts; a failure rolls it back to the last
  completed checkpoint and costs Tr of restart (a failure during a restart restarts again).

Overhead in time = wall time - stop_s = checkpoint stalls + lost (recomputed) work + restarts.
Overhead in convergence progress (loss units): the loss drop that had to be recomputed after
each failure, L(last checkpoint) - L(failure point), plus the loss drop forgone during stalls,
|dL/dt| x stall time, at the point of the stall. It weights early waste more: COCI's premise.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from scipy.special import gamma as gamma_fn

from coci_hpc.errors import PlannerError
from coci_hpc.planner.costs import Costs


class Curve(Protocol):
    def loss(self, t): ...
    def rate(self, t): ...


class InterpolatedCurve:
    """A recorded loss curve made monotone (running minimum of a moving average), linearly
    interpolated; beyond the last sample it stays at the last value (no extrapolated progress)."""

    def __init__(self, times: Sequence[float], losses: Sequence[float], smooth: int = 5) -> None:
        t = np.asarray(times, dtype=float)
        y = np.asarray(losses, dtype=float)
        ok = np.isfinite(t) & np.isfinite(y)
        t, y = t[ok], y[ok]
        order = np.argsort(t)
        t, y = t[order], y[order]
        if t.size < 2:
            raise PlannerError("a recorded curve needs at least 2 samples")
        if smooth > 1 and y.size > smooth:
            k = np.ones(smooth) / smooth
            pad = np.concatenate([np.full(smooth // 2, y[0]), y, np.full(smooth - 1 - smooth // 2, y[-1])])
            y = np.convolve(pad, k, mode="valid")
        self.t = t
        self.y = np.minimum.accumulate(y)
        dt = np.diff(self.t)
        self._slope = np.where(dt > 0, -np.diff(self.y) / np.where(dt > 0, dt, 1.0), 0.0)

    def loss(self, t):
        return np.interp(t, self.t, self.y)

    def rate(self, t):
        idx = np.clip(np.searchsorted(self.t, t, side="right") - 1, 0, self._slope.size - 1)
        r = self._slope[idx]
        return np.where(np.asarray(t) >= self.t[-1], 0.0, r)


@dataclass(frozen=True)
class RunResult:
    wall_s: float
    stop_s: float
    ckpt_s: float          # completed + interrupted checkpoint stalls
    lost_s: float          # recomputed work
    restart_s: float
    n_failures: int
    n_ckpts: int
    progress_ckpt: float
    progress_lost: float
    progress_restart: float
    finished: bool = True

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.stop_s

    @property
    def overhead_progress(self) -> float:
        return self.progress_ckpt + self.progress_lost + self.progress_restart


def run_one(ckpt_times: Sequence[float] | np.ndarray, stop_s: float, failures: np.ndarray,
            costs: Costs, curve: Curve | None = None, trace_until_s: float = math.inf
            ) -> RunResult:
    """One job: plan ``ckpt_times`` (training time, sorted), useful work ``stop_s``, failure
    wall-clock times ``failures`` (sorted, since job start, valid up to ``trace_until_s``:
    a run still going past it is reported as not finished)."""
    ts, tr = costs.ckpt_s, costs.restart_s
    c = np.asarray(ckpt_times, dtype=float)
    c = c[(c > 0) & (c < stop_s)]
    n = c.size
    g = c + ts * np.arange(1, n + 1)          # completion wall time of ckpt j from a clean start
    if curve is not None:
        rc = np.concatenate([[0.0], np.cumsum(np.asarray(curve.rate(c), dtype=float) * ts)])
        loss = lambda x: float(curve.loss(x))     # noqa: E731
        rate = lambda x: float(curve.rate(x))     # noqa: E731
    else:
        rc = np.zeros(n + 1)
        loss = rate = lambda x: 0.0               # noqa: E731
    w, p0, j0, fi = 0.0, 0.0, 0, 0
    ck = lost = rs = pk = pl = pr = 0.0
    nf = ncomp = 0
    nfail_total = failures.size
    while True:
        offset = w - p0 - ts * j0
        finish = offset + stop_s + ts * n
        f = failures[fi] if fi < nfail_total else math.inf
        if f >= finish:
            ck += ts * (n - j0)
            ncomp += n - j0
            pk += rc[n] - rc[j0]
            w = finish
            break
        # checkpoints completed before the failure
        j1 = max(j0, int(np.searchsorted(g, f - offset, side="right")))
        ck += ts * (j1 - j0)
        ncomp += j1 - j0
        pk += rc[j1] - rc[j0]
        w_last = offset + g[j1 - 1] if j1 > j0 else w
        p_last = c[j1 - 1] if j1 > 0 else 0.0
        p_last = p_last if j1 > j0 else p0
        e = f - w_last
        seg = (c[j1] if j1 < n else stop_s) - p_last
        if e <= seg:
            x_fail, partial = p_last + e, 0.0
        else:                                     # died while writing checkpoint j1
            x_fail, partial = c[j1], e - seg
        lost += x_fail - p_last
        ck += partial
        pl += loss(p_last) - loss(x_fail)
        pk += rate(x_fail) * partial
        nf += 1
        fi += 1
        w = f + tr
        while fi < nfail_total and failures[fi] < w:     # failed again while restarting
            nf += 1
            w = failures[fi] + tr
            fi += 1
        rs += w - f
        pr += rate(p_last) * (w - f)
        p0, j0 = p_last, j1
    finished = w <= trace_until_s
    return RunResult(w, stop_s, ck, lost, rs, nf, ncomp, pk, pl, pr, bool(finished))


@dataclass(frozen=True)
class Scenario:
    """Common random numbers: failure traces and stop points shared by every policy."""

    traces: tuple[np.ndarray, ...]
    stops: np.ndarray
    horizon_s: float
    termination: str
    job_rate: float
    weibull_shape: float | None = None
    trace_until_s: float = math.inf


def sample_trace(rng: np.random.Generator, job_rate: float, until_s: float,
                 weibull_shape: float | None = None) -> np.ndarray:
    """Failure times of a renewal process with mean gap 1/job_rate (exponential or Weibull)."""
    mean = 1.0 / job_rate
    out: list[np.ndarray] = []
    t = 0.0
    batch = max(16, int(until_s * job_rate * 1.5) + 16)
    while t < until_s:
        if weibull_shape is None:
            gaps = rng.exponential(mean, batch)
        else:
            scale = mean / gamma_fn(1.0 + 1.0 / weibull_shape)
            gaps = scale * rng.weibull(weibull_shape, batch)
        times = t + np.cumsum(gaps)
        out.append(times)
        t = float(times[-1])
    allt = np.concatenate(out)
    return allt[allt <= until_s]


def replay_trace(recorded_s: Sequence[float], period_s: float, offset_s: float,
                 until_s: float) -> np.ndarray:
    """A recorded failure history (seconds within a window of ``period_s``), replayed cyclically
    from ``offset_s`` so runs see the cluster's real pattern of gaps."""
    rec = np.sort(np.mod(np.asarray(recorded_s, dtype=float), period_s))
    if rec.size == 0:
        return np.empty(0)
    shifted = np.sort(np.mod(rec - offset_s, period_s))
    reps = int(math.ceil(until_s / period_s)) + 1
    allt = (shifted[None, :] + period_s * np.arange(reps)[:, None]).ravel()
    return allt[allt <= until_s]


def make_scenario(job_rate: float, horizon_s: float, n_runs: int, seed: int = 0, *,
                  termination: str = "complete", min_fraction: float = 0.02,
                  weibull_shape: float | None = None,
                  recorded: tuple[Sequence[float], float] | None = None,
                  trace_factor: float = 3.0) -> Scenario:
    """``termination``: "complete" (every run reaches the horizon) or "exploratory" (stopped
    after a log-uniform fraction in [min_fraction, 1] of the horizon). ``recorded`` =
    (failure times, window length) replays a real history instead of sampling the model.
    Traces cover ``trace_factor`` x the horizon of wall time; a run that needs longer (over
    200% overhead) is reported as unfinished rather than silently given a failure-free tail."""
    if termination not in ("complete", "exploratory"):
        raise PlannerError(f"unknown termination {termination!r}", hint="complete or exploratory")
    rng = np.random.default_rng(seed)
    if termination == "complete":
        stops = np.full(n_runs, float(horizon_s))
    else:
        stops = horizon_s * np.exp(rng.uniform(math.log(min_fraction), 0.0, n_runs))
    until = trace_factor * horizon_s + 50.0 / job_rate
    traces = []
    for _ in range(n_runs):
        if recorded is not None:
            times, period = recorded
            traces.append(replay_trace(times, period, rng.uniform(0, period), until))
        else:
            traces.append(sample_trace(rng, job_rate, until, weibull_shape))
    return Scenario(tuple(traces), stops, float(horizon_s), termination, job_rate, weibull_shape,
                    until)


@dataclass(frozen=True)
class Summary:
    policy: str
    n_runs: int
    overhead_s: float             # mean over runs
    overhead_fraction: float      # mean overhead / mean useful work
    ckpt_s: float
    lost_s: float
    restart_s: float
    overhead_progress: float      # mean lost loss-drop, loss units (nan without a curve)
    progress_fraction: float      # / mean loss drop achieved by the runs
    n_ckpts: float
    n_failures: float
    unfinished: int
    per_run_s: np.ndarray | None = field(repr=False, compare=False, default=None)
    per_run_progress: np.ndarray | None = field(repr=False, compare=False, default=None)

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in self.__dict__.items() if not k.startswith("per_run")}


def evaluate(plans: dict[str, Sequence[float]], scenario: Scenario, costs: Costs,
             curve: Curve | None = None) -> dict[str, Summary]:
    """Run every plan on every (trace, stop) of ``scenario``."""
    out: dict[str, Summary] = {}
    achieved = None
    if curve is not None:
        achieved = float(np.mean([float(curve.loss(0.0)) - float(curve.loss(s))
                                  for s in scenario.stops]))
    for name, plan_times in plans.items():
        times = np.sort(np.asarray(plan_times, dtype=float))
        rr = [run_one(times, float(s), tr, costs, curve, scenario.trace_until_s)
              for s, tr in zip(scenario.stops, scenario.traces)]
        ov = np.array([r.overhead_s for r in rr])
        pg = np.array([r.overhead_progress for r in rr]) if curve is not None else np.full(len(rr), np.nan)
        work = float(np.mean(scenario.stops))
        out[name] = Summary(
            policy=name, n_runs=len(rr), overhead_s=float(ov.mean()),
            overhead_fraction=float(ov.mean() / work),
            ckpt_s=float(np.mean([r.ckpt_s for r in rr])),
            lost_s=float(np.mean([r.lost_s for r in rr])),
            restart_s=float(np.mean([r.restart_s for r in rr])),
            overhead_progress=float(pg.mean()),
            progress_fraction=float(pg.mean() / achieved) if achieved else math.nan,
            n_ckpts=float(np.mean([r.n_ckpts for r in rr])),
            n_failures=float(np.mean([r.n_failures for r in rr])),
            unfinished=int(sum(not r.finished for r in rr)),
            per_run_s=ov, per_run_progress=pg)
    return out


def ratio(a: Summary, b: Summary, metric: str = "progress") -> float:
    """Mean overhead of ``a`` over that of ``b`` on the same runs."""
    if metric == "progress":
        return a.overhead_progress / b.overhead_progress if b.overhead_progress else math.nan
    return a.overhead_s / b.overhead_s if b.overhead_s else math.nan


# -- re-planning runs: asynchronous saves, time since failure, node-level traces ------------------

Replanner = Callable[[float, float, "float | None"], Sequence[float]]
"""(progress now, work left, wall time since the last failure or None) -> checkpoint targets
(absolute progress values, sorted). Called at the start and after every restart."""


def run_adaptive(planner: Replanner, work_s: float, failures: np.ndarray, costs: Costs,
                 trace_until_s: float = math.inf, age0_s: float | None = None,
                 covered: np.ndarray | None = None, covered_lost_s: float = 0.0,
                 covered_save_s: float = 0.0) -> RunResult:
    """One job that re-plans after every restart, with asynchronous saves.

    A save blocks training for Tb (``costs.ckpt_s``), then persists for P (``persist_s``) in the
    background: only a persisted save can be restored, and the next save waits for the previous
    one to persist (the wait is a stall). A failure costs Tr of restart (again if it fails during
    the restart) and rolls back to the last persisted save. ``age0_s``: time since the last
    failure at the job's start (None: unknown, stationary).

    Survivors' saves: ``covered[i]`` marks failure i as one the survivors' save handles (a lost
    rank or node in data-parallel training). It loses at most ``covered_lost_s`` of work (the
    step in progress) instead of everything since the last persisted save, and costs
    ``covered_save_s`` (the survivors writing) before the restart Tr. None: no failure is covered
    (the same run as without the argument)."""
    tb, tp, tr = costs.ckpt_s, costs.persist_s, costs.restart_s
    w = p = safe = 0.0
    pend: float | None = None                    # progress of a save still persisting
    pend_done = 0.0                              # ... and the wall time it is persisted
    fi, nfail_total = 0, failures.size
    ck = lost = rs = 0.0
    nf = ncomp = 0
    plan = [x for x in planner(0.0, work_s, age0_s) if 0.0 < x < work_s]
    k = 0
    while True:
        f = failures[fi] if fi < nfail_total else math.inf
        target = plan[k] if k < len(plan) else work_s
        reach = w + (target - p)
        hit = covered is not None and fi < nfail_total and bool(covered[fi])
        if f < reach:                                     # failed while computing
            if pend is not None and pend_done <= f:
                safe = pend
            x = p + (f - w)
            if hit:                                       # the survivors save the last finished step
                safe = max(safe, x - covered_lost_s)
            lost += x - safe
        else:
            w, p = reach, target
            if target >= work_s:
                break
            start = max(w, pend_done) if pend is not None else w
            if f >= start + tb:                           # the save's blocking part completes
                if pend is not None:
                    safe = pend
                ck += start + tb - w
                w = start + tb
                ncomp += 1
                if tp > 0:
                    pend, pend_done = p, w + tp
                else:
                    safe, pend = p, None
                k += 1
                continue
            ck += f - w                                   # failed waiting for it or during it
            if pend is not None and pend_done <= f:
                safe = pend
            if hit:                                       # at a step boundary: nothing lost
                safe = p
            lost += p - safe
        # the failure at f: restart (again if it fails during the restart), roll back
        nf += 1
        fi += 1
        w = f + (covered_save_s if hit else 0.0) + tr
        last = f
        while fi < nfail_total and failures[fi] < w:
            nf += 1
            last = failures[fi]
            w = last + tr
            fi += 1
        rs += w - f
        p, pend = safe, None
        plan = [x for x in planner(p, work_s - p, w - last) if p < x < work_s]
        k = 0
    return RunResult(w, work_s, ck, lost, rs, nf, ncomp, 0.0, 0.0, 0.0, w <= trace_until_s)


def node_traces(rng: np.random.Generator, per_node_rate: float, nodes: int, until_s: float,
                weibull_shape: float | None = None) -> np.ndarray:
    """Failure times a job on ``nodes`` nodes sees: the superposition of one renewal process per
    node (exponential or Weibull gaps of mean 1/per_node_rate), each observed from a random
    point of its stationary life (a burn-in of 30 mean gaps), so that a node that just failed
    is fresh and the others are not."""
    mean = 1.0 / per_node_rate
    burn = 30.0 * mean
    out = []
    for _ in range(nodes):
        t = sample_trace(rng, per_node_rate, burn + until_s, weibull_shape) - burn
        out.append(t[t > 0])
    return np.sort(np.concatenate(out)) if out else np.empty(0)


def overhead_adaptive(planners: dict[str, Replanner], traces: Sequence[np.ndarray],
                      work_s: float, costs: Costs, trace_until_s: float = math.inf,
                      ages: Sequence[float | None] | None = None,
                      covered: Sequence[np.ndarray] | None = None, covered_lost_s: float = 0.0,
                      covered_save_s: float = 0.0) -> dict[str, np.ndarray]:
    """Wall-time overhead (wall - work) of every planner on every trace (the same traces, and
    the same failures covered by survivors' saves: :func:`covered_flags`)."""
    ages = list(ages) if ages is not None else [None] * len(traces)
    cov: list[np.ndarray | None] = list(covered) if covered is not None else [None] * len(traces)
    return {name: np.array([run_adaptive(pl, work_s, tr, costs, trace_until_s, a, c, covered_lost_s,
                                         covered_save_s).overhead_s
                            for tr, a, c in zip(traces, ages, cov)])
            for name, pl in planners.items()}


def covered_flags(rng: np.random.Generator, traces: Sequence[np.ndarray], coverage: float) -> list[np.ndarray]:
    """Which failures of each trace a survivors' save covers: each independently with probability
    ``coverage`` (common random numbers: every policy sees the same ones). Draw them from an
    rng of their own, so the traces do not change with the coverage."""
    return [rng.random(t.size) < coverage for t in traces]


SIM_RUNS = 300
SIM_SEED = 20250101


def mean_interval(x: np.ndarray, confidence: float) -> list[float] | None:
    """The ``confidence`` interval of the mean of ``x`` (normal approximation; runs are independent)."""
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if x.size < 2:
        return None
    from statistics import NormalDist
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return [float(x.mean() - half), float(x.mean() + half)]


def expected_overhead(plans: dict[str, Sequence[float]], job_rate: float, horizon_s: float,
                      costs: Costs, curve: Curve | None = None, *, seed: int = SIM_SEED,
                      max_runs: int = SIM_RUNS, confidence: float = 0.9) -> tuple[dict, dict]:
    """Every plan (checkpoint times relative to now) on the same simulated traces, for jobs that
    complete the horizon and for exploratory jobs stopped early. Returns (per plan, info).

    The first plan is the reference: each plan's ``complete`` overhead gets the ``confidence``
    interval of its mean over the simulated runs (``time_s_interval``) and of its difference to
    the reference on the same runs (``vs_reference_s``, paired, so much tighter than the two
    intervals): an interval that holds 0 means the simulation cannot tell the two apart."""
    info: dict = {"seed": seed, "exploratory_stop": "log-uniform in [2%, 100%] of the horizon"}
    if job_rate * (costs.ckpt_s + costs.restart_s) > 0.5:
        note = (f"job MTBF {1 / job_rate:.3g} s is not much longer than Ts + Tr = "
                f"{costs.ckpt_s + costs.restart_s:.3g} s: the job can hardly make progress under "
                "any schedule; simulation skipped")
        info.update(runs=0, note=note)
        return ({n: {"time_s": None, "time_fraction": None, "progress_loss": None,
                     "n_checkpoints": len(p), "note": note} for n, p in plans.items()}, info)
    # Bound the work: about 2e5 simulated failures in all, at least 20 runs.
    runs = int(min(max_runs, max(20, 2e5 / max(1.0, job_rate * horizon_s))))
    info["runs"] = runs
    overhead: dict = {}
    per_run: dict[str, np.ndarray] = {}
    for term in ("complete", "exploratory"):
        sc = make_scenario(job_rate, horizon_s, runs, seed, termination=term)
        for n, s in evaluate(plans, sc, costs, curve).items():
            overhead.setdefault(n, {})[term] = s.to_dict()
            if term == "complete" and s.per_run_s is not None:
                per_run[n] = s.per_run_s
    ref = next(iter(plans), None)
    info["confidence"] = confidence
    info["reference"] = ref
    out = {}
    for n, o in overhead.items():
        runs_n = per_run.get(n)
        diff = (runs_n - per_run[ref]) if runs_n is not None and ref in per_run and n != ref else None
        out[n] = {"time_s": o["complete"]["overhead_s"],
                  "time_s_interval": None if runs_n is None else mean_interval(runs_n, confidence),
                  "vs_reference_s": None if diff is None else mean_interval(diff, confidence),
                  "time_fraction": o["complete"]["overhead_fraction"],
                  "progress_loss": o["complete"]["overhead_progress"],
                  "n_checkpoints": len(plans[n]),
                  "complete": o["complete"], "exploratory": o["exploratory"]}
    return out, info
