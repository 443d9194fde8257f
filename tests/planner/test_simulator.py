"""Simulator: hand-worked runs, accounting identities, common random numbers."""
import numpy as np
import pytest

from coci_hpc.planner import simulator as sim
from coci_hpc.planner.convergence import CurveFit
from coci_hpc.planner.costs import Costs

COSTS = Costs(ckpt_s=10.0, restart_s=100.0)
NOFAIL = np.empty(0)


def test_no_failures_costs_exactly_the_checkpoints():
    r = sim.run_one([100, 200, 300], 1000.0, NOFAIL, COSTS)
    assert r.wall_s == pytest.approx(1030.0)
    assert (r.ckpt_s, r.lost_s, r.restart_s, r.n_ckpts) == (30.0, 0.0, 0.0, 3)


def test_checkpoint_at_or_after_stop_is_not_taken():
    r = sim.run_one([500, 1000, 1500], 1000.0, NOFAIL, COSTS)
    assert r.n_ckpts == 1 and r.wall_s == pytest.approx(1010.0)


def test_one_failure_while_computing_hand_worked():
    # ckpts at 100 (done at wall 110) and 200 (done 220); fail at wall 250: progress 230,
    # lost 30 s, restart 100 -> resume at wall 350 from 200; +100 s work to stop 300 -> 450
    r = sim.run_one([100, 200], 300.0, np.array([250.0]), COSTS)
    assert r.lost_s == pytest.approx(30.0)
    assert r.restart_s == pytest.approx(100.0)
    assert r.wall_s == pytest.approx(450.0)
    assert r.n_failures == 1


def test_failure_while_writing_a_checkpoint():
    # ckpt 100 is written during wall 100..110; fail at 105: 100 s of work lost, 5 s of ckpt wasted
    r = sim.run_one([100], 200.0, np.array([105.0]), COSTS)
    assert r.lost_s == pytest.approx(100.0)
    assert r.ckpt_s == pytest.approx(5.0 + 10.0)
    assert r.wall_s == pytest.approx(105 + 100 + 100 + 10 + 100)


def test_failure_during_restart_restarts_again():
    r = sim.run_one([], 100.0, np.array([50.0, 120.0]), COSTS)
    # fail 50 (lost 50), restart until 150 but fail again at 120 -> restart until 220
    assert r.n_failures == 2
    assert r.restart_s == pytest.approx(170.0)
    assert r.wall_s == pytest.approx(320.0)


def test_wall_is_work_plus_all_overheads():
    rng = np.random.default_rng(0)
    fails = np.sort(rng.uniform(0, 30000, 12))
    r = sim.run_one(np.arange(300, 20000, 300.0), 10000.0, fails, COSTS)
    assert r.wall_s == pytest.approx(r.stop_s + r.ckpt_s + r.lost_s + r.restart_s)


def test_progress_overhead_uses_the_curve():
    fit = CurveFit("exp", -1e-3, 0.0, 0.0, 0, 1, 10)
    r = sim.run_one([100], 300.0, np.array([250.0]), COSTS, fit)
    # lost: L(100) - L(240); ckpt: |L'(100)|*10 ; restart: |L'(100)|*100
    want_lost = np.exp(-0.1) - np.exp(-0.24)
    want = want_lost + 1e-3 * np.exp(-0.1) * 10 + 1e-3 * np.exp(-0.1) * 100
    assert r.progress_lost == pytest.approx(want_lost)
    assert r.overhead_progress == pytest.approx(want)


def test_common_random_numbers_and_determinism():
    a = sim.make_scenario(1 / 3600, 36000.0, 50, seed=3, termination="exploratory")
    b = sim.make_scenario(1 / 3600, 36000.0, 50, seed=3, termination="exploratory")
    assert all(np.array_equal(x, y) for x, y in zip(a.traces, b.traces))
    assert np.array_equal(a.stops, b.stops)
    assert (a.stops <= 36000.0).all() and (a.stops >= 0.02 * 36000.0 - 1e-9).all()
    plans = {"p": np.arange(600, 36000, 600.0), "same": np.arange(600, 36000, 600.0)}
    res = sim.evaluate(plans, a, COSTS)
    # identical plans on shared traces give identical per-run results
    assert np.array_equal(res["p"].per_run_s, res["same"].per_run_s)
    assert sim.ratio(res["p"], res["same"], "time") == 1.0


def test_sampled_traces_have_the_model_rate():
    rng = np.random.default_rng(1)
    tr = sim.sample_trace(rng, 1 / 100.0, 1e6)
    assert tr.size == pytest.approx(1e4, rel=0.05)
    tw = sim.sample_trace(rng, 1 / 100.0, 1e6, weibull_shape=0.7)
    assert tw.size == pytest.approx(1e4, rel=0.08)       # same mean gap, other shape


def test_replay_recorded_trace():
    tr = sim.replay_trace([10.0, 40.0], 100.0, 20.0, 250.0)
    assert tr.tolist() == [20.0, 90.0, 120.0, 190.0, 220.0]


def test_interpolated_curve_is_monotone():
    c = sim.InterpolatedCurve([0, 1, 2, 3, 4, 5, 6], [5, 4, 4.5, 3, 3.2, 2, 2], smooth=1)
    ys = c.loss(np.linspace(0, 6, 50))
    assert np.all(np.diff(ys) <= 1e-12)
    assert float(c.rate(10.0)) == 0.0


def test_more_failures_more_overhead():
    plans = {"p": np.arange(300, 36000, 300.0)}
    lo = sim.evaluate(plans, sim.make_scenario(1 / 36000, 36000.0, 200, seed=1), COSTS)["p"]
    hi = sim.evaluate(plans, sim.make_scenario(1 / 3600, 36000.0, 200, seed=1), COSTS)["p"]
    assert hi.overhead_s > lo.overhead_s and hi.n_failures > lo.n_failures
