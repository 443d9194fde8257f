"""Failure model: rates, exact Poisson intervals, prior, Weibull detection, merging."""
import numpy as np
import pytest

from coci_hpc.errors import PlannerError
from coci_hpc.planner.failures import (
    FailureEvent,
    FailureModel,
    estimate,
    fit_weibull,
    from_mtbf,
    merge_events,
    poisson_interval,
)


def ev(node, t, source="event"):
    return FailureEvent((node,), float(t), source=source)


def test_poisson_interval_textbook_values():
    # Garwood 90% limits for 3 events: 0.818 .. 7.754; for 0 events: 0 .. 2.996
    lo, hi = poisson_interval(3, 1.0, 0.9)
    assert lo == pytest.approx(0.8177, abs=1e-3)
    assert hi == pytest.approx(7.7537, abs=1e-3)
    lo0, hi0 = poisson_interval(0, 1.0, 0.9)
    assert lo0 == 0.0 and hi0 == pytest.approx(2.9957, abs=1e-3)


def test_rate_and_job_rate():
    hour = 3600.0
    events = [ev("n1", i * 1000) for i in range(4)]
    m = estimate(events, 400 * hour)            # 4 failures in 400 node-hours
    assert m.per_node_rate == pytest.approx(4 / (400 * hour))
    assert m.job_mtbf_s(4) / hour == pytest.approx(25.0)
    assert m.ci_low < m.per_node_rate < m.ci_high
    lo, hi = m.job_mtbf_interval_s(4)
    assert lo < m.job_mtbf_s(4) < hi
    assert m.prior is None and m.n_failures == 4


def test_zero_failures_uses_documented_prior():
    m = estimate([], 1000 * 3600.0)
    assert m.prior == "jeffreys"
    assert m.per_node_rate == pytest.approx(0.5 / (1000 * 3600.0))
    assert "no failures" in m.note
    assert m.ci_low == 0.0
    assert m.job_mtbf_interval_s(1)[1] == float("inf")


def test_zero_exposure_is_an_error():
    with pytest.raises(PlannerError):
        estimate([], 0.0)
    with pytest.raises(PlannerError):
        from_mtbf(-1.0)


def test_weibull_supported_for_clustered_failures():
    rng = np.random.default_rng(7)
    gaps = 3600 * rng.weibull(0.5, 300)
    times = np.cumsum(gaps)
    m = estimate([ev("n1", t) for t in times], float(times[-1]) * 10)
    assert m.distribution == "weibull"
    assert m.weibull_shape == pytest.approx(0.5, abs=0.08)


def test_weibull_not_chosen_for_exponential_gaps():
    rng = np.random.default_rng(8)
    times = np.cumsum(rng.exponential(3600, 300))
    m = estimate([ev("n1", t) for t in times], float(times[-1]) * 10)
    assert m.distribution == "exponential"
    assert m.weibull_shape == pytest.approx(1.0, abs=0.15)
    assert fit_weibull([1.0, 2.0]) is None


def test_merge_same_failure_reported_twice():
    job = FailureEvent(("n1", "n2"), 1000.0, source="sacct", job_id="7")
    down = FailureEvent(("n2",), 990.0, reason="Not responding", source="event")
    drain = FailureEvent(("n2",), 1100.0, reason="Kill task failed", source="event")
    other = FailureEvent(("n3",), 1000.0, source="event")
    later = FailureEvent(("n2",), 5000.0, source="event")
    kept = merge_events([job, down, drain, other, later])
    assert [(e.nodes, e.time_s) for e in kept] == [(("n2",), 990.0), (("n3",), 1000.0),
                                                    (("n2",), 5000.0)]


def test_separate_outages_of_one_node_stay_separate():
    a = FailureEvent(("n2",), 0.0, source="event", end_s=3.0)
    b = FailureEvent(("n2",), 520.0, source="event", end_s=523.0)     # 8 min later: new failure
    c = FailureEvent(("n2",), 530.0, source="event", end_s=600.0)     # status change while down
    assert [e.time_s for e in merge_events([a, b, c])] == [0.0, 520.0]
    long_down = FailureEvent(("n5",), 0.0, source="event", end_s=7200.0)
    drain_during = FailureEvent(("n5",), 3600.0, source="event", end_s=7200.0)
    assert len(merge_events([long_down, drain_during])) == 1


def test_model_dict_roundtrip():
    m = estimate([ev("n1", 1), ev("n2", 2)], 1e5)
    d = m.to_dict(nodes=2)
    assert d["job_mtbf_hours"] == pytest.approx(1e5 / 2 / 2 / 3600)
    m2 = FailureModel.from_dict(d)
    assert m2.per_node_rate == m.per_node_rate and len(m2.events) == 2


def test_lrt_critical_is_chi2_quantile_and_training_imports_no_scipy() -> None:
    """LRT_CRITICAL is a literal so that a training rank's start (and every in-place restart) does
    not pay ~2 s for scipy.stats; it must still be chi2_1's 95 % quantile."""
    import subprocess
    import sys

    from scipy import stats

    from coci_hpc.planner import failures
    assert failures.LRT_CRITICAL == pytest.approx(stats.chi2.ppf(0.95, 1), rel=1e-12)
    code = ("import sys, coci_hpc.session, coci_hpc.submit.rank, coci_hpc.runtime.schedule; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('scipy', 'matplotlib')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
