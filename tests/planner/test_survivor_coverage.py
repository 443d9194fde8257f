"""The planner's lost-work term with survivors' saves: a covered failure (a lost rank or node in
data-parallel training) loses ~one step, so only the uncovered rate job_rate * (1 - coverage)
drives the default's interval; the simulator every policy shares models the same thing; the
runtime's estimate of the coverage. Hand-worked values."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from coci_hpc.checkpoint import PerRank, Sharded
from coci_hpc.checkpoint.state import collect
from coci_hpc.errors import PlannerError
from coci_hpc.planner import simulator as sim
from coci_hpc.planner.costs import Costs
from coci_hpc.planner.hazard import JobHazard
from coci_hpc.planner.online import OnlinePlanner
from coci_hpc.planner.policies import CociDefault, PlanContext, daly_interval
from coci_hpc.runtime import survivors as sv


def _ctx(**kw) -> PlanContext:
    base = dict(costs=Costs(50.0, 150.0), job_rate=1.0 / 10_000.0, horizon_s=1_000_000.0)
    base.update(kw)
    return PlanContext(**base)


def test_daly_on_the_uncovered_rate_hand_worked() -> None:
    # Tb = 50 s, MTBF 10,000 s. Daly: sqrt(2*50*M) * (1 + sqrt(50/2M)/3 + (50/2M)/9) - 50.
    # Coverage 0:    M = 10,000: 1000 * (1 + 0.05/3 + 0.0025/9) - 50 = 966.9444 s
    # Coverage 0.75: M = 40,000: 2000 * (1 + 0.025/3 + 0.000625/9) - 50 = 1966.8056 s (x 2.03 ~ sqrt 4)
    p0 = CociDefault().plan(_ctx())
    p75 = CociDefault().plan(_ctx(survivor_coverage=0.75))
    assert p0.params["daly_s"] == pytest.approx(966.9444, abs=1e-3)
    assert p75.params["daly_s"] == pytest.approx(1966.8056, abs=1e-3)
    assert p75.params["rollback_rate_per_s"] == pytest.approx(0.25e-4)
    assert p75.job_rate == p0.job_rate == 1e-4                 # the plan still reports the job's rate
    # the end game cuts the horizon into equal chunks near that period
    assert p0.interval_s == pytest.approx(966.9444, rel=0.01)
    assert p75.interval_s == pytest.approx(1966.8056, rel=0.01)
    # coverage 0.9 -> x sqrt(10) at first order (Young's term dominates when Tb << M)
    ctx = _ctx(costs=Costs(1.0, 150.0), job_rate=1e-6)
    r = CociDefault().plan(replace(ctx, survivor_coverage=0.9)).params["daly_s"] / CociDefault().plan(ctx).params["daly_s"]
    assert r == pytest.approx(math.sqrt(10.0), rel=0.01)


@pytest.mark.parametrize("kw", [
    {},                                                            # exponential: end-game chunks
    {"weibull_shape": 0.6, "nodes": 4, "time_since_failure_s": 3600.0},     # hazard walk
    {"incidents": 20, "record_rate": 2e-4},                         # short history: Daly's fallback
])
def test_coverage_zero_is_exactly_the_plan_without_it(kw: dict) -> None:
    without = CociDefault().plan(_ctx(**kw))
    zero = CociDefault().plan(_ctx(survivor_coverage=0.0, **kw))
    assert zero.times == without.times and zero.interval_s == without.interval_s
    assert zero.effective_policy == without.effective_policy and zero.params == without.params
    assert CociDefault().plan(_ctx(survivor_coverage=0.5, **kw)).times != without.times


def test_covered_hazard_and_fallback_use_the_uncovered_rate() -> None:
    hz = JobHazard(1e-5, 0.6, 4, True)
    half = replace(hz, rollback_fraction=0.5)
    for a in (10.0, 3600.0, 86400.0):
        assert half.cumulative(a) == pytest.approx(0.5 * hz.cumulative(a), rel=1e-12)
    fb = CociDefault().plan(_ctx(incidents=20, record_rate=2e-4, survivor_coverage=0.5))
    assert fb.effective_policy == "daly" and fb.interval_s == pytest.approx(daly_interval(50.0, 1.0 / 1e-4))


def test_full_coverage_plans_no_checkpoint_and_bad_coverage_is_refused() -> None:
    p = CociDefault().plan(_ctx(survivor_coverage=1.0))
    assert p.checkpoints == () and p.params["mode"] == "all-covered"
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(PlannerError, match="survivor_coverage"):
            _ctx(survivor_coverage=bad)


def _every_100(p: float, rem: float, age: float | None) -> list[float]:
    return [x for x in range(100, 1000, 100) if x > p]


def test_simulator_covered_failure_loses_one_step_hand_worked() -> None:
    """Tb 10, Tr 20, work 1000, checkpoints every 100 of progress, one failure at wall 250.
    Uncovered: computing step 200->300 from wall 220, it dies at progress 230: lost 30, restart 20,
    9 saves: overhead 90 + 30 + 20 = 140. Covered (one step = 1 s, survivors write 5 s): lost 1,
    restart 5 + 20: overhead 90 + 1 + 25 = 116."""
    costs = Costs(10.0, 20.0)
    f = np.array([250.0])
    plain = sim.run_adaptive(_every_100, 1000.0, f, costs)
    assert (plain.lost_s, plain.restart_s, plain.overhead_s) == pytest.approx((30.0, 20.0, 140.0))
    assert sim.run_adaptive(_every_100, 1000.0, f, costs, covered=np.array([False])).overhead_s == plain.overhead_s
    cov = sim.run_adaptive(_every_100, 1000.0, f, costs, covered=np.array([True]), covered_lost_s=1.0,
                           covered_save_s=5.0)
    assert (cov.lost_s, cov.restart_s, cov.overhead_s, cov.n_ckpts) == pytest.approx((1.0, 25.0, 116.0, 9))


def test_simulator_coverage_zero_changes_nothing_and_flags_are_common_random_numbers() -> None:
    rng = np.random.default_rng(4)
    traces = [sim.sample_trace(rng, 1e-3, 20_000.0) for _ in range(20)]
    costs = Costs(10.0, 30.0)
    pl = {"every100": _every_100}
    none = sim.overhead_adaptive(pl, traces, 1000.0, costs)["every100"]
    flags0 = sim.covered_flags(np.random.default_rng(1), traces, 0.0)
    assert not any(f.any() for f in flags0)
    assert np.array_equal(sim.overhead_adaptive(pl, traces, 1000.0, costs, covered=flags0)["every100"], none)
    flags = sim.covered_flags(np.random.default_rng(1), traces, 0.9)
    assert [f.size for f in flags] == [t.size for t in traces]
    assert all(np.array_equal(a, b) for a, b in zip(flags, sim.covered_flags(np.random.default_rng(1), traces, 0.9)))
    assert 0.8 < np.concatenate(flags).mean() < 0.97
    covered = sim.overhead_adaptive(pl, traces, 1000.0, costs, covered=flags, covered_lost_s=1.0)["every100"]
    assert covered.mean() < none.mean()


def test_default_gains_over_daly_when_most_failures_are_covered() -> None:
    """On the same traces with 90 % of the failures covered, the default (which knows it) spends
    less than Daly (which does not): fewer checkpoints, ~the same lost work."""
    lam, w = 8 / (100 * 3600.0), 24 * 3600.0
    costs = Costs(120.0, 150.0)
    rng = np.random.default_rng(7)
    traces = [sim.sample_trace(rng, lam, 3 * w + 50 / lam) for _ in range(60)]
    flags = sim.covered_flags(np.random.default_rng(8), traces, 0.9)

    def planner(spec_cov: float, daly: bool):
        ctx = PlanContext(costs, lam, w, survivor_coverage=spec_cov)

        def plan(p: float, rem: float, age: float | None) -> list[float]:
            c = replace(ctx, t_now=p, horizon_s=rem)
            if daly:
                iv = daly_interval(costs.ckpt_s, 1.0 / lam)
                return [p + iv * (i + 1) for i in range(int(rem // iv))]
            return CociDefault().plan(c).times
        return plan

    res = sim.overhead_adaptive({"coci": planner(0.9, False), "daly": planner(0.0, True)}, traces, w, costs,
                                covered=flags, covered_lost_s=1.0)
    assert res["coci"].mean() < 0.8 * res["daly"].mean()


def test_online_planner_keeps_the_coverage_across_a_restart() -> None:
    from coci_hpc.planner.failures import from_mtbf

    op = OnlinePlanner("coci", from_mtbf(10_000.0), 1, Costs(50.0, 150.0), 1_000_000.0, survivor_coverage=0.75)
    assert op.plan.params["daly_s"] == pytest.approx(1966.8056, abs=1e-3)
    back = OnlinePlanner.from_state(op.to_state())
    assert back.survivor_coverage == 0.75 and back.replan(0, 0.0).params["daly_s"] == op.plan.params["daly_s"]


def test_runtime_coverage_estimate_from_the_event_log_and_the_layout() -> None:
    lost = lambda ok: {"event": "peer_lost", "committed": ok}           # noqa: E731
    assert sv.coverage_estimate([], eligible=True) == 0.5
    assert sv.coverage_estimate([lost(True)] * 8, eligible=True) == pytest.approx(0.9)
    assert sv.coverage_estimate([lost(True), lost(False)], eligible=True) == pytest.approx(0.5)
    assert sv.coverage_estimate([lost(True)] * 8, eligible=False) == 0.0
    model = torch.nn.BatchNorm1d(2)
    leaves = collect({"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1),
                      "extra": PerRank({"n": torch.zeros(1)})}, rng=False)[1]
    assert sv.held_in_parts(leaves) == []
    leaves = collect({"model": model, "emb": {"rows": Sharded(torch.zeros(2, 2))}}, rng=False)[1]
    assert sv.held_in_parts(leaves) == ["replicated/emb/rows"]
