"""Failure model: failure events -> per-node rate over an exposure window -> job rate.

Exponential (constant rate) by default. A Weibull fit of the gaps between failures is reported
and used when a likelihood-ratio test against the exponential supports it. The rate comes with
an exact (Garwood, chi-square) Poisson confidence interval. With zero failures the point
estimate uses the Jeffreys prior Gamma(1/2, 0): rate = 0.5 / exposure (the posterior mean),
so the planner never divides by zero and says so in ``note``.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from coci_hpc.errors import PlannerError

JEFFREYS_PRIOR_FAILURES = 0.5
# chi2_1's 95 % quantile (scipy.stats.chi2.ppf(0.95, 1); tests/planner check it): Weibull vs
# exponential, one extra parameter. A literal, so that importing this module does not import
# scipy.stats (~2 s, paid by every training rank at start and restart).
LRT_CRITICAL = 3.841458820694124
WEIBULL_MIN_GAPS = 8
MAX_OUTAGE_S = 7 * 86400.0             # older records are never the same failure
MERGE_WINDOW_S = 600.0                   # DRAIN+DOWN of one node, or NODE_FAIL + node DOWN = one failure
SIMULTANEOUS_S = 60.0                    # records starting within a minute: one incident
REPEAT_S = 3600.0                        # same node down again within an hour of repair: one incident


@dataclass(frozen=True)
class FailureEvent:
    """One node failure. ``nodes`` is the expanded node set (one node for node events, the job's
    node list for a NODE_FAIL job record, where Slurm does not say which node died)."""

    nodes: tuple[str, ...]
    time_s: float                 # epoch seconds
    reason: str = ""
    source: str = ""              # "event" (sacctmgr), "sacct" (job record), "trace", ...
    state: str = ""
    job_id: str | None = None
    end_s: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["nodes"] = list(self.nodes)
        return d


def merge_events(events: Iterable[FailureEvent], window_s: float = MERGE_WINDOW_S,
                 adjacent_s: float = 60.0) -> list[FailureEvent]:
    """Collapse records of the same failure on overlapping nodes.

    * two node events are one failure when the second starts while the first is still open
      (or within ``adjacent_s`` of its end), e.g. DOWN then DOWN+DRAIN; with no known end,
      within ``window_s``;
    * a job's NODE_FAIL and a node event are one failure within ``window_s`` (Slurm may end the
      job only after SlurmdTimeout).
    Node events (with a reason) win over job records.
    """
    ordered = sorted(events, key=lambda e: (e.time_s, 0 if e.source == "event" else 1))
    kept: list[FailureEvent] = []
    for ev in ordered:
        dup = None
        for k in reversed(kept):
            if ev.time_s - k.time_s > MAX_OUTAGE_S:
                break
            if ev.time_s - k.time_s > window_s and not (
                    k.source == ev.source == "event" and k.end_s is not None
                    and ev.time_s <= k.end_s + adjacent_s):
                continue
            if not set(ev.nodes) & set(k.nodes):
                continue
            if k.source == ev.source == "event" and k.end_s is not None:
                if ev.time_s <= k.end_s + adjacent_s:
                    dup = k
                    break
                continue
            dup = k
            break
        if dup is None:
            kept.append(ev)
        elif dup.source != "event" and ev.source == "event":
            kept[kept.index(dup)] = ev
    return kept


def decluster(events: Iterable[FailureEvent], simultaneous_s: float = SIMULTANEOUS_S,
              repeat_s: float = REPEAT_S) -> list[FailureEvent]:
    """Group failure records into incidents; one incident is what a job actually suffers once.

    * records that start within ``simultaneous_s`` of an incident's first record are that
      incident, on whatever nodes (a switch, a PDU or a software push takes several nodes down
      in the same minute);
    * a record on a node that was part of an incident and came back less than ``repeat_s`` ago
      (or whose repair time is unknown and started less than ``repeat_s`` ago) is that incident
      again: the repair did not hold, and a job restarted on that node in between is rare.
    An incident keeps its first record's time, reason and state; its nodes are the union.
    """
    ordered = sorted(events, key=lambda e: e.time_s)
    incidents: list[FailureEvent] = []
    last_seen: dict[str, tuple[float, int]] = {}    # node -> (repaired at, incident index)
    for ev in ordered:
        hit = None
        if incidents and ev.time_s - incidents[-1].time_s <= simultaneous_s:
            hit = len(incidents) - 1
        else:
            for n in ev.nodes:
                seen = last_seen.get(n)
                if seen is not None and ev.time_s - seen[0] <= repeat_s:
                    hit = seen[1] if hit is None else max(hit, seen[1])
        if hit is None:
            incidents.append(ev)
            hit = len(incidents) - 1
        else:
            inc = incidents[hit]
            nodes = tuple(dict.fromkeys(inc.nodes + ev.nodes))
            ends = [x for x in (inc.end_s, ev.end_s) if x is not None]
            incidents[hit] = FailureEvent(nodes, inc.time_s, inc.reason, inc.source, inc.state,
                                          inc.job_id, max(ends) if ends else None)
        up = ev.end_s if ev.end_s is not None else ev.time_s
        for n in ev.nodes:
            prev = last_seen.get(n)
            last_seen[n] = (max(up, prev[0]) if prev and prev[1] == hit else up, hit)
    return incidents


def per_node_gaps(events: Iterable[FailureEvent]) -> list[float]:
    """Times between consecutive failures of the same node, pooled over nodes (the hazard a
    restarted job sees on the node that just came back)."""
    by_node: dict[str, list[float]] = {}
    for e in events:
        for n in e.nodes:
            by_node.setdefault(n, []).append(e.time_s)
    gaps: list[float] = []
    for ts in by_node.values():
        gaps.extend(np.diff(sorted(ts)).tolist())
    return gaps


@dataclass(frozen=True)
class WeibullFit:
    shape: float
    scale_s: float
    n_gaps: int
    lrt_stat: float          # 2*(loglik_weibull - loglik_exponential)
    supported: bool          # LRT > chi2_1(0.95) and enough gaps


def fit_weibull(gaps_s: Sequence[float], min_gaps: int = WEIBULL_MIN_GAPS) -> WeibullFit | None:
    """MLE Weibull (location 0) on inter-failure gaps, tested against the exponential."""
    g = np.asarray([x for x in gaps_s if x > 0 and math.isfinite(x)], dtype=float)
    if g.size < 3:
        return None
    from scipy import stats  # here, not at import: see LRT_CRITICAL
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")      # identical gaps: scipy warns, the fit is still defined
        shape, _, scale = stats.weibull_min.fit(g, floc=0)
    ll_w = float(stats.weibull_min.logpdf(g, shape, 0, scale).sum())
    ll_e = float(stats.expon.logpdf(g, 0, g.mean()).sum())
    lrt = max(0.0, 2 * (ll_w - ll_e))
    return WeibullFit(float(shape), float(scale), int(g.size), lrt,
                      bool(g.size >= min_gaps and lrt > LRT_CRITICAL))


def poisson_interval(k: int, exposure: float, confidence: float = 0.9) -> tuple[float, float]:
    """Exact (Garwood) two-sided interval for a Poisson rate: k events over ``exposure``."""
    from scipy import stats
    alpha = 1.0 - confidence
    lo = 0.0 if k == 0 else stats.chi2.ppf(alpha / 2, 2 * k) / (2 * exposure)
    hi = stats.chi2.ppf(1 - alpha / 2, 2 * k + 2) / (2 * exposure)
    return float(lo), float(hi)


@dataclass(frozen=True)
class FailureModel:
    """Per-node failure rate (1/s) with its interval; the job rate for n nodes is n times it."""

    per_node_rate: float
    ci_low: float
    ci_high: float
    confidence: float
    n_failures: int
    exposure_node_s: float
    distribution: str = "exponential"     # or "weibull"
    weibull_shape: float | None = None
    weibull_lrt: float | None = None
    prior: str | None = None              # set when the point estimate came from the prior
    note: str = ""
    events: tuple[FailureEvent, ...] = field(default=(), compare=False)
    n_records: int | None = None          # failure records before declustering (None: not counted)
    weibull_scale_s: float | None = None  # per-node Weibull scale, with weibull_shape
    cluster_nodes: int | None = None      # nodes watched (node events): exposure = this x window
    # Outages that end every job (planner/whole_job.py), found by the Slurm adapter: their times
    # (an outage among ``events`` has the same time) and the window they were looked for in;
    # None: the source could not show them (a given MTBF)
    outage_times: tuple[float, ...] = ()
    outage_window_s: float | None = None

    @property
    def hazard_shape(self) -> float | None:
        """The Weibull shape when the history chose Weibull over the exponential, else None."""
        return self.weibull_shape if self.distribution == "weibull" else None

    def job_rate(self, nodes: int) -> float:
        return nodes * self.per_node_rate

    def incident_job_rate(self, nodes: int) -> float:
        """Incidents per second that touch a job on ``nodes`` nodes placed at random.

        An incident on m of the cluster's N nodes hits such a job with probability
        1 - C(N-m, n) / C(N, n): m/N for one node, 1 for the whole cluster. Counting each
        incident once per node-rate (``job_rate``) undercounts for small jobs (an incident on
        10 nodes is 10 failures for 10 one-node jobs); counting every record overcounts for
        large ones (it is one failure for a job on all 10). Needs the incidents and N (node
        events); otherwise, or with no incident, it is ``job_rate``."""
        n_cl = self.cluster_nodes
        if not n_cl or not self.events or self.exposure_node_s <= 0:
            return self.job_rate(nodes)
        if nodes >= n_cl:
            hits = float(len(self.events))
        else:
            miss = {}
            hits = 0.0
            for e in self.events:
                m = min(len(set(e.nodes)), n_cl)
                if m not in miss:
                    # C(N-m, n) / C(N, n) as a product, no huge integers
                    miss[m] = math.prod((n_cl - m - i) / (n_cl - i) for i in range(nodes)) \
                        if n_cl - m >= nodes else 0.0
                hits += 1.0 - miss[m]
        return hits * n_cl / self.exposure_node_s

    def job_mtbf_s(self, nodes: int) -> float:
        return 1.0 / self.job_rate(nodes)

    def job_mtbf_interval_s(self, nodes: int) -> tuple[float, float]:
        """(low, high) job MTBF; high is inf when the rate's lower bound is 0."""
        lo_rate, hi_rate = nodes * self.ci_low, nodes * self.ci_high
        return (1.0 / hi_rate, math.inf if lo_rate == 0 else 1.0 / lo_rate)

    def to_dict(self, nodes: int | None = None) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "events"}
        d["outage_times"] = list(self.outage_times)
        d["per_node_mtbf_hours"] = 1.0 / self.per_node_rate / 3600.0
        d["events"] = [e.to_dict() for e in self.events]
        if nodes is not None:
            lo, hi = self.job_mtbf_interval_s(nodes)
            d["nodes"] = nodes
            d["job_mtbf_hours"] = self.job_mtbf_s(nodes) / 3600.0
            d["job_mtbf_hours_interval"] = [lo / 3600.0, None if math.isinf(hi) else hi / 3600.0]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> FailureModel:
        evs = tuple(FailureEvent(nodes=tuple(e["nodes"]), time_s=float(e["time_s"]),
                                 reason=e.get("reason", ""), source=e.get("source", ""),
                                 state=e.get("state", ""), job_id=e.get("job_id"),
                                 end_s=e.get("end_s")) for e in d.get("events", []))
        keys = ("per_node_rate", "ci_low", "ci_high", "confidence", "n_failures",
                "exposure_node_s", "distribution", "weibull_shape", "weibull_lrt", "prior", "note",
                "n_records", "weibull_scale_s", "cluster_nodes", "outage_window_s")
        return cls(**{k: d[k] for k in keys if k in d}, events=evs,
                   outage_times=tuple(float(t) for t in d.get("outage_times") or ()))


def from_mtbf(mtbf_node_s: float) -> FailureModel:
    """A model from a given per-node MTBF (no data: the interval is the point)."""
    if not (mtbf_node_s > 0 and math.isfinite(mtbf_node_s)):
        raise PlannerError(f"MTBF must be a positive number of seconds, got {mtbf_node_s!r}",
                           hint="pass --mtbf-hours as a positive number (per node)")
    r = 1.0 / mtbf_node_s
    return FailureModel(r, r, r, 1.0, 0, 0.0, note="MTBF given by the user (no interval)")


def estimate(events: Sequence[FailureEvent], exposure_node_s: float, *, confidence: float = 0.9,
             weibull_min_gaps: int = WEIBULL_MIN_GAPS, basis: str = "",
             n_records: int | None = None, cluster_nodes: int | None = None) -> FailureModel:
    """Per-node failure rate from ``events`` (incidents) seen over ``exposure_node_s``
    node-seconds. The Weibull fit uses the gaps between failures of the same node.

    ``basis`` is a human phrase for how the exposure was counted (goes into ``note``);
    ``n_records`` the number of records the incidents were declustered from.
    """
    if not (exposure_node_s > 0 and math.isfinite(exposure_node_s)):
        raise PlannerError("the failure history covers no exposure time (0 node-seconds)",
                           hint="widen the window (--since) or pass --mtbf-hours")
    k = len(events)
    lo, hi = poisson_interval(k, exposure_node_s, confidence)
    hours = exposure_node_s / 3600.0
    prior = None
    if k == 0:
        rate = JEFFREYS_PRIOR_FAILURES / exposure_node_s
        prior = "jeffreys"
        note = (f"no failures in {hours:.4g} node-hours; using the Jeffreys prior "
                f"(rate = 0.5 / exposure, per-node MTBF {2 * hours:.4g} h): treat as a lower bound "
                f"on the true MTBF's uncertainty")
    else:
        rate = k / exposure_node_s
        note = f"{k} failure(s) in {hours:.4g} node-hours"
    if basis:
        note += f" ({basis})"
    if n_records is not None and n_records != k:
        note += f" ({n_records} record(s) declustered into {k} incident(s))"
    gaps = per_node_gaps(events)
    wb = fit_weibull(gaps, weibull_min_gaps) if len(gaps) >= 3 else None
    dist, shape, lrt, wscale = "exponential", None, None, None
    if wb is not None:
        shape, lrt, wscale = wb.shape, wb.lrt_stat, wb.scale_s
        if wb.supported:
            dist = "weibull"
            note += f"; Weibull shape {wb.shape:.3g} preferred over exponential (LRT {wb.lrt_stat:.3g})"
        else:
            note += f"; Weibull shape {wb.shape:.3g} not significantly different from 1"
    return FailureModel(rate, lo, hi, confidence, k, float(exposure_node_s), dist, shape, lrt,
                        prior, note, tuple(events), n_records, wscale, cluster_nodes)
