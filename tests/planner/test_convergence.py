"""Curve fits on synthetic data with known parameters, and the fallbacks."""
import json
import math

import numpy as np
import pytest

from coci_hpc.planner.convergence import ConvergenceTracker, drift, fit_curve


def test_exp_fit_recovers_parameters():
    rng = np.random.default_rng(1)
    t = np.linspace(0, 7200, 150)
    y = np.exp(-3e-4 * t + 0.9) * (1 + 0.01 * rng.standard_normal(t.size))
    o = fit_curve(t, y)
    assert o.ok and o.fit.kind == "exp"
    assert o.fit.theta1 == pytest.approx(-3e-4, rel=0.03)
    assert o.fit.theta2 == pytest.approx(0.9, abs=0.02)
    assert o.fit.floor == 0.0


def test_floor_fit_recovers_parameters_and_wins_by_residual():
    rng = np.random.default_rng(2)
    t = np.linspace(100, 3600, 200)          # does not start at 0: checks the time shift
    y = 1.7 * np.exp(-1.5e-3 * t) + 0.4 + 0.005 * rng.standard_normal(t.size)
    o = fit_curve(t, y)
    assert o.ok and o.fit.kind == "exp_floor"
    assert o.fit.theta1 == pytest.approx(-1.5e-3, rel=0.03)
    assert math.exp(o.fit.theta2) == pytest.approx(1.7, rel=0.05)
    assert o.fit.floor == pytest.approx(0.4, abs=0.02)
    assert o.candidates["exp_floor"]["rss"] < o.candidates["exp"]["rss"]
    # inverse of the curve
    target = float(o.fit.loss(2000.0))
    assert o.fit.time_at_loss(target) == pytest.approx(2000.0, rel=1e-9)
    assert o.fit.time_at_loss(o.fit.floor) == math.inf


def test_nan_samples_are_dropped_and_counted():
    t = np.linspace(0, 1000, 50)
    y = np.exp(-1e-3 * t)
    y[[3, 10, 20]] = [np.nan, np.inf, -1.0]
    o = fit_curve(t, y)
    assert o.ok and o.n_dropped == 3


def test_mostly_nan_falls_back():
    t = np.arange(20.0)
    y = np.full(20, np.nan)
    y[:5] = 1.0
    o = fit_curve(t, y)
    assert not o.ok and "NaN" in o.reason


def test_too_short_falls_back():
    o = fit_curve([0, 1, 2], [3.0, 2.0, 1.5])
    assert not o.ok and "too few" in o.reason


def test_increasing_or_flat_loss_falls_back():
    t = np.linspace(0, 100, 40)
    assert "not decreasing" in fit_curve(t, 1 + 0.01 * t).reason
    rng = np.random.default_rng(3)
    assert not fit_curve(t, 2 + 0.1 * rng.standard_normal(40)).ok


def test_too_noisy_falls_back():
    rng = np.random.default_rng(4)
    t = np.linspace(0, 1000, 400)
    y = np.exp(-2e-4 * t) + 0.5 * rng.random(400)   # weak trend, large noise
    o = fit_curve(t, y)
    assert not o.ok
    assert "noisy" in o.reason or "not decreasing" in o.reason


def test_noisy_non_monotone_but_decreasing_still_fits():
    rng = np.random.default_rng(5)
    t = np.linspace(0, 5000, 300)
    y = np.exp(-5e-4 * t + 1) * (1 + 0.1 * rng.standard_normal(t.size))  # SGD-like noise
    o = fit_curve(t, y)
    assert o.ok
    assert o.fit.theta1 == pytest.approx(-5e-4, rel=0.15)


def test_drift_measure():
    from coci_hpc.planner.convergence import CurveFit
    a = CurveFit("exp", -1e-3, 0.0, 0.0, 0, 1, 10)
    b = CurveFit("exp", -1e-3, 0.2, 0.0, 0, 1, 10)
    assert drift(a, b, 0, 100) == pytest.approx(0.2)
    assert drift(a, a, 0, 100) == 0.0
    assert drift(a, None, 0, 1) == math.inf


def test_tracker_refits_every_k_and_flags_drift_then_roundtrips_state():
    tr = ConvergenceTracker(refit_every=10, drift_tol=0.05, min_points=6)
    refits = []
    for i in range(60):
        t = 10.0 * i
        theta = -1e-3 if i < 30 else -3e-3       # the curve changes speed half way
        loss = math.exp(theta * t) if i < 30 else math.exp(-1e-3 * 290 + theta * (t - 290))
        refits.append(tr.add(i, t, loss))
    assert refits[5]                              # first fit once min_points are there
    assert sum(refits) >= 6
    assert tr.replan_needed
    tr.acknowledge()
    assert not tr.replan_needed
    state = json.loads(json.dumps(tr.to_state()))
    tr2 = ConvergenceTracker.from_state(state)
    assert tr2.samples == tr.samples
    assert tr2.fit == tr.fit
    tr.add(60, 600.0, float("nan"))
    json.dumps(tr.to_state(), allow_nan=False)   # NaN loss must still serialise
