"""Policy formulas against hand-worked values, and plan properties."""
import math

import numpy as np
import pytest

from coci_hpc.errors import PlannerError, UsageError
from coci_hpc.planner.convergence import CurveFit
from coci_hpc.planner.costs import Costs
from coci_hpc.planner.policies import CociPaper as Coci
from coci_hpc.planner.policies import (
    PlanContext,
    checkfreq_interval,
    coci_pe,
    daly_interval,
    make_policy,
    young_interval,
)


def exp_fit(theta1=-1e-4, theta2=math.log(2.0), floor=0.0):  # noqa: B008 - a constant, evaluated once on purpose
    return CurveFit("exp" if floor == 0 else "exp_floor", theta1, theta2, floor, 0.0, 1.0, 100)


def test_young_hand_worked():
    # sqrt(2 * 300 s * 86400 s) = 7200 s exactly
    assert young_interval(300.0, 86400.0) == pytest.approx(7200.0)


def test_daly_hand_worked():
    # d=300 s, M=24 h: sqrt(2dM)=7200, sqrt(d/2M)=1/24, d/2M=1/576
    # 7200*(1 + 1/72 + 1/5184) - 300 = 7001.3888...
    assert daly_interval(300.0, 86400.0) == pytest.approx(7200 * (1 + 1 / 72 + 1 / 5184) - 300)
    assert daly_interval(300.0, 86400.0) == pytest.approx(7001.38889, abs=1e-4)


def test_daly_when_cost_exceeds_twice_mtbf_is_mtbf():
    assert daly_interval(500.0, 200.0) == 200.0


def test_daly_close_to_young_for_small_cost():
    y, d = young_interval(1.0, 1e6), daly_interval(1.0, 1e6)
    assert abs(d - y) / y < 2e-3


def test_checkfreq_hand_worked():
    # Ts/(T+Ts) <= 3.5%  ->  T >= 3.5*0.965/0.035 = 96.5 s
    assert checkfreq_interval(3.5, 0.035, None) == pytest.approx(96.5)
    # whole steps of 10 s: 97 s rounds up to 100 s (10 steps)
    assert checkfreq_interval(3.5, 0.035, 10.0) == pytest.approx(100.0)
    with pytest.raises(UsageError):
        checkfreq_interval(1.0, 0.0, None)


def test_coci_pe_hand_worked():
    # per minute: theta1=-0.01, Ts=0.1 min, lambda=1/240
    # Pe = (1 - e^-0.001) * (120 + 50) = 0.169915028...
    pe = coci_pe(-0.01 / 60, 6.0, 1 / 14400)
    assert pe == pytest.approx((1 - math.exp(-0.001)) * 170.0)
    assert pe == pytest.approx(0.1699150283, rel=1e-9)


def test_coci_pe_rejects_increasing_curve():
    with pytest.raises(PlannerError):
        coci_pe(1e-4, 1.0, 1e-4)


def ctx(fit=None, **kw):
    base = dict(costs=Costs(6.0, 120.0, 0.5), job_rate=1 / 14400, horizon_s=6 * 3600.0, fit=fit)
    base.update(kw)
    return PlanContext(**base)


def test_coci_places_checkpoints_at_equal_loss_drops():
    fit = exp_fit()
    c = ctx(fit)
    plan = Coci(max_interval_factor=None).plan(c)
    pe = coci_pe(fit.theta1, 6.0, 1 / 14400)
    l0 = float(fit.loss(0.0))
    losses = [float(fit.loss(t)) for t in plan.times]
    assert len(losses) >= 3
    for i, l in enumerate(losses, start=1):
        assert l0 - l == pytest.approx(i * pe, rel=1e-6)
    gaps = np.diff([0.0] + plan.times)
    assert np.all(np.diff(gaps) > 0)          # dense early, sparse late
    assert plan.interval_s is None


def test_coci_cap_bounds_gaps_and_covers_horizon():
    fit = exp_fit(floor=1.0)                  # floor: the curve cannot drop forever
    c = ctx(fit)
    plan = Coci(max_interval_factor=2.0).plan(c)
    cap = 2.0 * young_interval(6.0, 14400)
    gaps = np.diff([0.0] + plan.times)
    assert gaps.max() <= cap + 1e-6
    assert plan.times[-1] > c.horizon_s - cap


def test_coci_data_parallel_variant_scales_time_and_cost():
    fit = exp_fit()
    base = Coci(max_interval_factor=None).plan(ctx(fit))
    dp = Coci(theta_scale=2.0, max_interval_factor=None).plan(ctx(fit))
    # Pe uses 2*theta1; the curve is walked twice as fast
    pe2 = coci_pe(2 * fit.theta1, 6.0, 1 / 14400)
    assert dp.params["pe"] == pytest.approx(pe2)
    l0 = float(fit.loss(0.0))
    t1 = dp.times[0]
    assert l0 - float(fit.loss(2 * t1)) == pytest.approx(pe2, rel=1e-6)
    assert make_policy("coci-paper:dp=2,1.5").name == "coci-paper:dp=2,1.5"
    assert base.policy == "coci-paper"


def test_coci_falls_back_to_young_with_reason():
    c = ctx(None, fit_reason="too few samples")
    plan = Coci(max_interval_factor=2.0).plan(c)
    assert plan.effective_policy == "young"
    assert "too few samples" in plan.fallback
    assert plan.interval_s == pytest.approx(young_interval(6.0, 14400))


def test_coci_never_checkpoints_more_often_than_ts():
    fit = exp_fit(theta1=-1e-2)               # very fast curve, tiny Pe spacing
    plan = Coci(max_interval_factor=2.0).plan(ctx(fit, costs=Costs(30.0, 10.0)))
    assert np.diff([0.0] + plan.times).min() >= 30.0 - 1e-9


def test_uniform_policies_times_and_steps():
    c = ctx(None)
    p = make_policy("young").plan(c)
    iv = young_interval(6.0, 14400)
    assert p.interval_s == pytest.approx(iv)
    assert p.times[:2] == pytest.approx([iv, 2 * iv])
    assert p.checkpoints[0].step == round(iv / 0.5)
    assert p.next_checkpoint().time_s == pytest.approx(iv)
    assert p.next_checkpoint(iv).time_s == pytest.approx(2 * iv)
    f = make_policy("fixed:100").plan(c)
    assert [ck.step for ck in f.checkpoints[:3]] == [100, 200, 300]
    assert f.interval_s == pytest.approx(50.0)


def test_plan_from_t_now_continues_steps():
    c = ctx(None, t_now=1000.0, step_now=2000)
    p = make_policy("fixed:10").plan(c)
    assert p.checkpoints[0].time_s == pytest.approx(1005.0)
    assert p.checkpoints[0].step == 2010
    assert p.next_step(2010) == 2020


def test_fixed_needs_step_time():
    with pytest.raises(PlannerError):
        make_policy("fixed:10").plan(ctx(None, costs=Costs(6.0, 1.0)))


@pytest.mark.parametrize("spec", ["bogus", "fixed:", "fixed:0", "coci:dp=", "checkfreq:x"])
def test_bad_policy_names(spec):
    with pytest.raises(UsageError):
        make_policy(spec)


def test_context_validation():
    with pytest.raises(PlannerError):
        ctx(None, job_rate=0.0)
    with pytest.raises(PlannerError):
        ctx(None, horizon_s=-1.0)
    with pytest.raises(PlannerError):
        Costs(0.0, 1.0)
