"""The two-tier grid of planner_bench.py (``--only two_tier``): memory + disk checkpoints on the
LANL histories replayed by incident.

Per history (N nodes): the records are merged (DOWN+DRAIN of one failure) and grouped into
incidents (records that start within a minute; sizes = their node counts). The first half of
the history is what the planner learns from (incident sizes and count over the half's length);
jobs replay the second half. A job on n nodes runs on ceil(n / N) copies of the cluster, each
copy replayed from its own random start in the second half, on n of those nodes at random;
node i's partner is the next node of a random ring over the job's nodes. An incident that hits
the job is flagged when it takes a node and its partner (the memory tier cannot serve it).

Costs per setting (state S GB per node, disk B_d and memory-copy B_m GB/s per node):
  memory copy Cm = S / B_m (blocking: no overlap is assumed), disk save Cd = S / B_d,
  recovery from memory Rm = 30 s in-place relaunch on a spare + survivors' save S / B_d +
  restore S / B_d, from disk Rd = 150 s through the queue + restore S / B_d; step 5 s, job 72 h
  of work.

Whole-job failures (issue 34), in arms: every incident of the replay ends the whole job (back to
disk) with probability f, and outages (back to disk) come at a rate per hour
(``with_whole_job``). The planner plans with the whole-job model's defaults in every arm (15 %,
one outage per 160 h: the LANL histories have no job records to learn them from); Daly uses the
same total rate. Policies, all on the same traces of an arm:
  coci      plan_two_tier on the learned incident profile (the first half's current regime:
            IncidentProfile.from_incident_times) with the whole-job priors
  daly      disk only at Daly's interval for the rate coci uses (incidents + outages)
  orbax     memory every 10 steps, disk every 1000 (Orbax emergency checkpointing's default)
  mem1      memory every step + disk at Daly's interval
  oracle    the best fixed pair (or disk-only interval) by grid search on the replay traces
            (in sample: chosen on the traces it is scored on; the goal is against it)
  coci_known_rates  (a diagnostic) the planner told the arm's true f and outage rate: the
            prior's cost apart from the model's
Worst single loss: the most work one failure rolled back in any replayed job, in coci's disk
intervals (the goal), and in disk intervals that answer the replay's own rate of failures that
defeat the memory tier (Daly's interval for it: pair losses, whole-job failures and outages
counted in the arm's traces): does coci's disk interval answer the rate the job meets?
With ``diagnostics`` (``--tt-diagnostics``), as before issue 34:
  oracle_oos  the pair the same grid search chose on those traces, scored on an independent set
            of replayed jobs from the same replay half (seed + 1), and coci scored on the same set
  coci_replay_fit  the planner fed the replay half's own incidents
  best fixed on another draw / on the past: the grid search on seed + 1's jobs and on jobs
            replayed from the first half, scored on seed S's jobs
"""
from __future__ import annotations

import math
import os

import numpy as np

from coci_hpc.planner import two_tier as tt
from coci_hpc.planner import two_tier_sim as tsim
from coci_hpc.planner.failures import decluster
from coci_hpc.planner.policies import daly_interval
from coci_hpc.slurm import accounting as acct

STEP_S = 5.0
WORK_S = 72 * 3600.0
INPLACE_S, QUEUE_S = 30.0, 150.0
NODES = (16, 64, 256, 1024)
STATE_GB = (1.0, 10.0, 80.0)
DISK_GBPS = (1.0, 10.0)
MEM_GBPS = (5.0, 25.0)
ORBAX = (10, 1000)
MIN_INCIDENTS, MAX_RUNS = 2000, 1000
# in every arm (issue 34): the best fixed pair's goal is on the geometric mean over the settings
GOALS = {"two_tier_vs_daly": 0.7, "two_tier_vs_best_fixed_geomean": 1.05, "two_tier_vs_orbax_default": 0.8,
         "two_tier_worst_loss_disk_intervals": 1.5}
# the whole-job arms: (f: the share of the replay's incidents that end the whole job, outages
# per hour), each f with no outages and with the default outage rate, and the 15 % default
# with four times it
ARMS = tuple((f, o) for f in (0.0, 0.05, 0.15, 0.30) for o in (0.0, 1 / 160)) + ((0.15, 1 / 40),)


def costs_for(state_gb: float, disk_gbps: float, mem_gbps: float) -> tt.TierCosts:
    d = state_gb / disk_gbps
    return tt.TierCosts(mem_ckpt_s=state_gb / mem_gbps, disk_ckpt_s=d,
                        mem_restart_s=INPLACE_S + 2 * d, disk_restart_s=QUEUE_S + d,
                        step_time_s=STEP_S)


def incidents_of(path: str) -> tuple[list[tuple[float, tuple[str, ...]]], list[str], float, float]:
    hist = acct.read_file(path, "events", skip_bad_lines=True)
    inc = decluster(hist.failures(), repeat_s=0.0)     # simultaneous records only: every strike counts
    assert hist.first_s is not None and hist.last_s is not None
    return [(e.time_s, e.nodes) for e in inc], sorted(hist.nodes_seen), hist.first_s, hist.last_s


def job_traces(inc, node_ids: list[str], n_cluster: int, mid: float, t1: float, nodes: int,
               runs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    horizon = 4 * WORK_S
    pool = node_ids + [f"spare{i}" for i in range(max(0, n_cluster - len(node_ids)))]
    index = {n: i for i, n in enumerate(pool)}
    times = np.array([t for t, _ in inc])
    idx = [np.array([index[x] for x in ns if x in index], dtype=np.int64) for _, ns in inc]
    reps = math.ceil(nodes / n_cluster)
    out = []
    for _ in range(runs):
        chosen = rng.choice(reps * n_cluster, nodes, replace=False)
        ring = rng.permutation(chosen)
        partner = np.full(reps * n_cluster, -1, dtype=np.int64)
        partner[ring] = np.roll(ring, -1)
        in_job = np.zeros(reps * n_cluster, dtype=bool)
        in_job[chosen] = True
        ts, fl = [], []
        for r in range(reps):
            start = rng.uniform(mid, t1 - horizon)
            a, b = np.searchsorted(times, [start, start + horizon])
            for k in range(a, b):
                v = idx[k] + r * n_cluster
                hit = v[in_job[v]]
                if hit.size:
                    ts.append(times[k] - start)
                    fl.append(bool(np.isin(partner[hit], hit).any()))
        out.append((np.asarray(ts, dtype=float), np.asarray(fl, dtype=bool)))
    return tsim.pad_traces(out)


def oracle(costs: tt.TierCosts, traces) -> tuple[tuple[int | None, int], float]:
    """The best fixed pair on these very traces: a coarse grid, then a finer one around it."""
    disks = [int(m * 10 ** e) for e in range(1, 5) for m in (1, 2, 5)] + [100000]
    mems: list[int | None] = [None, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    seen: dict[tuple[int | None, int], float] = {}

    def run(cands) -> None:
        todo = []
        for m, d in cands:
            if m is not None:
                d = max(m, int(round(d / m)) * m)
            if (m, d) not in seen:
                todo.append((m, d))
        todo = list(dict.fromkeys(todo))
        if todo:
            for p, v in zip(todo, tsim.simulate_many(todo, costs, WORK_S, traces).mean(axis=1)):
                seen[p] = float(v)
    run([(m, d) for m in mems for d in disks if m is None or d >= m])
    for _ in range(2):
        (bm, bd), _v = min(seen.items(), key=lambda kv: kv[1])
        run([(None if bm is None else max(1, int(round(bm * fm))), max(1, int(round(bd * fd))))
             for fm in (0.6, 0.8, 1.0, 1.25, 1.6) for fd in (0.6, 0.8, 1.0, 1.25, 1.6)])
    best = min(seen.items(), key=lambda kv: kv[1])
    return best[0], best[1]


def with_whole_job(traces, f: float, outage_per_h: float, rng: np.random.Generator):
    """Replayed traces with whole-job failures added: every incident of the replay ends the whole
    job (flagged: back to disk) with probability ``f``, and outages (flagged) at ``outage_per_h``
    per hour, Poisson over the traces' span."""
    times, flags = traces
    fin = np.isfinite(times)
    flags = flags | (fin & (rng.random(times.shape) < f))
    if outage_per_h <= 0:
        return times, flags
    span = 4 * WORK_S
    out = []
    for r in range(times.shape[0]):
        k = rng.poisson(outage_per_h / 3600.0 * span)
        t = np.concatenate([times[r][fin[r]], rng.uniform(0.0, span, k)])
        fl = np.concatenate([flags[r][fin[r]], np.ones(k, dtype=bool)])
        out.append((t, fl))
    return tsim.pad_traces(out)


def arm_label(f: float, outage_per_h: float) -> str:
    return f"f={f:g} outages={'0' if outage_per_h <= 0 else f'1/{1 / outage_per_h:g}h'}"


def grid_two_tier(files: list[tuple[str, int | None]], runs: int, seed: int, nodes=NODES,
                  states=STATE_GB, disks=DISK_GBPS, mems=MEM_GBPS,
                  arms: tuple[tuple[float, float], ...] = ((0.0, 0.0),), diagnostics: bool = True,
                  node_only: bool = False) -> list[dict]:
    """One row per (arm, history, nodes, costs). ``arms``: (f, outages per hour) of the whole-job
    failures added to the replay (:func:`with_whole_job`); the planner plans with the whole-job
    model's defaults (15 %, one outage per 160 h: the LANL histories have no job records to learn
    them from) in every arm, and Daly's disk-only plan uses the same total rate.
    ``diagnostics``: also the out-of-sample, other-draw, past and replay-fit diagnostics (three
    more grid searches per setting). ``node_only``: plan without the whole-job model (the planner
    before it: no disk save in the horizon without a partner loss), for comparison."""
    from coci_hpc.planner import whole_job as wj
    prior = wj.resolve()
    rows = []
    for path, n_cl in files:
        inc, node_ids, t0, t1 = incidents_of(path)
        n_cluster = n_cl or len(node_ids)
        mid = 0.5 * (t0 + t1)
        first = [(t, len(set(ns))) for t, ns in inc if t < mid]
        replay = [(t, len(set(ns))) for t, ns in inc if t >= mid]
        for n in nodes:
            rng = np.random.default_rng(seed + n)
            prof_n = tt.IncidentProfile.from_incident_times([t for t, _ in first], [m for _, m in first],
                                                            t0, mid, n_cluster, n)
            prof = prof_n if node_only else prof_n.with_whole_job(prior)
            # at least ~MIN_INCIDENTS incidents per (history, nodes) where jobs see few: else
            # the oracle, which picks its pair on these very traces, mostly fits their noise
            n_runs = int(min(MAX_RUNS, max(runs, math.ceil(MIN_INCIDENTS / (prof_n.job_rate * WORK_S)))))
            base = job_traces(inc, node_ids, n_cluster, mid, t1, n, n_runs, rng)
            if diagnostics:
                # an independent set of replayed jobs (what seed + 1 would replay): the oracle's pair
                # is scored there too, out of sample
                base_oos = job_traces(inc, node_ids, n_cluster, mid, t1, n, n_runs,
                                      np.random.default_rng(seed + 1 + n))
                # the same planner fed the replay half's own incidents (no drift between the halves)
                prof_r = tt.IncidentProfile.from_incidents([m for _, m in replay], t1 - mid, n_cluster, n)
                prof_r = prof_r if node_only else prof_r.with_whole_job(prior)
                # jobs replayed from the FIRST half (what the planner learns from)
                base_past = job_traces(inc, node_ids, n_cluster, t0, mid, n, n_runs,
                                       np.random.default_rng(seed + 2 + n))
            for f, out_h in arms:
                arm_rng = np.random.default_rng([seed, n, int(round(f * 1e6)), int(round(out_h * 1e9))])
                traces = with_whole_job(base, f, out_h, arm_rng)
                if diagnostics:
                    traces_oos = with_whole_job(base_oos, f, out_h, np.random.default_rng(arm_rng.integers(2**62)))
                    traces_past = with_whole_job(base_past, f, out_h, np.random.default_rng(arm_rng.integers(2**62)))
                seen_q = float(traces[1][np.isfinite(traces[0])].mean()) if np.isfinite(traces[0]).any() else math.nan
                # the replay's own rate of failures that defeat the memory tier (pair losses, whole-job
                # failures, outages) over the traces' span: the rate the disk interval must answer
                seen_disk_rate = float(traces[1].sum()) / (traces[0].shape[0] * 4 * WORK_S)
                for s in states:
                    for bd in disks:
                        for bm in mems:
                            c = costs_for(s, bd, bm)
                            plan = tt.plan_two_tier(c, prof, WORK_S, seed=seed)
                            daly = tt.daly_steps(c, prof.total_rate)
                            pairs = {"coci": (plan.mem_every_steps, plan.disk_every_steps),
                                     "daly": (None, daly), "orbax": ORBAX, "mem1": (1, daly)}
                            if diagnostics:
                                plan_r = tt.plan_two_tier(c, prof_r, WORK_S, seed=seed)
                                pairs["coci_replay_fit"] = (plan_r.mem_every_steps, plan_r.disk_every_steps)
                            names = list(pairs)
                            waste, worst = tsim.simulate_detail([pairs[k] for k in names], c, WORK_S, traces)
                            res = {k: float(v) for k, v in zip(names, waste.mean(axis=1))}
                            worst_coci = float(worst[0].max())
                            # the disk interval that answers the replay's rate (Daly's for it): the
                            # worst single loss is measured in it (coci's own disk interval bounds it
                            # by construction; the question is whether that interval answers the rate)
                            answer_s = (daly_interval(c.disk_ckpt_s, 1.0 / seen_disk_rate)
                                        if seen_disk_rate > 0 else math.inf)
                            # diagnostic: the planner told the arm's true whole-job share and
                            # outage rate (what COCI_WHOLE_JOB_SHARE / COCI_OUTAGE_RATE, or event
                            # logs, would give it): the prior's cost apart from the model's
                            plan_k = tt.plan_two_tier(c, prof_n.with_whole_job(wj.WholeJob(f, out_h / 3600.0, "given",
                                                                                           "given")), WORK_S, seed=seed)
                            res["coci_known_rates"] = float(tsim.simulate(plan_k.mem_every_steps, plan_k.disk_every_steps,
                                                                          c, WORK_S, traces).mean())
                            o_pair, res["oracle"] = oracle(c, traces)
                            row = {
                                "arm": arm_label(f, out_h), "whole_job_f": f, "outages_per_h": out_h,
                                "file": os.path.basename(path).replace("_events.txt", ""),
                                "nodes": n, "runs": n_runs, "state_gb": s, "disk_gbps": bd, "mem_gbps": bm,
                                "incidents_per_job": float(np.isfinite(traces[0]).sum(1).mean()),
                                "partner_loss_model": prof.partner_loss, "to_disk_model": prof.disk_share,
                                "to_disk_seen": seen_q,
                                "tier": plan.tier, "k": plan.mem_every_steps, "disk_every": plan.disk_every_steps,
                                "oracle_k": o_pair[0], "oracle_disk": o_pair[1],
                                # the most one failure cost in any replayed job (work rolled back + its
                                # restart), in coci's disk intervals, and in hours
                                "worst_loss_disk_intervals": worst_coci / plan.disk_interval_s,
                                "worst_loss_answer_intervals": worst_coci / answer_s,
                                "worst_loss_h": worst_coci / 3600.0, "answer_disk_h": answer_s / 3600.0,
                                "seen_disk_rate_per_h": seen_disk_rate * 3600.0,
                                "vs_daly": _r(res["coci"], res["daly"]),
                                "vs_oracle": _r(res["coci"], res["oracle"]),
                                "vs_orbax": _r(res["coci"], res["orbax"]),
                                "vs_mem1": _r(res["coci"], res["mem1"]),
                                "known_rates_vs_oracle": _r(res["coci_known_rates"], res["oracle"]),
                                "known_k": plan_k.mem_every_steps, "known_disk_every": plan_k.disk_every_steps}
                            if diagnostics:
                                oos = tsim.simulate_many([pairs["coci"], o_pair], c, WORK_S, traces_oos).mean(axis=1)
                                res["coci_oos"], res["oracle_oos"] = float(oos[0]), float(oos[1])
                                # the best pairs found on another draw of jobs from the same replay
                                # half and on jobs replayed from the first half, both scored on seed
                                # S's jobs like the in-sample oracle
                                other_pair, _ = oracle(c, traces_oos)
                                past_pair, _ = oracle(c, traces_past)
                                on_s = tsim.simulate_many([other_pair, past_pair], c, WORK_S, traces).mean(axis=1)
                                res["oracle_other_draw"], res["oracle_past"] = float(on_s[0]), float(on_s[1])
                                row.update({
                                    "vs_oracle_oos": _r(res["coci_oos"], res["oracle_oos"]),
                                    "replay_fit_vs_oracle": _r(res["coci_replay_fit"], res["oracle"]),
                                    "other_draw_pair": other_pair, "past_pair": past_pair,
                                    "other_draw_vs_oracle": _r(res["oracle_other_draw"], res["oracle"]),
                                    "past_vs_oracle": _r(res["oracle_past"], res["oracle"])})
                            row.update({f"{k}_waste": v / WORK_S for k, v in res.items()})
                            rows.append(row)
    return rows


def _r(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a == 0 else math.inf)


def gmean(v) -> float:
    v = [x for x in v if x > 0 and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(v)))) if v else math.nan


def keys(rows: list[dict]) -> dict:
    """The goal keys: per arm (whole-job failures added to the replay), over the whole grid and
    per system; at the top, each goal key's worst arm (the goals hold in every arm)."""
    def block(rs: list[dict]) -> dict:
        big = [r for r in rs if r["nodes"] >= 64]
        out = {"two_tier_vs_daly": gmean([r["vs_daly"] for r in big]),
               "two_tier_vs_daly_all_nodes": gmean([r["vs_daly"] for r in rs]),
               "two_tier_vs_daly_worst": max(r["vs_daly"] for r in rs),
               # what the best fixed pair itself does against Daly (64+ nodes): how low any plan gets
               "best_fixed_vs_daly": gmean([_r(r["oracle_waste"], r["daly_waste"]) for r in big]),
               "two_tier_vs_best_fixed": max(r["vs_oracle"] for r in rs),
               "two_tier_vs_best_fixed_geomean": gmean([r["vs_oracle"] for r in rs]),
               "two_tier_vs_orbax_default": gmean([r["vs_orbax"] for r in rs]),
               "two_tier_vs_orbax_default_worst": max(r["vs_orbax"] for r in rs),
               "two_tier_vs_mem_every_step": gmean([r["vs_mem1"] for r in rs]),
               # the waste itself (% of the work, geometric mean over the settings): a ratio near a
               # small oracle waste can be large while both are small
               "coci_waste_pct_geomean": 100 * gmean([r["coci_waste"] for r in rs]),
               "oracle_waste_pct_geomean": 100 * gmean([r["oracle_waste"] for r in rs]),
               "daly_waste_pct_geomean": 100 * gmean([r["daly_waste"] for r in rs]),
               # the most work one failure rolled back in any replayed job: in coci's disk intervals
               # (the goal), in disk intervals that answer the replay's own rate of failures
               # defeating the memory tier (Daly's for it: does coci's interval answer the rate?),
               # and in hours
               "two_tier_worst_loss_disk_intervals": max(r["worst_loss_disk_intervals"] for r in rs),
               "two_tier_worst_loss_answer_intervals": max(r["worst_loss_answer_intervals"] for r in rs),
               "two_tier_worst_loss_h": max(r["worst_loss_h"] for r in rs),
               "two_tier_above_1_05": sum(r["vs_oracle"] > 1.05 for r in rs),
               # diagnostic: the planner told the arm's true share and outage rate
               "two_tier_known_rates_vs_best_fixed_geomean": gmean([r["known_rates_vs_oracle"] for r in rs]),
               "two_tier_known_rates_vs_best_fixed": max(r["known_rates_vs_oracle"] for r in rs),
               "memory_tier_dropped": sum(r["tier"] == "disk-only" for r in rs),
               "settings": len(rs)}
        if all("vs_oracle_oos" in r for r in rs):
            out.update({
                # diagnostics, no goal: the oracle's pair chosen on one set of replayed jobs and
                # scored (with coci) on an independent set from the same replay half
                "two_tier_vs_best_fixed_out_of_sample": max(r["vs_oracle_oos"] for r in rs),
                "two_tier_vs_best_fixed_out_of_sample_geomean": gmean([r["vs_oracle_oos"] for r in rs]),
                "two_tier_fit_on_replay_vs_best_fixed": max(r["replay_fit_vs_oracle"] for r in rs),
                "two_tier_fit_on_replay_vs_best_fixed_geomean": gmean([r["replay_fit_vs_oracle"] for r in rs]),
                # fixed pairs that did not see seed S's jobs, against the in-sample oracle on them:
                # chosen on another draw of jobs from the replay half, and on the first half
                "best_fixed_other_draw_vs_best_fixed": max(r["other_draw_vs_oracle"] for r in rs),
                "best_fixed_other_draw_vs_best_fixed_geomean": gmean([r["other_draw_vs_oracle"] for r in rs]),
                "best_fixed_other_draw_above_1_05": sum(r["other_draw_vs_oracle"] > 1.05 for r in rs),
                "best_fixed_on_past_vs_best_fixed": max(r["past_vs_oracle"] for r in rs),
                "best_fixed_on_past_vs_best_fixed_geomean": gmean([r["past_vs_oracle"] for r in rs])})
        return out

    arms = list(dict.fromkeys(r["arm"] for r in rows))
    per_arm = {}
    for arm in arms:
        rs = [r for r in rows if r["arm"] == arm]
        b = block(rs)
        b["per_system"] = {f: block([r for r in rs if r["file"] == f]) for f in dict.fromkeys(r["file"] for r in rs)}
        worst = max(rs, key=lambda r: r["vs_oracle"])
        b["two_tier_vs_best_fixed_worst_setting"] = (
            f"{worst['file']} nodes={worst['nodes']} S={worst['state_gb']:g}GB "
            f"disk={worst['disk_gbps']:g} mem={worst['mem_gbps']:g}GB/s: coci ({worst['k']}, "
            f"{worst['disk_every']}) vs oracle ({worst['oracle_k']}, {worst['oracle_disk']})")
        wl = max(rs, key=lambda r: r["worst_loss_answer_intervals"])
        b["two_tier_worst_loss_setting"] = (
            f"{wl['file']} nodes={wl['nodes']} S={wl['state_gb']:g}GB disk={wl['disk_gbps']:g} "
            f"mem={wl['mem_gbps']:g}GB/s: coci ({wl['k']}, {wl['disk_every']}), one failure rolled back "
            f"{wl['worst_loss_h']:.3g} h of work; Daly's interval for the replay's rate "
            f"{wl['seen_disk_rate_per_h']:.3g}/h is {wl['answer_disk_h']:.3g} h")
        b["goals_met"] = {k: bool(b[k] <= v) for k, v in GOALS.items()}
        per_arm[arm] = b
    out: dict = {k: max(per_arm[a][k] for a in arms) for k in GOALS}
    out["worst_arm"] = {k: max(arms, key=lambda a: per_arm[a][k]) for k in GOALS}
    out["arms"] = per_arm
    out["goals"] = {k: f"<= {v}" for k, v in GOALS.items()}
    out["goals_met"] = {k: bool(out[k] <= v) for k, v in GOALS.items()}
    out["goals_met_per_arm"] = {a: per_arm[a]["goals_met"] for a in arms}
    return out
