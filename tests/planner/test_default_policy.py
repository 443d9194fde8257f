"""The default policy `coci`: Bougeret's end game, the asynchronous-save interval rule, the
hazard layer, and the names of the published rule."""
import math

import numpy as np
import pytest

from coci_hpc.planner import horizon
from coci_hpc.planner.costs import Costs
from coci_hpc.planner.hazard import JobHazard
from coci_hpc.planner.policies import PlanContext, daly_interval, make_policy, young_interval


def test_bougeret_k0_hand_worked():
    # lambda = 1/h, W = 10 h, C = 60 s. z = -exp(-lambda*C - 1); near the branch point
    # W0(z) = -1 + p - p^2/3 + 11 p^3/72 - 43 p^4/540 with p = sqrt(2 (1 + e z)):
    lam, w, c = 1 / 3600, 36000.0, 60.0
    p = math.sqrt(2 * (1 - math.exp(-lam * c)))                  # 0.181568
    w0 = -1 + p - p ** 2 / 3 + 11 * p ** 3 / 72 - 43 * p ** 4 / 540
    assert horizon.bougeret_k0(lam, w, c) == pytest.approx(lam * w / (1 + w0), rel=1e-3)
    assert horizon.bougeret_k0(lam, w, c) == pytest.approx(58.26, abs=0.01)
    assert horizon.bougeret_k(lam, w, c) == 58                   # floor beats ceil here
    # small lambda*C: K0 -> W / Young's interval
    assert horizon.bougeret_k0(1e-7, 1e6, 1.0) == pytest.approx(1e6 / young_interval(1.0, 1e7),
                                                                 rel=2e-3)
    # a short job on a reliable machine: one chunk, no checkpoint
    assert horizon.bougeret_k(1 / 86400, 3600.0, 60.0) == 1


def test_bougeret_k_picks_the_smaller_makespan_of_floor_and_ceil():
    lam, w, c = 1e-4, 1e5, 600.0
    k0 = horizon.bougeret_k0(lam, w, c)                           # 32.51
    lo, hi = math.floor(k0), math.ceil(k0)
    ms = {k: horizon.bougeret_makespan(k, lam, w, c) for k in (lo, hi)}
    assert horizon.bougeret_k(lam, w, c) == min(ms, key=ms.get) == 33


def test_default_is_equal_chunks_without_a_trailing_checkpoint():
    ctx = PlanContext(Costs(30.0, 150.0), 1 / 14400, 86400.0)
    plan = make_policy("coci").plan(ctx)
    k = plan.params["chunks"]
    assert plan.interval_s == pytest.approx(86400.0 / k)
    assert len(plan.times) == k - 1 and plan.times[-1] < 86400.0 - 1
    assert plan.interval_s == pytest.approx(daly_interval(30.0, 14400), rel=0.03)
    # the chunk count minimises the exact expected wall time of K chunks, K-1 checkpoints
    e = {j: horizon.makespan_no_final(j, 1 / 14400, 86400.0, 30.0, 150.0) for j in range(k - 5, k + 6)}
    assert min(e, key=e.get) == k


def test_async_interval_uses_the_blocking_cost_and_is_bounded_by_persist():
    lam = 1 / 14400
    sync = make_policy("coci").plan(PlanContext(Costs(2.0, 150.0), lam, 86400.0))
    short_p = make_policy("coci").plan(PlanContext(Costs(2.0, 150.0, persist_s=60.0), lam, 86400.0))
    # P below sqrt(2 Tb / lambda) does not move the interval (not Young(Tb + P))
    assert short_p.interval_s == pytest.approx(sync.interval_s)
    assert short_p.interval_s == pytest.approx(young_interval(2.0, 14400), rel=0.03)
    assert short_p.interval_s < 0.5 * young_interval(62.0, 14400)
    # P above it: the interval is P (the next save cannot start before the last is persisted)
    long_p = make_policy("coci").plan(PlanContext(Costs(2.0, 150.0, persist_s=900.0), lam, 86400.0))
    assert long_p.interval_s >= 900.0
    assert long_p.interval_s == pytest.approx(900.0, rel=0.02)


def test_hazard_layer_front_loads_after_a_restart():
    costs = Costs(30.0, 150.0)
    expo = make_policy("coci").plan(PlanContext(costs, 1 / 14400, 86400.0, nodes=1))
    assert expo.params["mode"] == "exponential"
    fresh = make_policy("coci").plan(PlanContext(costs, 1 / 14400, 86400.0, nodes=1,
                                                 weibull_shape=0.5))
    after = make_policy("coci").plan(PlanContext(costs, 1 / 14400, 86400.0, nodes=1,
                                                 weibull_shape=0.5, time_since_failure_s=0.0))
    assert fresh.params["mode"] == after.params["mode"] == "hazard"
    g_after, g_fresh = np.diff([0.0] + after.times), np.diff([0.0] + fresh.times)
    assert g_after[0] < 0.5 * expo.interval_s                 # dense right after the failure
    assert np.all(np.diff(g_after[:-3]) > 0)                  # then growing
    # a node of unknown age is not a fresh one: less front-loading, but the hazard still falls
    assert g_after[0] < expo.interval_s * 0.99 < g_fresh[0]      # survivors: hazard below the mean
    assert np.all(np.diff(g_fresh[:-3]) >= 0)
    # many nodes: the others' (stationary) hazard dominates, the first intervals are Daly's
    big = make_policy("coci").plan(PlanContext(costs, 64 / 14400, 86400.0, nodes=64,
                                               weibull_shape=0.7, time_since_failure_s=0.0))
    d = daly_interval(30.0, 14400 / 64)
    assert np.diff([0.0] + big.times)[:5] == pytest.approx([d] * 5, rel=0.1)


def test_job_hazard_mean_rate_matches_the_node_rate_at_long_ages():
    hz = JobHazard(1 / 14400, 0.6, 1)
    # the mean of the Weibull is 1/r: E[H(T)] at the mean gap equals ... its scale from Gamma
    assert hz.scale_s == pytest.approx(14400 / math.gamma(1 + 1 / 0.6))
    assert hz.mean_rate(0.0, 1.0) > 10 * hz.mean_rate(1e5, 1.0)


@pytest.mark.parametrize("spec,name", [("coci-paper", "coci-paper"),
                                       ("coci-paper:capped", "coci-paper:capped"),
                                       ("coci-paper:dp=2,1.5", "coci-paper:dp=2,1.5"),
                                       ("coci", "coci")])
def test_policy_names(spec, name):
    assert make_policy(spec).name == name
    assert make_policy(make_policy(spec).name).name == name


def test_costs_persist_roundtrip_and_old_dicts():
    c = Costs(2.0, 150.0, 0.5, persist_s=30.0)
    assert Costs.from_dict(c.to_dict()) == c
    assert Costs.from_dict({"ckpt_s": 2.0, "restart_s": 150.0}).persist_s == 0.0
    assert Costs(2.0, 150.0, 0.5).persist_s == 0.0
