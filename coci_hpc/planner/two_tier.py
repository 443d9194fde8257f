"""Two checkpoint tiers: partner copies in memory every ``k`` steps, disk saves every ``K * k``.

Pure: numbers in (costs, the job's incident rate and how often an incident takes a rank and its
partner), a frozen :class:`TwoTierPlan` out. The model and what the simulator adds are described
in docs/explanation/two-tier-planner.md.

First order (Benoit, Cavelan, Le Fevre, Robert, Sun, "Towards Optimal Multi-Level
Checkpointing", IEEE TC 2017), with T the memory interval (training seconds) and a disk save
at every K-th memory checkpoint (a disk point also takes the memory copy)::

    waste(T, K) = (Cm + Cd / K) / T + lm (T / 2 + Rm) + ld (K T / 2 + Rd)

``lm``: incidents the memory tier serves (the lost ranks' partners survived), ``ld``: incidents
that take a rank and its partner and fall back to disk. For a given K the optimum is
T = sqrt((Cm + Cd/K) / (lm/2 + ld K/2)); K is enumerated (the "does the level pay" decision of
the paper's dynamic program, for two levels). Disk alone: Cd / T + (lm + ld) (T / 2 + Rd).
The candidates are then run in the two-tier simulator (failures during checkpoints and
restarts, a second failure during a memory recovery, :mod:`coci_hpc.planner.two_tier_sim`)
together with Daly's disk-only plan, and the plan is the one that wasted least there: never
worse than Daly on the planner's own simulation.

The incident profile comes from the history's current regime (:func:`regime_start`: Poisson
change points in the rate of incidents and of multi-node incidents), not the whole history.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from coci_hpc.errors import PlannerError
from coci_hpc.planner import two_tier_sim as tsim
from coci_hpc.planner.policies import daly_interval

MAX_K = 100_000          # disk every at most this many memory checkpoints


@dataclass(frozen=True)
class TierCosts:
    """Seconds. ``mem_ckpt_s``: what one partner copy blocks training for (its unoverlapped
    part); ``disk_ckpt_s``: the blocking disk save; ``mem_restart_s``: recovery from the memory
    tier (survivors' save + restart, in place or through the queue + restore);
    ``disk_restart_s``: recovery from the disk tier (requeue + restore); ``step_time_s``: one
    training step (intervals are whole steps)."""

    mem_ckpt_s: float
    disk_ckpt_s: float
    mem_restart_s: float
    disk_restart_s: float
    step_time_s: float

    def __post_init__(self) -> None:
        for name in ("mem_ckpt_s", "disk_ckpt_s", "mem_restart_s", "disk_restart_s", "step_time_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PlannerError(f"{name} must be a finite number >= 0, got {v!r}",
                                   hint="give measured seconds, e.g. --memory-copy-s 0.8")
        if self.disk_ckpt_s <= 0:
            raise PlannerError("the disk save cost must be > 0 seconds",
                               hint="pass the measured blocking time of one save (--ckpt-cost)")
        if self.step_time_s <= 0:
            raise PlannerError("the two-tier plan needs the step time (> 0 seconds)",
                               hint="pass --step-time or a profile with step_time_s")

    def to_dict(self) -> dict:
        return asdict(self)


# -- which incidents the memory tier survives -----------------------------------------------------

def ring_partner_loss(hit: int, nodes: int) -> float:
    """P(some rank and its partner are both lost) when ``hit`` of the job's ``nodes`` nodes fail
    at random and node i's partner is node i+1 (mod nodes): 1 - P(no two hit nodes adjacent on
    the ring) = 1 - n / (n - j) * C(n - j, j) / C(n, j)."""
    n, j = int(nodes), int(hit)
    if j <= 0:
        return 0.0
    if n < 2 or 2 * j > n:
        return 1.0
    if j == 1:
        return 0.0
    # C(n-j, j) / C(n, j) as a product, no huge integers
    ratio = math.prod((n - j - i) / (n - i) for i in range(j))
    return float(min(1.0, max(0.0, 1.0 - n / (n - j) * ratio)))


def incident_effect(size: int, machine_nodes: int, nodes: int) -> tuple[float, float]:
    """(P(an incident on ``size`` of ``machine_nodes`` nodes hits the job), P(it takes a rank and
    its partner)) for a job on ``nodes`` nodes placed at random, partners on a ring."""
    from scipy.stats import hypergeom  # not at import: see failures.LRT_CRITICAL
    m = min(int(size), machine_nodes)
    n = min(int(nodes), machine_nodes)
    js = np.arange(0, min(m, n) + 1)
    pj = hypergeom(machine_nodes, m, n).pmf(js)
    p_hit = float(1.0 - pj[0])
    p_loss = float(sum(p * ring_partner_loss(int(j), n) for j, p in zip(js, pj) if j > 0))
    return p_hit, p_loss


@dataclass(frozen=True)
class IncidentProfile:
    """What the planner needs from the history: incidents per second that hit the job, and the
    fraction of those that take a rank and its partner (the memory tier cannot serve them)."""

    job_rate: float
    partner_loss: float
    nodes: int
    note: str = ""
    # failures that end the whole job (planner/whole_job.py): the share of the incidents above
    # that end every rank, and outages per second on top of them; 0 and 0: node failures only
    whole_job_share: float = 0.0
    outage_rate: float = 0.0
    whole_job_note: str = ""

    def __post_init__(self) -> None:
        if not (self.job_rate > 0 and math.isfinite(self.job_rate)):
            raise PlannerError(f"job incident rate must be > 0 per second, got {self.job_rate!r}",
                               hint="give a failure history or --mtbf-hours")
        if not 0.0 <= self.partner_loss <= 1.0:
            raise PlannerError(f"partner-loss probability must be in [0, 1], got {self.partner_loss!r}")
        if not 0.0 <= self.whole_job_share < 1.0:
            raise PlannerError(f"whole-job share must be in [0, 1), got {self.whole_job_share!r}")
        if not (self.outage_rate >= 0.0 and math.isfinite(self.outage_rate)):
            raise PlannerError(f"outage rate must be >= 0 per second, got {self.outage_rate!r}")

    def with_whole_job(self, wj) -> IncidentProfile:
        """This profile with the whole-job model ``wj`` (a :class:`~coci_hpc.planner.whole_job.WholeJob`)."""
        return replace(self, whole_job_share=float(wj.share), outage_rate=float(wj.outage_rate),
                       whole_job_note=wj.describe() + (f" ({wj.note})" if wj.note else ""))

    @property
    def total_rate(self) -> float:
        """Failures per second that hit the job: its incidents and the outages."""
        return self.job_rate + self.outage_rate

    @property
    def mem_rate(self) -> float:
        """Failures the memory tier serves: incidents whose lost ranks' partners survived and
        that did not end the whole job."""
        return self.job_rate * (1.0 - self.partner_loss) * (1.0 - self.whole_job_share)

    @property
    def pair_loss_rate(self) -> float:
        return self.job_rate * self.partner_loss

    @property
    def whole_job_rate(self) -> float:
        """Failures that end the whole job (no partner loss among them): the share of the other
        incidents, and the outages."""
        return self.job_rate * (1.0 - self.partner_loss) * self.whole_job_share + self.outage_rate

    @property
    def disk_rate(self) -> float:
        """Failures that defeat the memory tier: partner losses and whole-job failures."""
        return self.pair_loss_rate + self.whole_job_rate

    @property
    def disk_share(self) -> float:
        """The share of all failures hitting the job that go back to disk."""
        return min(1.0, self.disk_rate / self.total_rate)

    @classmethod
    def from_incidents(cls, sizes: Sequence[int], window_s: float, cluster_nodes: int,
                       nodes: int) -> IncidentProfile:
        """Incidents (their node counts) seen on a cluster of ``cluster_nodes`` over
        ``window_s`` seconds. A job larger than the cluster runs on ceil(n / N) copies of it,
        each with its own incidents at the same rate (the history's only evidence of how
        incidents scale)."""
        if cluster_nodes < 1 or nodes < 1 or not (window_s > 0):
            raise PlannerError("the incident profile needs cluster nodes, job nodes >= 1 and a "
                               "window > 0", hint="check --cluster-nodes, --nodes and the history")
        reps = math.ceil(nodes / cluster_nodes)
        machine = reps * cluster_nodes
        counts: dict[int, int] = {}
        for s in sizes:
            counts[max(1, int(s))] = counts.get(max(1, int(s)), 0) + 1
        hits = losses = 0.0
        for m, c in counts.items():
            ph, pl = incident_effect(m, machine, nodes)
            hits += c * ph
            losses += c * pl
        if hits <= 0:
            # no incident: the Jeffreys prior's half an incident, of one node
            ph, pl = incident_effect(1, machine, nodes)
            hits, losses = 0.5 * ph, 0.5 * pl
        rate = reps * hits / window_s
        note = (f"{sum(counts.values())} incident(s) over {window_s / 3600:.4g} h on "
                f"{cluster_nodes} nodes; a job on {nodes} nodes"
                + (f" (on {reps} copies of the cluster)" if reps > 1 else ""))
        return cls(rate, min(1.0, losses / hits), nodes, note)

    @classmethod
    def from_incident_times(cls, times: Sequence[float], sizes: Sequence[int], t0: float,
                            t1: float, cluster_nodes: int, nodes: int) -> IncidentProfile:
        """:meth:`from_incidents` on the history's current regime (:func:`regime_start`):
        incidents at ``times`` (seconds) with ``sizes`` nodes, seen over [t0, t1]."""
        if len(times) != len(sizes):
            raise PlannerError("incident times and sizes differ in length")
        start = regime_start(times, sizes, t0, t1)
        keep = [s for t, s in zip(times, sizes) if t >= start]
        p = cls.from_incidents(keep, t1 - start, cluster_nodes, nodes)
        if start > t0:
            p = cls(p.job_rate, p.partner_loss, p.nodes,
                    p.note + f"; the last {(t1 - start) / 3600:.4g} h of a {(t1 - t0) / 3600:.4g} h "
                    "history (its current regime: the rates changed before)")
        return p


# -- the current regime of the history -----------------------------------------------------------

REGIME_MIN_FRACTION = 0.1    # a regime spans at least this share of the history's window
REGIME_LEVEL = 0.05          # family-wise: Bonferroni over the candidate splits of one test


def _max_split_lrt(t: np.ndarray, a: float, b: float, min_len: float) -> tuple[float, float, int]:
    """The most likely single change of a Poisson rate on [a, b): (LRT, split time, splits
    tried). Splits at the incidents' times (the incident before or after), each side at least
    ``min_len`` long."""
    t = np.sort(t[(t >= a) & (t < b)])
    n = t.size
    if n < 2:
        return 0.0, a, 0
    s = np.concatenate([t, np.nextafter(t, np.inf)])
    n1 = np.concatenate([np.arange(n), np.arange(1, n + 1)]).astype(float)
    ok = (s - a >= min_len) & (b - s >= min_len)
    s, n1 = s[ok], n1[ok]
    if s.size == 0:
        return 0.0, a, 0
    n2 = n - n1

    def xlog(k: np.ndarray, length: np.ndarray) -> np.ndarray:
        return np.where(k > 0, k * np.log(np.maximum(k, 1.0) / length), 0.0)

    lrt = 2.0 * (xlog(n1, s - a) + xlog(n2, b - s) - n * math.log(n / (b - a)))
    i = int(np.argmax(lrt))
    return float(lrt[i]), float(s[i]), int(s.size)


def regime_start(times: Sequence[float], sizes: Sequence[int], t0: float, t1: float,
                 min_fraction: float = REGIME_MIN_FRACTION, level: float = REGIME_LEVEL) -> float:
    """Where the history's current regime starts: the latest significant change in the rate of
    incidents or in the rate of multi-node incidents (the ones that can take a rank and its
    partner). A failure process is not stationary over years (burn-in, upgrades, a bad batch
    of parts), and a plan is for the next job: it should learn from the regime that job runs
    in. Each test is the likelihood ratio of one Poisson rate against two (the best split),
    significant at ``level`` after Bonferroni over the splits tried; the search repeats on the
    part after each change found. ``t0``, ``t1``: the history's window."""
    from scipy.stats import chi2  # not at import: see failures.LRT_CRITICAL
    if not t1 > t0:
        return t0
    ts = np.asarray(times, dtype=float)
    multi = ts[np.asarray(sizes, dtype=int) >= 2] if ts.size else ts
    min_len = min_fraction * (t1 - t0)
    start = t0
    while True:
        found = []
        for stream in (ts, multi):
            lrt, split, tried = _max_split_lrt(stream, start, t1, min_len)
            if tried and lrt > float(chi2.isf(level / tried, 1)):
                found.append(split)
        if not found:
            return start
        start = max(found)


# -- the first-order model ----------------------------------------------------------------------

def first_order_waste(mem_interval_s: float, k_disk: int | None, costs: TierCosts,
                      mem_rate: float, disk_rate: float) -> float:
    """Waste per second of work. ``k_disk`` None: disk only, every ``mem_interval_s``."""
    t = mem_interval_s
    if k_disk is None:
        lam = mem_rate + disk_rate
        return costs.disk_ckpt_s / t + lam * (t / 2.0 + costs.disk_restart_s)
    return ((costs.mem_ckpt_s + costs.disk_ckpt_s / k_disk) / t
            + mem_rate * (t / 2.0 + costs.mem_restart_s)
            + disk_rate * (k_disk * t / 2.0 + costs.disk_restart_s))


def _opt_t(costs: TierCosts, lm: float, ld: float, k: int) -> float:
    a = costs.mem_ckpt_s + costs.disk_ckpt_s / k
    b = lm / 2.0 + ld * k / 2.0
    return math.sqrt(a / b) if b > 0 else math.inf


def first_order_optimum(costs: TierCosts, mem_rate: float, disk_rate: float,
                        max_k: int = MAX_K) -> tuple[float, int, float]:
    """(T, K, waste) minimizing :func:`first_order_waste` over T > 0 (continuous) and integer
    K in [1, max_k]. waste(K) after optimizing T is 2 sqrt(a b) + const with a b convex in
    K, so the enumeration stops once it rises past the continuous optimum."""
    best = (math.inf, 1, math.inf)
    k_star = math.sqrt(costs.disk_ckpt_s * mem_rate / (costs.mem_ckpt_s * disk_rate)) \
        if costs.mem_ckpt_s > 0 and disk_rate > 0 else float(max_k)
    hi = int(min(max_k, max(2.0, 2.0 * k_star + 2)))
    for k in range(1, hi + 1):
        t = _opt_t(costs, mem_rate, disk_rate, k)
        if not math.isfinite(t):
            continue
        w = first_order_waste(t, k, costs, mem_rate, disk_rate)
        if w < best[2]:
            best = (t, k, w)
    return best


# -- the plan -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TwoTierPlan:
    """``mem_every_steps`` None: the memory tier was dropped (``reason`` says why) and the plan
    is disk only. ``alternatives``: each candidate's expected waste, as a fraction of the work,
    to first order and in the simulator. ``disk_reason``: why the disk interval is what it is
    (the rate of failures it answers)."""

    tier: str                          # "two-tier" or "disk-only"
    mem_every_steps: int | None
    disk_every_steps: int
    reason: str
    costs: TierCosts
    job_rate: float
    partner_loss: float
    alternatives: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    disk_reason: str = ""

    @property
    def mem_interval_s(self) -> float | None:
        m = self.mem_every_steps
        return None if m is None else m * self.costs.step_time_s

    @property
    def disk_interval_s(self) -> float:
        return self.disk_every_steps * self.costs.step_time_s

    def to_dict(self) -> dict:
        return {"tier": self.tier, "mem_every_steps": self.mem_every_steps,
                "disk_every_steps": self.disk_every_steps, "mem_interval_s": self.mem_interval_s,
                "disk_interval_s": self.disk_interval_s, "reason": self.reason,
                "disk_reason": self.disk_reason,
                "job_rate_per_s": self.job_rate, "partner_loss": self.partner_loss,
                "costs": self.costs.to_dict(), "alternatives": dict(self.alternatives),
                "params": dict(self.params)}


def _steps(t: float, step: float) -> int:
    return max(1, int(round(t / step))) if math.isfinite(t) else 1


def daly_steps(costs: TierCosts, job_rate: float) -> int:
    """Daly's disk-only interval in whole steps (restarts through the queue)."""
    return _steps(daly_interval(costs.disk_ckpt_s, 1.0 / job_rate), costs.step_time_s)


def _per_h(rate: float) -> str:
    return f"{rate * 3600:.3g}/h"


def plan_two_tier(costs: TierCosts, profile: IncidentProfile, work_s: float, *, seed: int = 0,
                  check_failures: int = 3000, check_pair_losses: int = 200,
                  max_runs: int = 4000) -> TwoTierPlan:
    """The pair (memory every k steps, disk every D steps, D a multiple of k), or disk only when
    the memory tier does not pay. ``work_s``: the training time the plan is checked over (the
    job's horizon).

    The disk interval answers the failures that defeat the memory tier (partner losses and
    whole-job failures, ``profile.disk_rate``): Daly's interval for that rate, rounded to a
    multiple of k. To first order the two-tier waste is separable,
    ``Cm/T + lm (T/2 + Rm) + Cd/D + ld (D/2 + Rd)``, so the disk interval's optimum does not
    depend on the memory interval. No disk save falls inside the horizon only when that interval
    is past the job's end (or, for a profile without whole-job failures, when no incident takes a
    pair). Memory-interval candidates: the first-order optimum and its neighbours (halved,
    doubled, every step); they and Daly's disk-only plan are simulated on the same exponential
    traces (``check_failures`` failures in all and at least ``check_pair_losses`` of them going
    back to disk, at most ``max_runs`` runs; deterministic in ``seed``) and the least simulated
    waste wins, a memory tier only when it beats Daly beyond the noise (paired 95 % bound)."""
    if not (work_s > 0 and math.isfinite(work_s)):
        raise PlannerError(f"the horizon must be > 0 seconds, got {work_s!r}", hint="e.g. --horizon 24h")
    st = costs.step_time_s
    lm, ld, lam = profile.mem_rate, profile.disk_rate, profile.total_rate
    last = math.ceil(work_s / st)
    cands: dict[str, tuple[int | None, int]] = {}
    fo: dict[str, float] = {}
    daly_k = daly_steps(costs, lam)
    cands["daly"] = (None, daly_k)
    young_k = _steps(math.sqrt(2.0 * costs.disk_ckpt_s / lam), st)
    cands["disk-first-order"] = (None, young_k)
    mem_ok = profile.nodes >= 2 and lm > 0
    why_no_mem = ("the job has one node: a partner on another node is impossible"
                  if profile.nodes < 2 else "every failure takes a rank and its partner or ends the whole job")
    # the disk tier's interval: Daly's for the failures the memory tier does not cover
    disk_t = daly_interval(costs.disk_ckpt_s, 1.0 / ld) if ld > 0 else math.inf
    disk_steps = min(last, _steps(disk_t, st)) if math.isfinite(disk_t) else last
    if mem_ok:
        t, k, _ = first_order_optimum(costs, lm, ld)
        ms = min(_steps(t, st), disk_steps)
        mems = {"two-tier-first-order": ms, "two-tier-k*0.5": _steps(ms * 0.5 * st, st),
                "two-tier-k*2": min(disk_steps, _steps(ms * 2.0 * st, st)), "two-tier-k1": 1}
        for name, mk in mems.items():
            # a multiple of k: the nearest one, or past the end when Daly's interval is
            mult = math.ceil(last / mk) if disk_steps >= last else max(1, int(round(disk_steps / mk)))
            cands[name] = (mk, mk * mult)
    # a disk interval past the horizon means no disk save in it: say so with the horizon
    # (rounded up to whole memory intervals), not with a number of steps no job reaches
    cands = {n: (m, min(d, last if m is None else m * math.ceil(last / m))) for n, (m, d) in cands.items()}
    for name, (m, d) in cands.items():
        if m is None:
            fo[name] = first_order_waste(d * st, None, costs, lm, ld)
        else:
            fo[name] = first_order_waste(m * st, d // m, costs, lm, ld)
    # the simulator check: the same traces for every candidate
    runs = math.ceil(check_failures / (lam * work_s))
    if check_pair_losses and ld > 0:
        # the disk interval's worth is decided by the few failures that go back to disk (0.1-2 %
        # of the incidents on the LANL histories without whole-job failures): enough of those,
        # or the choice is the noise of where a handful of them fell
        runs = max(runs, math.ceil(check_pair_losses / (ld * work_s)))
    runs = int(min(max_runs, max(20, runs)))
    rng = np.random.default_rng(seed)
    traces = tsim.poisson_traces(rng, lam, profile.disk_share, work_s, runs)
    # distinct candidates only (two names may round to the same pair)
    pairs = list(dict.fromkeys(cands.values()))
    per_run = dict(zip(pairs, tsim.simulate_many(pairs, costs, work_s, traces) / work_s))
    sim_by_name = {n: float(per_run[p].mean()) for n, p in cands.items()}
    # Young's disk-only interval is shown, not chosen: between two disk-only intervals Daly's
    # is the better-founded one, and a difference in one simulation is mostly its noise
    best_name = min((n for n in cands if n != "disk-first-order"),
                    key=lambda n: (sim_by_name[n], n != "daly"))
    noise = None
    if best_name != "daly":
        # keep a memory tier only when it beats Daly beyond the simulation's noise (paired runs)
        diff = per_run[cands[best_name]] - per_run[cands["daly"]]
        upper = float(diff.mean() + 1.96 * diff.std(ddof=1) / math.sqrt(diff.size)) if diff.size > 1 else 0.0
        if upper >= 0.0:
            noise, best_name = best_name, "daly"
    m, d = cands[best_name]
    alts = {n: {"mem_every_steps": cands[n][0], "disk_every_steps": cands[n][1],
                "first_order_waste": fo[n], "simulated_waste": sim_by_name[n]} for n in cands}
    params = {"mem_rate_per_s": lm, "disk_rate_per_s": ld, "pair_loss_rate_per_s": profile.pair_loss_rate,
              "whole_job_rate_per_s": profile.whole_job_rate, "whole_job_share": profile.whole_job_share,
              "outage_rate_per_s": profile.outage_rate, "whole_job_note": profile.whole_job_note,
              "disk_daly_steps": None if not math.isfinite(disk_t) else _steps(disk_t, st),
              "chosen": best_name, "check_runs": runs, "seed": seed, "work_s": work_s,
              "profile_note": profile.note}
    if m is None:
        disk_reason = (f"Daly's interval for every failure ({_per_h(lam)}): "
                       "with no memory tier each one goes back to disk")
        if d >= last:
            disk_reason += "; it is past the job's end: no disk save before it"
        if not mem_ok:
            reason = f"memory tier dropped: {why_no_mem}"
        else:
            two = noise or min((n for n in cands if cands[n][0] is not None), key=lambda n: sim_by_name[n])
            reason = (f"memory tier dropped: it does not pay{' beyond the simulation noise' if noise else ''} "
                      f"(best two-tier pair wastes {sim_by_name[two]:.4g} of the work in simulation, "
                      f"Daly's disk only {sim_by_name[best_name]:.4g})")
        return TwoTierPlan("disk-only", None, d, reason, costs, lam, profile.partner_loss, alts, params,
                           disk_reason)
    if ld > 0:
        disk_reason = (f"Daly's interval for the failures the memory tier does not cover, "
                       f"{_per_h(ld)}: partner losses {_per_h(profile.pair_loss_rate)} + whole-job "
                       f"failures {_per_h(profile.whole_job_rate)}")
        if profile.whole_job_note:
            disk_reason += f" ({profile.whole_job_note})"
        if d >= last:
            disk_reason += f"; that interval ({disk_t / 3600:.4g} h) is past the job's end: no disk save before it"
    else:
        disk_reason = ("no failure in the profile defeats the memory tier (no partner loss, no whole-job "
                       "failure): no disk save before the job's end")
    reason = (f"memory tier pays: simulated waste {sim_by_name[best_name]:.4g} of the work vs "
              f"{sim_by_name['daly']:.4g} for Daly's disk-only plan")
    return TwoTierPlan("two-tier", m, d, reason, costs, lam, profile.partner_loss, alts, params, disk_reason)


def profile_from_model(model, nodes: int, window: tuple[float, float] | None = None,
                       whole_job: Mapping[str, Any] | None = None) -> IncidentProfile:
    """The incident profile of a :class:`~coci_hpc.planner.failures.FailureModel`: its
    declustered incidents and their sizes in the history's current regime (``window``: the
    history's (start, end) epoch seconds, when known) when it has them (node events), else its
    rate as one-node incidents (a given MTBF says nothing about sizes); with the whole-job model
    (:func:`coci_hpc.planner.whole_job.resolve`, ``whole_job`` its keyword arguments: the
    values given by settings or options) from what the model learned (its outages) and the
    priors. The outages the model found among its incidents are counted once: as outages, not
    also as incidents."""
    from coci_hpc.planner import whole_job as wjm
    outage_times = set(getattr(model, "outage_times", ()) or ())
    outage_window = getattr(model, "outage_window_s", None)
    learned = None if outage_window is None else (len(outage_times), float(outage_window))
    wj = wjm.resolve(**dict(whole_job or {}), learned_outages=learned)
    n_cl = model.cluster_nodes
    events = [e for e in model.events if e.time_s not in outage_times] if model.events else []
    if model.events and n_cl and model.exposure_node_s > 0:
        span = model.exposure_node_s / n_cl
        all_times = [e.time_s for e in model.events]
        if window is None:
            # the model keeps the window's length, not its ends: taken as ending at the newest
            # incident (a quiet spell at the end then counts as part of the regime before it)
            window = (min(min(all_times), max(all_times) - span), max(all_times))
        sizes = [len(set(e.nodes)) for e in events]
        times = [e.time_s for e in events]
        p = IncidentProfile.from_incident_times(times, sizes, window[0], window[1], n_cl, nodes)
    else:
        p = IncidentProfile(nodes * model.per_node_rate, 0.0, nodes,
                            "no incident sizes known: every incident taken as one node")
    return p.with_whole_job(wj)


def describe(plan: TwoTierPlan) -> list[str]:
    """The plan in a few lines for coci-plan's summary."""
    st = plan.costs.step_time_s
    out = [f"two tiers: {plan.reason}"]
    if plan.mem_every_steps is not None:
        out.append(f"  memory copy every {plan.mem_every_steps} step(s) ({plan.mem_every_steps * st:.4g} s), "
                   f"disk save every {plan.disk_every_steps} step(s) ({plan.disk_interval_s / 3600:.4g} h)")
    else:
        out.append(f"  disk save every {plan.disk_every_steps} step(s) ({plan.disk_interval_s / 3600:.4g} h)")
    if plan.mem_every_steps is not None:
        out.append(f"  memory interval: the simulated best for the failures the memory tier serves "
                   f"({plan.params.get('mem_rate_per_s', 0.0) * 3600:.3g}/h)")
    if plan.disk_reason:
        out.append(f"  disk interval: {plan.disk_reason}")
    out.append(f"  failures hitting the job {plan.job_rate * 3600:.4g}/h, taking a rank and its "
               f"partner {100 * plan.partner_loss:.3g} % of the incidents")
    if plan.params.get("profile_note"):
        out.append(f"  ({plan.params['profile_note']})")
    out.append(f"  {'alternative':22s} {'memory':>7s} {'disk':>8s} {'first order':>12s} {'simulated':>10s}")
    for n, a in plan.alternatives.items():
        m = "-" if a["mem_every_steps"] is None else str(a["mem_every_steps"])
        out.append(f"  {n:22s} {m:>7s} {a['disk_every_steps']:8d} {100 * a['first_order_waste']:11.3f}% "
                   f"{100 * a['simulated_waste']:9.3f}%")
    out.append("  (waste = checkpoint stalls + lost work + restarts, % of the training time)")
    return out
