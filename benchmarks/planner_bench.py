"""The default policy (`coci`) against Daly and Young: wall-time overhead on the same traces.

Every policy re-plans after each restart (coci_hpc.planner.simulator.run_adaptive) and is run on
the SAME failure traces (common random numbers). Overhead = wall time - useful work
(checkpoint stalls + recomputed work + restarts). A ratio is mean(default) / mean(baseline) over
the runs of one setting; each key is the geometric mean of the ratios over its grid.

Grids (Tr = 150 s everywhere):
  exponential  Poisson failures; nodes 1, 8, 64 x per-node MTBF 100 h, 1000 h x Tb 10 s, 120 s
               x job 12 h, 72 h (24 settings); the default knows the true rate, as Daly does.
  weibull      per-node renewal processes, Weibull shape 0.5 and 0.7, nodes 1, 2, 4, ..., 64,
               per-node MTBF 24 h, Tb 30 s, job 24 h; the job's trace is the superposition of
               its nodes' processes seen from a stationary point (a node that failed is fresh).
               Both policies know the mean rate; the default also the shape and the time since
               the last failure (it learns it from the restart).
  async        Tb 1 s, 5 s x persist P 30, 120, 600 s x job MTBF 2 h, 12 h, job 24 h, Poisson;
               baseline: Young fed Tb + P (what timing a whole save gives).
  replay       real histories (sacctmgr event format): the rate is learned from the first half
               of the file, jobs of 1, 4, 16, 64 nodes (at most the cluster's) start at random
               times of the second half on random nodes and see that history's records on
               their nodes. Daly uses the raw record rate; the default the declustered incident
               rate, the fitted per-node Weibull shape and the time since its nodes' last
               failure (PlanContext.from_model: the incidents a job on n of the N nodes is
               hit by; Daly's plan when the learning half holds < 150 incidents). Job 72 h,
               Tb 120 s. Each history also in sparse versions (sparse_histories): thinned to
               and cut to a window of 40 and 150 records in the learning half. Per setting:
               the paired ratio of means over the same traces with a 95 % interval (delta
               method); _worst is the largest ratio over all replay settings, the geomean key
               covers the histories as given, _sparse the sparse versions.
  paper        the published equal-loss-drop rule (coci-paper) vs Daly on the exponential grid
               with a power-law loss curve (reported, no goal).
  two_tier     (not in the default --only) memory + disk checkpoints: the two-tier planner vs
               Daly's disk-only plan, Orbax's default (10 / 1000 steps), memory every step +
               Daly, and the best fixed pair found on the replay itself (benchmarks/
               two_tier_grid.py; docs/benchmarks/planner-two-tier.md).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace

import numpy as np

from coci_hpc.planner import simulator as sim
from coci_hpc.planner.convergence import fit_curve
from coci_hpc.planner.costs import DEFAULT_RESTART_S as RESTART_S
from coci_hpc.planner.costs import Costs
from coci_hpc.planner.policies import PlanContext, make_policy
from coci_hpc.slurm import accounting as acct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import two_tier_grid  # noqa: E402  (a sibling module: the two-tier grid)

HERE = os.path.dirname(os.path.abspath(__file__))
LANL = [("lanl_system2_events.txt", 49), ("lanl_system16_events.txt", 16),
        ("lanl_system23_events.txt", 5)]          # nodes in each system (the data's README)
SPARSE_RECORDS = (40, 150)     # records in the learning half of each sparse version
GOALS = {"default_vs_daly_exponential": 1.01, "default_vs_daly_exponential_worst": 1.02,
         "default_vs_daly_weibull": 0.98, "default_vs_daly_replay": 0.95,
         "default_vs_daly_replay_worst": 1.02,
         "default_vs_young_async": 0.6}


def gmean(v) -> float:
    v = [x for x in v if x > 0 and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(v)))) if v else math.nan


def replanner(spec: str, ctx: PlanContext, use_age: bool = True):
    pol = make_policy(spec)
    cache: dict = {}

    def plan(p: float, rem: float, age: float | None):
        key = (round(p, 6), round(rem, 6), None if age is None or not use_age else round(age, 3))
        if key not in cache:
            if len(cache) > 4096:
                cache.clear()
            c = replace(ctx, t_now=p, horizon_s=rem, time_since_failure_s=key[2])
            cache[key] = pol.plan(c).times
        return cache[key]
    return plan


def runs_for(runs: int, rate: float, work_s: float, max_runs: int = 20000) -> int:
    """At least ~2000 failures per setting where failures are rare: otherwise one unlucky
    failure decides a ratio that the checkpoint stalls alone would fix."""
    return int(min(max(runs, math.ceil(2000.0 / (rate * work_s))), max(runs, max_runs)))


def ratio(res: dict, a: str, b: str) -> float:
    return float(res[a].mean() / res[b].mean())


def grid_exponential(runs: int, seed: int, coverage: float = 0.0, step_s: float = 1.0) -> list[dict]:
    """``coverage`` > 0: that share of the failures is covered by survivors' saves (each loses
    ``step_s`` of work instead of the work since the last save; the simulator draws which, the
    same for both policies); the default knows the share (PlanContext.survivor_coverage), Daly
    does not. 0: the grid as it always was (same traces, same rows)."""
    rows = []
    for nodes in (1, 8, 64):
        for mtbf_h in (100.0, 1000.0):
            for tb in (10.0, 120.0):
                for job_h in (12.0, 72.0):
                    lam, w = nodes / (mtbf_h * 3600), job_h * 3600
                    costs = Costs(tb, RESTART_S)
                    ctx = PlanContext(costs, lam, w, nodes=nodes)
                    rng = np.random.default_rng(seed)
                    until = 3 * w + 50 / lam
                    traces = [sim.sample_trace(rng, lam, until)
                              for _ in range(runs_for(runs, lam, w))]
                    flags = None
                    if coverage > 0:
                        flags = sim.covered_flags(np.random.default_rng(seed + 1), traces, coverage)
                    res = sim.overhead_adaptive({"coci": replanner("coci", replace(ctx, survivor_coverage=coverage)),
                                                 "daly": replanner("daly", ctx)},
                                                traces, w, costs, until, covered=flags, covered_lost_s=step_s)
                    rows.append({"nodes": nodes, "mtbf_node_h": mtbf_h, "tb_s": tb, "job_h": job_h,
                                 "runs": len(traces),
                                 "coci_s": res["coci"].mean(), "daly_s": res["daly"].mean(),
                                 "ratio": ratio(res, "coci", "daly")})
    return rows


def grid_weibull(runs: int, seed: int) -> list[dict]:
    rows = []
    for shape in (0.5, 0.7):
        for nodes in (1, 2, 4, 8, 16, 32, 64):
            r_node, w, tb = 1 / (24 * 3600.0), 24 * 3600.0, 30.0
            lam = nodes * r_node
            costs = Costs(tb, RESTART_S)
            ctx = PlanContext(costs, lam, w, nodes=nodes, weibull_shape=shape)
            rng = np.random.default_rng(seed)
            until = 3 * w + 50 / lam
            traces = [sim.node_traces(rng, r_node, nodes, until, shape) for _ in range(runs)]
            res = sim.overhead_adaptive({"coci": replanner("coci", ctx),
                                         "daly": replanner("daly", ctx)}, traces, w, costs, until)
            rows.append({"shape": shape, "nodes": nodes, "coci_s": res["coci"].mean(),
                         "daly_s": res["daly"].mean(), "ratio": ratio(res, "coci", "daly")})
    return rows


def grid_async(runs: int, seed: int) -> list[dict]:
    rows = []
    for tb in (1.0, 5.0):
        for p in (30.0, 120.0, 600.0):
            for mtbf_h in (2.0, 12.0):
                lam, w = 1 / (mtbf_h * 3600), 24 * 3600.0
                costs = Costs(tb, RESTART_S, persist_s=p)
                ctx = PlanContext(costs, lam, w)
                # what a user who times a whole save feeds Young: Tb + P as one blocking cost
                ctx_young = replace(ctx, costs=Costs(tb + p, RESTART_S))
                rng = np.random.default_rng(seed)
                until = 3 * w + 50 / lam
                traces = [sim.sample_trace(rng, lam, until)
                          for _ in range(runs_for(runs, lam, w))]
                res = sim.overhead_adaptive({"coci": replanner("coci", ctx),
                                             "young": replanner("young", ctx_young)},
                                            traces, w, costs, until)
                rows.append({"tb_s": tb, "persist_s": p, "job_mtbf_h": mtbf_h,
                             "coci_s": res["coci"].mean(), "young_s": res["young"].mean(),
                             "ratio": ratio(res, "coci", "young")})
    return rows


def paired_ratio(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """mean(a) / mean(b) over the same traces with a 95 % interval (delta method on the paired
    per-trace terms a_i - R b_i, so what both policies lose on one trace cancels)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not np.any(a) and not np.any(b):
        return 1.0, 1.0, 1.0         # no checkpoint and no failure on any trace: the same
    r = float(a.mean() / b.mean())
    se = float(np.std(a - r * b, ddof=1) / math.sqrt(a.size) / b.mean()) if a.size > 1 else math.inf
    return r, r - 1.96 * se, r + 1.96 * se


def _events_text(path: str) -> tuple[str, list[str]]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = [ln for ln in fh.read().splitlines() if ln.strip()]
    return lines[0], lines[1:]


def sparse_histories(path: str, n_cluster: int, seed: int, first_half_records: int = 40
                     ) -> list[tuple[str, acct.History]]:
    """Sparse versions of a real history: what a small or young cluster has to learn from.

    * ``thin``: the whole span, each incident (the records that start in the same minute)
      kept with one probability so that about ``first_half_records`` records fall in the first
      half: the same structure, a few dozen incidents, failures rare for a job;
    * ``window``: a contiguous stretch of the original, centred at a random time, just long
      enough that its first half holds ``first_half_records`` records, and at least 4 jobs long
      in its second half (the jobs replay there): a short, dense history.
    """
    header, lines = _events_text(path)
    starts = [ln.split("|")[1] for ln in lines]
    rng = np.random.default_rng(seed)
    groups: dict[str, list[str]] = {}
    for ln, st in zip(lines, starts):
        groups.setdefault(st, []).append(ln)
    full = acct.parse_events("\n".join([header] + lines), skip_bad_lines=True)
    mid = 0.5 * (full.first_s + full.last_s)
    n_first = sum(1 for e in full.events if e.time_s < mid)
    p = min(1.0, first_half_records / max(n_first, 1))
    kept: list[str] = []
    for st in sorted(groups):
        if rng.random() < p:
            kept.extend(groups[st])
    out = [("thin", acct.parse_events("\n".join([header] + kept), skip_bad_lines=True))]
    # window: records sorted by start; a window whose first half holds ~first_half_records
    times = sorted(e.time_s for e in full.events)
    min_half = 4 * 4 * 72 * 3600.0
    for _ in range(50):
        i = int(rng.integers(0, max(1, len(times) - first_half_records)))
        half = max(times[min(i + first_half_records, len(times) - 1)] - times[i], min_half)
        a, b = times[i] - 1.0, times[i] - 1.0 + 2 * half
        if b <= full.last_s:
            break
    sel = [ln for ln, e_t in zip(lines, (acct.parse_time(x) for x in starts))
           if e_t is not None and a <= e_t < b]
    win = acct.parse_events("\n".join([header] + sel), skip_bad_lines=True)
    win._see(a)
    win._see(b)
    out.append(("window", win))
    return out


def replay_file(path: str, n_cluster: int | None, runs: int, seed: int) -> list[dict]:
    hist = acct.read_file(path, "events", skip_bad_lines=True)
    return replay_history(hist, os.path.basename(path), n_cluster, runs, seed)


def replay_history(hist: acct.History, label: str, n_cluster: int | None, runs: int,
                   seed: int) -> list[dict]:
    n_cluster = n_cluster or len(hist.nodes_seen)
    recs = sorted(hist.failures(), key=lambda e: e.time_s)
    t0, t1 = hist.first_s, hist.last_s
    mid = 0.5 * (t0 + t1)
    # learn from the first half: Daly counts records, the default incidents (+ Weibull shape)
    model, _ = acct.build_model(hist, t0, mid, cluster_nodes=n_cluster, have_events=True)
    # Daly's rate: the same records the model declustered, over the same exposure
    raw_rate = max(model.n_records or 0, 0.5) / model.exposure_node_s
    shape = model.hazard_shape
    # the second half, per node: record start times
    node_ids = sorted(hist.nodes_seen)
    pool = node_ids + [f"spare{i}" for i in range(max(0, n_cluster - len(node_ids)))]
    times_by_node: dict[str, list[float]] = {n: [] for n in pool}
    for e in recs:
        for n in e.nodes:
            times_by_node.setdefault(n, []).append(e.time_s)
    arr = {n: np.asarray(sorted(v)) for n, v in times_by_node.items()}
    w, tb = 72 * 3600.0, 120.0
    costs = Costs(tb, RESTART_S)
    rows = []
    for nodes in (1, 4, 16, 64):
        if nodes > n_cluster:
            continue
        rng = np.random.default_rng(seed + nodes)
        ctx_d = PlanContext(costs, nodes * raw_rate, w, nodes=nodes)
        ctx_c = PlanContext.from_model(model, costs, w, nodes)
        traces, ages = [], []
        horizon = 4 * w
        for _ in range(runs):
            start = rng.uniform(mid, t1 - horizon)
            chosen = rng.choice(len(pool), nodes, replace=False)
            ft, last = [], -math.inf
            for i in chosen:
                a = arr[pool[i]]
                ft.append(a[(a >= start) & (a < start + horizon)] - start)
                before = a[a < start]
                if before.size:
                    last = max(last, float(before[-1]))
            traces.append(np.sort(np.concatenate(ft)))
            ages.append(None if not math.isfinite(last) else start - last)
        # Daly has no hazard layer: it ignores the time since the last failure
        res = sim.overhead_adaptive({"coci": replanner("coci", ctx_c),
                                     "daly": replanner("daly", ctx_d, use_age=False)},
                                    traces, w, costs, horizon, ages)
        r, lo, hi = paired_ratio(res["coci"], res["daly"])
        rows.append({"file": label, "cluster_nodes": n_cluster, "nodes": nodes,
                     "records_first_half": model.n_records, "incidents_first_half": model.n_failures,
                     "weibull_shape": shape, "runs": len(traces),
                     "failures_per_job": float(np.mean([t[t < 1.5 * w].size for t in traces])),
                     "coci_s": res["coci"].mean(),
                     "daly_s": res["daly"].mean(), "ratio": r, "ci_low": lo, "ci_high": hi})
    return rows


def grid_paper(runs: int, seed: int) -> list[dict]:
    rows = []
    u = np.linspace(0.0, 1.0, 400)
    y = 2.3 * (1 + u / 0.02) ** -0.6 + 0.2
    for nodes in (1, 8, 64):
        for tb in (10.0, 120.0):
            w, lam = 24 * 3600.0, nodes / (100 * 3600.0)
            fit = fit_curve(u * w, y).fit
            costs = Costs(tb, RESTART_S)
            ctx = PlanContext(costs, lam, w, fit=fit, nodes=nodes)
            rng = np.random.default_rng(seed)
            until = 3 * w + 50 / lam
            traces = [sim.sample_trace(rng, lam, until) for _ in range(runs)]
            # the published rule plans once from the fit, as in the paper (no re-plan shift)
            paper = make_policy("coci-paper").plan(ctx).times
            res = sim.overhead_adaptive({"paper": lambda p, r, a: paper,
                                         "daly": replanner("daly", ctx)}, traces, w, costs, until)
            rows.append({"nodes": nodes, "tb_s": tb, "ratio": ratio(res, "paper", "daly")})
    return rows


def _arms(text: str) -> tuple[tuple[float, float], ...]:
    """``F:PER_H,...`` (PER_H a number or 1/N) -> ((F, outages per hour), ...)."""
    out = []
    for part in text.split(","):
        f, _, o = part.partition(":")
        num, _, den = o.partition("/")
        out.append((float(f), float(num or 0) / float(den) if den else float(num or 0)))
    return tuple(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--runs", type=int, default=1000, help="simulated runs per setting (more where failures are rare)")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--events-file", action="append", default=None, metavar="FILE[:NODES]",
                    help="replay this history (sacctmgr --parsable2 show event format); NODES = "
                    "the cluster's node count (default: nodes seen). Repeatable. Default: the "
                    "LANL histories in ../shared/data")
    ap.add_argument("--no-sparse", action="store_true",
                    help="replay only the histories as given, not their sparse versions")
    ap.add_argument("--sparse-records", type=lambda t: [int(x) for x in t.split(",")],
                    default=list(SPARSE_RECORDS), metavar="K[,K...]",
                    help="records in the learning half of the sparse versions (default: "
                    + ",".join(map(str, SPARSE_RECORDS)) + ")")
    ap.add_argument("--sparse-draws", type=int, default=1,
                    help="independent thinning/window draws per history and K (default 1)")
    ap.add_argument("--only", default="exponential,weibull,async,replay,paper",
                    help="comma-separated grids to run")
    ap.add_argument("--coverage", type=float, default=0.0,
                    help="exponential grid only: the share of failures survivors' saves cover (each then "
                    "loses one 1 s step); the default knows it, Daly does not (default 0: the grid as "
                    "always)")
    ap.add_argument("--tt-runs", type=int, default=100,
                    help="two_tier: replayed jobs per (history, nodes) (default 100)")
    ap.add_argument("--tt-nodes", type=lambda t: tuple(int(x) for x in t.split(",")),
                    default=two_tier_grid.NODES, help="two_tier: job sizes (default 16,64,256,1024)")
    ap.add_argument("--tt-state", type=lambda t: tuple(float(x) for x in t.split(",")),
                    default=two_tier_grid.STATE_GB, help="two_tier: GB of state per node (default 1,10,80)")
    ap.add_argument("--tt-arms", type=_arms, default=two_tier_grid.ARMS, metavar="F:PER_H[,F:PER_H...]",
                    help="two_tier: whole-job failures added to the replay, each arm the share F of its "
                    "incidents that end the whole job and outages per hour (PER_H may be 1/160) (default: "
                    + ",".join(f"{f:g}:{o:.4g}" for f, o in two_tier_grid.ARMS) + ")")
    ap.add_argument("--tt-diagnostics", action="store_true",
                    help="two_tier: also the out-of-sample, other-draw, past and replay-fit diagnostics "
                    "(three more grid searches per setting and arm)")
    ap.add_argument("--tt-node-only", action="store_true",
                    help="two_tier: plan without the whole-job model (the planner before issue 34), "
                    "for comparison")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    only = set(a.only.split(","))
    if a.events_file:
        files = []
        for spec in a.events_file:
            path, _, n = spec.rpartition(":") if spec.rpartition(":")[2].isdigit() else (spec, "", "")
            files.append((path, int(n) if n else None))
    else:
        data = os.path.join(HERE, "..", "..", "shared", "data")
        files = [(os.path.join(data, f), n) for f, n in LANL]
        files = [(f, n) for f, n in files if os.path.exists(f)]
        if not files and ("replay" in only or "two_tier" in only):
            print(f"no LANL histories under {data}; pass --events-file", file=sys.stderr)
    grids: dict[str, list[dict]] = {}
    timing = {}
    for name, fn in (("exponential", grid_exponential), ("weibull", grid_weibull),
                     ("async", grid_async), ("paper", grid_paper)):
        if name in only:
            t = time.perf_counter()
            grids[name] = grid_exponential(a.runs, a.seed, a.coverage) if name == "exponential" else fn(a.runs, a.seed)
            timing[name] = round(time.perf_counter() - t, 1)
    if "replay" in only:
        t = time.perf_counter()
        rows = []
        for f, n in files:
            rows += replay_file(f, n, a.runs, a.seed)
            if not a.no_sparse:
                hist = acct.read_file(f, "events", skip_bad_lines=True)
                n_c = n or len(hist.nodes_seen)
                for k in a.sparse_records:
                    for d in range(a.sparse_draws):
                        tag = f"{k}" if d == 0 else f"{k}#{d}"
                        for label, h in sparse_histories(f, n_c, a.seed + k + 7919 * d, k):
                            rows += replay_history(h, f"{os.path.basename(f)}:{label}{tag}",
                                                   n_c, a.runs, a.seed)
        grids["replay"] = rows
        timing["replay"] = round(time.perf_counter() - t, 1)
    if "two_tier" in only and files:
        t = time.perf_counter()
        grids["two_tier"] = two_tier_grid.grid_two_tier(files, a.tt_runs, a.seed, a.tt_nodes, a.tt_state,
                                                        arms=a.tt_arms, diagnostics=a.tt_diagnostics,
                                                        node_only=a.tt_node_only)
        timing["two_tier"] = round(time.perf_counter() - t, 1)
    out: dict = {}
    goals = dict(GOALS)
    if grids.get("two_tier"):
        out.update(two_tier_grid.keys(grids["two_tier"]))
        goals.update(two_tier_grid.GOALS)
    if "exponential" in grids:
        out["default_vs_daly_exponential"] = gmean([r["ratio"] for r in grids["exponential"]])
        out["default_vs_daly_exponential_worst"] = max(r["ratio"] for r in grids["exponential"])
    if "weibull" in grids:
        out["default_vs_daly_weibull"] = gmean([r["ratio"] for r in grids["weibull"]])
        out["default_vs_daly_weibull_per_setting"] = {
            f"shape{r['shape']}_n{r['nodes']}": round(r["ratio"], 4) for r in grids["weibull"]}
    if "replay" in grids and grids["replay"]:
        given = [r["ratio"] for r in grids["replay"] if ":" not in r["file"]]
        sparse = [r["ratio"] for r in grids["replay"] if ":" in r["file"]]
        if given:
            out["default_vs_daly_replay"] = gmean(given)
        if sparse:
            out["default_vs_daly_replay_sparse"] = gmean(sparse)
        worst = max(grids["replay"], key=lambda r: r["ratio"])
        out["default_vs_daly_replay_worst"] = worst["ratio"]
        out["default_vs_daly_replay_worst_setting"] = (
            f"{worst['file']} nodes={worst['nodes']} ratio {worst['ratio']:.4f} "
            f"[{worst['ci_low']:.4f}, {worst['ci_high']:.4f}]")
        out["replay_ci_reaches_1"] = all(r["ci_low"] <= 1.0 for r in grids["replay"])
    if "async" in grids:
        out["default_vs_young_async"] = gmean([r["ratio"] for r in grids["async"]])
    if "paper" in grids:
        out["paper_vs_daly"] = gmean([r["ratio"] for r in grids["paper"]])
    out["goals"] = {k: f"<= {v}" for k, v in goals.items()}
    out["goals_met"] = {k: bool(out[k] <= v) for k, v in goals.items() if k in out}
    out["settings"] = {"runs_per_setting": a.runs, "seed": a.seed, "restart_s": RESTART_S,
                       **({"survivor_coverage": a.coverage} if a.coverage else {}),
                       "replay_files": [f"{f}:{n}" if n else f for f, n in files],
                       "seconds_per_grid": timing,
                       "elapsed_s": round(time.perf_counter() - t_start, 1)}
    out["rows"] = grids
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    for name, rows in grids.items():
        print(f"== {name}")
        if rows:
            keys = list(rows[0])
            wide = {"file": 30}
            print("  ".join(f"{k:>{wide.get(k, 12)}s}" for k in keys))
            for r in rows:
                print("  ".join(f"{r[k]:12.4g}" if isinstance(r[k], float)
                                else f"{str(r[k]):>{wide.get(k, 12)}s}" for k in keys))
    print()
    for k, v in out.items():
        if isinstance(v, float):
            goal = goals.get(k)
            print(f"{k:36s} {v:.3f}" + (f"   goal <= {goal}: {'met' if v <= goal else 'NOT met'}"
                                        if goal else ""))
    for arm, blk in out.get("arms", {}).items():
        print(f"{arm}: " + ", ".join(f"{k} {blk[k]:.3f}" for k in two_tier_grid.GOALS))
        for sysname, sb in blk["per_system"].items():
            print(f"  {sysname}: " + ", ".join(f"{k} {sb[k]:.3f}" for k in two_tier_grid.GOALS))
    print(f"(elapsed {out['settings']['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
