"""coci-plan: a checkpoint schedule from the cluster's failure history and the job's costs.

The default policy `coci` plans Daly's period from the declustered rate of unannounced
failures, the blocking save cost Tb (bounded below by the persist time P of an asynchronous
save), cuts the remaining horizon into equal chunks, and front-loads checkpoints after a restart
when the history's failures have a decreasing hazard. The profile's loss curve predicts the
horizon (--plateau-loss) and drives the plot.

Profile JSON (``--profile``), as the runtime records it (coci_hpc.planner.profile.Profile);
every key but ``samples`` optional::

    {
      "samples": [{"step": 100, "time_s": 52.0, "loss": 2.11}, ...],
      "ckpt_cost_s": 12.5,        # Tb: blocking time of one save (measured)
      "persist_s": 40.0,          # P: background persist of an asynchronous save (measured)
      "restart_cost_s": 140.0,    # Tr: requeue latency + restore (measured)
      "step_time_s": 0.52,        # seconds per step (else derived from the samples)
      "total_steps": 20000        # the run's last step (sets the horizon)
    }

``time_s`` is training time since the job started (checkpoint stalls excluded). Plans start at
the last sample and cover the horizon: --horizon, else total_steps, else 24h.

Exit codes: 0 planned, 2 bad usage or unreadable input, 3 Slurm unreachable (--from-cluster),
4 no plan from these numbers.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from coci_hpc import settings
from coci_hpc.cli.common import (
    UsageArgumentParser,
    add_json,
    add_plot,
    plot_target,
    print_json,
    progress,
    run_cli,
)
from coci_hpc.errors import UsageError
from coci_hpc.slurm.timefmt import read_duration

# The planner (numpy, scipy) is imported where it is used, not here: --help and --version, and a
# usage error, answer without it (seconds on a loaded login node).
if TYPE_CHECKING:
    from coci_hpc.planner import failures as fmod
    from coci_hpc.planner import two_tier
    from coci_hpc.planner.convergence import CurveFit, FitOutcome
    from coci_hpc.planner.costs import Costs
    from coci_hpc.planner.profile import Profile

PROG = "coci-plan"
DEFAULT_CKPT_COST_S = 30.0      # used only without a profile or --ckpt-cost, and said so
DEFAULT_HORIZON_S = 86400.0
COMPARED = ("coci", "young", "daly", "checkfreq", "coci-paper")


class _Later:
    """Help text computed when the help is printed (argparse formats it with ``%``, so ``str()``):
    the names it lists live in modules that import numpy."""

    def __init__(self, make: Callable[[], str]) -> None:
        self.make = make

    def __str__(self) -> str:
        return self.make()


def _later(action: argparse.Action, make: Callable[[], str]) -> None:
    action.later = _Later(make)       # type: ignore[attr-defined]   # read by help's %(later)s


def _sacct_cmd() -> str:
    from coci_hpc.slurm import accounting as acct
    return " ".join(acct.SACCT_ARGS)


def _events_cmd() -> str:
    from coci_hpc.slurm import accounting as acct
    return " ".join(acct.SACCTMGR_EVENT_ARGS)


def _maintenance() -> str:
    from coci_hpc.slurm import accounting as acct
    return ", ".join(acct.DEFAULT_MAINTENANCE_PATTERNS)


def _policies() -> str:
    from coci_hpc.planner.policies import POLICY_NAMES
    return ", ".join(POLICY_NAMES)


def _parser() -> argparse.ArgumentParser:
    p = UsageArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Profile schema:\n" + __doc__.split("Profile JSON")[1])
    src = p.add_argument_group("failure history (one of these, or --mtbf-hours)")
    _later(src.add_argument("--sacct-file", help="output of: %(later)s"), _sacct_cmd)
    _later(src.add_argument("--events-file", help="output of: %(later)s"), _events_cmd)
    src.add_argument("--from-cluster", action="store_true",
                     help="run sacct/sacctmgr/sinfo here (needs --since)")
    src.add_argument("--partition", help="with --from-cluster: only this partition's jobs/nodes")
    src.add_argument("--since", help="window start, YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS (local time)")
    src.add_argument("--until", help="window end for files (default: last record); running jobs "
                     "count up to it")
    src.add_argument("--cluster-nodes", type=int,
                     help="nodes in the cluster, for node-event exposure from files "
                     "(default: nodes seen in the files)")
    src.add_argument("--mtbf-hours", type=float, help="per-node MTBF instead of a history")
    src.add_argument("--skip-bad-lines", action="store_true",
                     help="skip malformed lines (and count them) instead of failing")
    _later(src.add_argument("--maintenance-pattern", action="append", default=None, metavar="REGEX",
                            help="reason regex of planned maintenance to ignore (repeatable; replaces "
                            "the defaults: %(later)s)"), _maintenance)
    p.add_argument("--nodes", type=int, default=1, help="nodes the job runs on (default 1)")
    p.add_argument("--profile", help="PROFILE.json: loss samples and measured costs")
    p.add_argument("--ckpt-cost", type=float, help="Tb: blocking seconds of one save "
                   "(overrides the profile)")
    p.add_argument("--persist", type=float, help="P: background persist seconds of an "
                   "asynchronous save (overrides the profile; default 0)")
    p.add_argument("--restart-cost", type=float, help="Tr seconds (overrides the profile)")
    p.add_argument("--step-time", type=float, help="seconds per step (overrides the profile)")
    _later(p.add_argument("--policy", default="coci", help="one of: %(later)s"), _policies)
    p.add_argument("--horizon", help="training time left: 90m, 24h, 1d12h or Slurm's "
                   "D-HH:MM:SS, the grammar of coci-submit --time; a bare number needs its unit "
                   "(default: the profile's total_steps, else 24h)")
    p.add_argument("--plateau-loss", type=float, help="stop planning where the fitted loss curve "
                   "reaches this loss (a shorter horizon, when the fit says it comes sooner)")
    p.add_argument("--time-since-failure", help="wall time since the failure that restarted the "
                   "job, e.g. 2h (with a decreasing hazard, checkpoints come sooner after it)")
    p.add_argument("--confidence", type=float, default=0.9, help="interval level (default 0.9)")
    tt_grp = p.add_argument_group("two tiers (memory partner copies + disk; planner/two_tier.py)")
    tt_grp.add_argument("--two-tier", action="store_true",
                        help="also plan memory-tier copies every k steps and disk saves (needs --step-time)")
    tt_grp.add_argument("--memory-copy-s", type=float, help="seconds one partner copy blocks a step")
    tt_grp.add_argument("--memory-restart-cost", type=float, help="seconds to recover from the memory "
                        "tier: survivors' save + restart + restore (default: --restart-cost)")
    tt_grp.add_argument("--whole-job-share", type=float, metavar="F",
                        help="share of the incidents that end the whole job (no survivor), strictly between "
                        "0 and 1 (default: COCI_WHOLE_JOB_SHARE, else learned from --event-log, else "
                        f"{settings.WHOLE_JOB_SHARE_PRIOR:g}, SCR's)")
    tt_grp.add_argument("--outage-rate", type=float, metavar="PER_HOUR",
                        help="outages per hour that end every job, >= 0 (default: COCI_OUTAGE_RATE, else "
                        "learned from the history's partition-wide outages, else "
                        f"1/{settings.OUTAGE_HOURS_PRIOR:g}, Blue Waters')")
    tt_grp.add_argument("--event-log", action="append", default=None, metavar="PATH",
                        help="a run's events.jsonl (or its checkpoint directory), repeatable: its attempts "
                        "that ended whole (no stop, no survivors' save) teach the whole-job share")
    add_json(p, "the plan")
    add_plot(p, "also draw the loss curve and the overhead comparison into this file (.png, .pdf, .svg; "
                "a directory: plan.png in it)")
    return p


def parse_duration(text: str, flag: str = "--horizon") -> float:
    """``flag``'s duration in seconds, in the one grammar of every coci tool
    (:func:`coci_hpc.slurm.timefmt.read_duration`: 24h, 90m, 1d12h, 1-12:00:00); a bare number,
    once seconds here and minutes in ``--time``, is refused with a hint to write the unit."""
    d = read_duration(text, flag=flag, bare=None)
    assert d.seconds is not None
    if d.seconds <= 0:
        raise UsageError(f"{flag} must be > 0, got {d.reading()}", hint=f"e.g. {flag} 24h")
    return d.seconds


def build_failure_model(a, now: float) -> tuple[fmod.FailureModel, dict]:
    """The failure model and a description of where it came from (:mod:`coci_hpc.slurm.failure_input`)."""
    from coci_hpc.slurm.failure_input import FailureInput, failure_model
    return failure_model(FailureInput(
        mtbf_hours=a.mtbf_hours, sacct_file=a.sacct_file, events_file=a.events_file, from_cluster=a.from_cluster,
        since=a.since, until=a.until, partition=a.partition, cluster_nodes=a.cluster_nodes,
        confidence=a.confidence, skip_bad_lines=a.skip_bad_lines,
        maintenance_patterns=tuple(a.maintenance_pattern or ())), now)


class _Shifted:
    """The fitted curve seen from t_now (the simulator starts every run at progress 0)."""

    def __init__(self, fit: CurveFit, t0: float) -> None:
        self.fit, self.t0 = fit, t0

    def loss(self, t):
        import numpy as np
        return self.fit.loss(np.asarray(t, dtype=float) + self.t0)

    def rate(self, t):
        import numpy as np
        return self.fit.rate(np.asarray(t, dtype=float) + self.t0)


def _main(argv: Sequence[str] | None) -> int:
    a = _parser().parse_args(argv)
    target = plot_target(a, PROG, "plan.png")       # refused before the work, not after it
    from coci_hpc.planner import simulator as sim
    from coci_hpc.planner.convergence import FitOutcome, fit_curve
    from coci_hpc.planner.costs import DEFAULT_RESTART_S, Costs
    from coci_hpc.planner.policies import PlanContext, make_policy
    from coci_hpc.planner.profile import Profile
    if a.nodes < 1:
        raise UsageError(f"--nodes must be >= 1, got {a.nodes}", hint="e.g. --nodes 8")
    if not 0 < a.confidence < 1:
        raise UsageError("--confidence must be in (0, 1)", hint="e.g. 0.9")
    for flag, value, strict in (("--ckpt-cost", a.ckpt_cost, True), ("--restart-cost", a.restart_cost, False),
                                ("--step-time", a.step_time, True)):
        if value is not None and not (math.isfinite(value) and (value > 0 if strict else value >= 0)):
            need = "a positive" if strict else "a non-negative"
            raise UsageError(f"{flag} {value:g}: must be {need} number of seconds",
                             hint=f"e.g. {flag} 12 (measured by the runtime; see --profile)")
    if a.persist is not None and not (math.isfinite(a.persist) and a.persist >= 0):
        raise UsageError(f"--persist {a.persist:g}: must be a non-negative number of seconds",
                         hint="e.g. --persist 40 (0 for synchronous saves)")
    policy = make_policy(a.policy)
    # the whole-job inputs are checked before the work (a bad share or rate names its option)
    wj = _whole_job(a) if (a.two_tier or a.event_log or a.whole_job_share is not None
                           or a.outage_rate is not None) else None
    since_failure = (None if a.time_since_failure is None
                     else parse_duration(a.time_since_failure, "--time-since-failure"))
    now = time.time()
    model, fsrc = build_failure_model(a, now)

    prof = Profile.load(a.profile) if a.profile else Profile()
    assumed = []
    pick = lambda flag, key: flag if flag is not None else getattr(prof, key)  # noqa: E731
    ts, tr = pick(a.ckpt_cost, "ckpt_cost_s"), pick(a.restart_cost, "restart_cost_s")
    tp, st = pick(a.persist, "persist_s"), pick(a.step_time, "step_time_s")
    if ts is None:
        ts = DEFAULT_CKPT_COST_S
        assumed.append("ckpt_cost_s")
    if tr is None:
        tr = DEFAULT_RESTART_S
        assumed.append("restart_cost_s")
    if st is None:
        st = prof.measured_step_time()
    costs = Costs(float(ts), float(tr), None if st is None else float(st),
                  persist_s=float(tp or 0.0))

    if prof.samples:
        outcome = fit_curve(prof.times, prof.losses)
        t_now, step_now = prof.t_now(), prof.step_now()
    else:
        outcome = FitOutcome(None, "no loss samples (give --profile)")
        t_now, step_now = 0.0, 0
    horizon, horizon_src = _horizon(a, prof, outcome.fit, costs, t_now, step_now)
    ctx = PlanContext.from_model(model, costs, horizon, a.nodes, t_now=t_now, step_now=step_now,
                                 fit=outcome.fit, fit_reason=outcome.reason,
                                 time_since_failure_s=since_failure)

    names = list(dict.fromkeys([policy.name] + list(COMPARED)))
    policies = {n: (policy if n == policy.name else make_policy(n)) for n in names}
    plans = {n: p.plan(ctx) for n, p in policies.items()}
    plan = plans[policy.name]

    curve = _Shifted(outcome.fit, t_now) if outcome.fit is not None else None
    with progress(PROG, "simulating the plans"):
        expected, sim_info = sim.expected_overhead(
            {n: [t - t_now for t in p.times] for n, p in plans.items()}, ctx.job_rate, horizon,
            costs, curve, confidence=a.confidence)

    lo, hi = model.job_mtbf_interval_s(a.nodes)
    out = {
        "policy": plan.policy, "effective_policy": plan.effective_policy,
        "fallback": plan.fallback,
        "mtbf_hours": model.job_mtbf_s(a.nodes) / 3600.0,
        "mtbf_hours_interval": [lo / 3600.0, None if math.isinf(hi) else hi / 3600.0],
        "nodes": a.nodes, "interval_s": plan.interval_s,
        "checkpoints": [c.to_dict() for c in plan.checkpoints],
        "next_checkpoint": None if not plan.checkpoints else plan.checkpoints[0].to_dict(),
        "expected_overhead": expected,
        "failures": {**model.to_dict(a.nodes), **fsrc},
        "fit": outcome.to_dict(),
        "costs": {**costs.to_dict(), "assumed": assumed},
        "horizon_s": horizon, "horizon_source": horizon_src, "t_now": t_now,
        "step_now": step_now,
        "simulation": sim_info,
        "plans": {n: {"effective_policy": p.effective_policy, "interval_s": p.interval_s,
                      "n_checkpoints": len(p.checkpoints), "fallback": p.fallback,
                      "first": [c.to_dict() for c in p.checkpoints[:5]]}
                  for n, p in plans.items()},
    }
    tt_plan = _two_tier(a, model, costs, horizon, wj) if a.two_tier else None
    if tt_plan is not None:
        out["two_tier"] = tt_plan.to_dict()
    if target is not None:
        with progress(PROG, f"drawing {target}"):
            _plot(str(target), plans, outcome, prof if prof.samples else None, t_now, horizon, expected,
                  out)
        out["plot"] = str(target)
    if a.json:
        print_json(out)
        if target is not None:
            print(f"{PROG}: plot written to {target}", file=sys.stderr)
    else:
        _summary(out, model, outcome, plans, a)
        if tt_plan is not None:
            from coci_hpc.planner.two_tier import describe
            print("\n".join(describe(tt_plan)))
        if target is not None:
            print(f"plot: {target}")
    return 0


def _two_tier(a, model, costs: Costs, horizon: float, wj: dict | None) -> two_tier.TwoTierPlan:
    from coci_hpc.planner import two_tier
    if a.memory_copy_s is None or not (math.isfinite(a.memory_copy_s) and a.memory_copy_s >= 0):
        raise UsageError("--two-tier needs --memory-copy-s: the seconds one partner copy blocks a step",
                         hint="measure it (benchmarks/partner_copy_bench.py), e.g. --memory-copy-s 0.5")
    if costs.step_time_s is None:
        raise UsageError("--two-tier needs the step time", hint="pass --step-time or a profile with step_time_s")
    rm = costs.restart_s if a.memory_restart_cost is None else a.memory_restart_cost
    tc = two_tier.TierCosts(float(a.memory_copy_s), costs.ckpt_s, float(rm), costs.restart_s,
                            costs.step_time_s)
    return two_tier.plan_two_tier(tc, two_tier.profile_from_model(model, a.nodes, whole_job=wj),
                                  horizon)


def _whole_job(a) -> dict:
    """The whole-job model's inputs (:func:`coci_hpc.planner.whole_job.resolve`): the options, else
    the COCI_* settings; the event logs' ends. Bad values name the option or setting."""
    import os

    from coci_hpc.planner import whole_job as wjm
    from coci_hpc.runtime import events as ev
    kw = wjm.given_from_settings(os.environ)
    if a.whole_job_share is not None:
        kw.update(share=wjm.check_share(a.whole_job_share, "--whole-job-share"), share_name="--whole-job-share")
    if a.outage_rate is not None:
        wjm.check_outage_rate(a.outage_rate, "--outage-rate")
        kw.update(outage_per_hour=a.outage_rate, outage_name="--outage-rate")
    if a.event_log:
        whole = other = 0
        for path in a.event_log:
            f = os.path.join(path, ev.FILENAME) if os.path.isdir(path) else path
            if not os.path.isfile(f):
                raise UsageError(f"--event-log {path}: no such file", hint="give a run's events.jsonl or its "
                                 "checkpoint directory (coci-submit --ckpt-dir)")
            recs = ev.read_records(f)
            if not any(isinstance(r, ev.AttemptStart) for r in recs):
                raise UsageError(f"--event-log {path}: no attempt records in it, nothing to learn the whole-job "
                                 "share from", hint="give the events.jsonl of a run that started (coci-status "
                                 "shows its attempts), or drop --event-log to use the default share")
            w, o = ev.whole_job_ends(recs)
            whole, other = whole + w, other + o
        kw["learned_share"] = (whole, other)
    return kw


def _horizon(a, prof: Profile, fit: CurveFit | None, costs: Costs, t_now: float,
             step_now: int) -> tuple[float, str]:
    """Training time left: --horizon, else the profile's total_steps, else 24 h; shortened to
    where the fitted curve reaches --plateau-loss when that comes first."""
    if a.horizon is not None:
        h, src = parse_duration(a.horizon), "--horizon"
    elif prof.total_steps is not None and costs.step_time_s and prof.total_steps > step_now:
        h, src = (prof.total_steps - step_now) * costs.step_time_s, "profile total_steps"
    else:
        h, src = DEFAULT_HORIZON_S, "default 24h"
    if a.plateau_loss is not None:
        if fit is None:
            raise UsageError("--plateau-loss needs a loss curve", hint="give --profile with samples")
        t = fit.time_at_loss(a.plateau_loss)
        if math.isfinite(t) and t_now < t < t_now + h:
            h, src = t - t_now, f"fitted curve reaches loss {a.plateau_loss:g}"
    return h, src


def _counts(d: dict, top: int = 8) -> str:
    items = list(d.items())
    text = ", ".join(f"{k}: {v}" for k, v in items[:top])
    return (text + (f", ... ({len(items) - top} more)" if len(items) > top else "")) or "none"


def _fmt_h(s: float | None) -> str:
    if s is None:
        return "inf"
    return f"{s / 3600:.3g} h" if s >= 3600 else f"{s / 60:.3g} min" if s >= 60 else f"{s:.3g} s"


def _pm(iv: list[float] | None) -> str:
    """Half the width of an interval, in the table's units."""
    return "-" if not iv else "± " + _fmt_h((iv[1] - iv[0]) / 2)


def _vs(iv: list[float] | None, is_ref: bool) -> str:
    if is_ref:
        return "(reference)"
    if not iv:
        return "-"
    lo, hi = iv
    if lo <= 0.0 <= hi:
        return "same"
    sign = "+" if lo > 0 else "-"
    a, b = sorted((abs(lo), abs(hi)))
    return f"{sign}{_fmt_h(a)}..{_fmt_h(b)}"


def _summary(out: dict, model, outcome: FitOutcome, plans: dict, a) -> None:
    f = out["failures"]
    w = print
    if f.get("source") == "--mtbf-hours":
        w(f"failure rate: given, per-node MTBF {1 / model.per_node_rate / 3600:.4g} h")
    else:
        w(f"failure history {f.get('window_start')} .. {f.get('window_end')}: "
          f"{f.get('records', model.n_failures)} failure record(s) -> {model.n_failures} "
          f"incident(s) after declustering, over {f.get('exposure_node_hours', 0):.4g} node-hours "
          f"({f.get('exposure_basis', '')})")
        w("  by node:   " + _counts(f.get("by_node", {})))
        w("  by reason: " + _counts(f.get("by_reason", {})))
        ann = {k: v for k, v in f.get("announced_not_counted", {}).items() if v}
        if ann:
            w("  announced, not failures (a signal came first): " + _counts(ann))
    if f.get("skipped_lines"):
        w(f"  skipped {f['skipped_lines']} malformed line(s)")
    if f.get("filtered_maintenance"):
        w(f"  ignored {f['filtered_maintenance']} maintenance event(s)")
    lo, hi = out["mtbf_hours_interval"]
    ival = ("no interval (given)" if model.n_failures == 0 and model.exposure_node_s == 0 else
            f"{model.confidence:.0%} interval [{lo:.4g}, {'inf' if hi is None else f'{hi:.4g}'}] h")
    w(f"job MTBF ({a.nodes} node(s)): {out['mtbf_hours']:.4g} h, {ival}; "
      f"distribution {model.distribution}"
      + (f" (Weibull shape {model.weibull_shape:.3g})" if model.weibull_shape else ""))
    w("curve: " + (outcome.fit.describe() if outcome.fit else f"none ({outcome.reason})"))
    c = out["costs"]
    step = "?" if c["step_time_s"] is None else f"{c['step_time_s']:.4g} s"
    w(f"costs: Tb {c['ckpt_s']:g} s, P {c['persist_s']:g} s, Tr {c['restart_s']:g} s, step {step}"
      + (f"  (assumed: {', '.join(c['assumed'])})" if c["assumed"] else ""))
    plan = plans[out["policy"]]
    w(f"policy {out['policy']}" + (f" -> {plan.effective_policy}: {plan.fallback}"
                                   if plan.fallback else "")
      + (f", interval {_fmt_h(plan.interval_s)}" if plan.interval_s else ""))
    nxt = ", ".join(f"{_fmt_h(ck.time_s)}" + (f" (step {ck.step})" if ck.step is not None else "")
                    for ck in plan.checkpoints[:5])
    w(f"next checkpoints (training time): {nxt or 'none within the horizon'}"
      + (f" ... {len(plan.checkpoints)} in {_fmt_h(out['horizon_s'])}" if plan.checkpoints else ""))
    sim_info = out["simulation"]
    if sim_info.get("note"):
        w(f"expected overhead: {sim_info['note']}")
        return
    ref = sim_info.get("reference") or out["policy"]
    conf = f"{sim_info.get('confidence', a.confidence):.0%}"
    w(f"expected overhead over {_fmt_h(out['horizon_s'])} ({sim_info['runs']} simulated runs, "
      "same traces for every policy):")
    vs = f"vs {ref} ({conf})"
    w(f"  {'policy':12s} {'ckpts':>6s} {'complete time':>14s} {'± ' + conf:>10s} {vs:>22s} {'%':>6s}"
      f" {'progress':>10s} {'exploratory time':>17s} {'progress':>10s}")
    for n, e in out["expected_overhead"].items():
        ex = e["exploratory"]
        pg = "-" if e["progress_loss"] is None else f"{e['progress_loss']:.4g}"
        pge = "-" if ex["overhead_progress"] is None else f"{ex['overhead_progress']:.4g}"
        w(f"  {n:12s} {e['n_checkpoints']:6d} {_fmt_h(e['time_s']):>14s} {_pm(e.get('time_s_interval')):>10s} "
          f"{_vs(e.get('vs_reference_s'), n == ref):>22s} "
          f"{100 * e['time_fraction']:5.2f}% {pg:>10s} {_fmt_h(ex['overhead_s']):>17s} {pge:>10s}")
    w("  complete: jobs that train the whole horizon; exploratory: jobs stopped early (log-uniform, 2-100 % of it)")
    w("  time: checkpoint stalls + recomputed work + restarts; progress: the loss drop that time costs")
    w(f"  ±: {conf} interval of the mean over the runs; vs {ref}: the difference on the same runs, "
      "'same' when its interval holds 0 (no real difference)")


def _plot(path: str, plans: dict, outcome: FitOutcome, prof: Profile | None, t_now: float,
          horizon: float, expected: dict, out: dict) -> None:
    import matplotlib
    import numpy as np
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2, 1]})
    t_end = t_now + horizon
    fit = outcome.fit
    if prof is not None:
        ax.plot(np.asarray(prof.times) / 3600, prof.losses, ".", color="0.5", ms=3,
                label="observed loss")
    if fit is not None:
        grid = np.linspace(0, t_end, 400)
        ax.plot(grid / 3600, fit.loss(grid), "k-", lw=1.5, label=f"fit ({fit.kind})")
        top = float(fit.loss(0.0))
        bottom = float(fit.loss(t_end))
    else:
        top, bottom = 1.0, 0.0
    span = max(top - bottom, 1e-9)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rows: list[tuple[float, str]] = []
    for i, (n, p) in enumerate(plans.items()):
        y0 = bottom - span * (0.08 + 0.07 * i)
        rows.append((y0, n))
        ts = np.asarray(p.times) / 3600
        ax.plot(ts, np.full(ts.size, y0), "|", ms=9, color=colors[i % len(colors)],
                label=f"{n}: {len(ts)} checkpoints" + (" (fallback young)" if p.fallback else ""))
    ax.axvline(t_now / 3600, color="0.7", ls=":", lw=1)
    ax.set_xlabel("training time (hours)")
    if fit is not None:
        ax.set_ylabel("loss (fitted curve; marks = checkpoints)")
    else:  # no loss axis to show: one labelled row of marks per policy
        ax.set_yticks([y for y, _ in rows], [n for _, n in rows])
        ax.set_ylabel("policy (marks = checkpoints)")
    ax.set_title(f"Checkpoint plans, job MTBF {out['mtbf_hours']:.3g} h, "
                 f"Ts {out['costs']['ckpt_s']:g} s")
    ax.legend(fontsize=8, loc="upper right")
    names = [n for n in expected if expected[n].get("complete")]
    if not names:
        bx.text(0.5, 0.5, "overhead not simulated\n(job MTBF too short)", ha="center",
                va="center", transform=bx.transAxes)
    x = np.arange(len(names))
    comp = [100 * expected[n]["complete"]["overhead_fraction"] for n in names]
    expl = [100 * expected[n]["exploratory"]["overhead_fraction"] for n in names]
    bx.bar(x - 0.2, comp, 0.4, label="complete jobs")
    bx.bar(x + 0.2, expl, 0.4, label="exploratory (stopped early)")
    bx.set_xticks(x, names, rotation=20)
    bx.set_ylabel("expected overhead (% of useful training time)")
    bx.set_title("Expected overhead\n(checkpoints + lost work + restarts)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UsageError(f"cannot write plot {path}: {exc.strerror}", hint="check --plot") from exc
    finally:
        plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
