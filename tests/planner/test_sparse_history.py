"""The default policy on short failure histories: Daly's plan until the history can carry more.

A history of 10 or 40 incidents gives the default exactly Daly's plan on the record rate; one of
200 incidents gives it back its refinements (the incident rate a job actually sees, equal
chunks, the hazard layer). Replays of thinned and cut LANL histories (benchmarks/planner_bench.py)
are why: on a few dozen incidents the refinements cost more than they gain.
"""
import math

import numpy as np
import pytest

from coci_hpc.planner.costs import Costs
from coci_hpc.planner.failures import FailureEvent, estimate, from_mtbf
from coci_hpc.planner.online import OnlinePlanner
from coci_hpc.planner.policies import CociDefault, PlanContext, daly_interval, make_policy

HOUR = 3600.0
COSTS = Costs(120.0, 150.0)
W = 72 * HOUR
N_CLUSTER = 16


def history(incidents: int, seed: int = 0, clustered: bool = False):
    """``incidents`` incidents on a 16-node cluster over one year, every third one on 3 nodes
    (a switch): 5/3 records per incident on average, so records and incidents differ."""
    rng = np.random.default_rng(seed)
    span = 365 * 24 * HOUR
    if clustered:            # bursts: Weibull gaps of shape 0.5 on each node
        times = np.sort(np.cumsum(rng.weibull(0.5, incidents)))
        times = times / times[-1] * span * 0.999
    else:
        times = np.sort(rng.uniform(0, span, incidents))
    events, records = [], 0
    for i, t in enumerate(times):
        nodes = rng.choice(N_CLUSTER, 3 if i % 3 == 0 else 1, replace=False)
        if clustered:
            nodes = [i % 2]                       # two flaky nodes carry the bursts
        ev = FailureEvent(tuple(f"n{j:02d}" for j in nodes), float(t))
        events.append(ev)
        records += len(ev.nodes)
    return estimate(events, N_CLUSTER * span, n_records=records, cluster_nodes=N_CLUSTER)


@pytest.mark.parametrize("k", [10, 40])
def test_short_history_plans_exactly_as_daly_on_the_record_rate(k):
    model = history(k)
    assert model.n_failures == k and model.n_records > k
    for nodes in (1, 4, 16):
        ctx = PlanContext.from_model(model, COSTS, W, nodes)
        rec = nodes * model.n_records / model.exposure_node_s
        assert ctx.record_rate == pytest.approx(rec)
        plan = make_policy("coci").plan(ctx)
        daly = make_policy("daly").plan(PlanContext(COSTS, rec, W, nodes=nodes))
        assert plan.effective_policy == "daly" and plan.params["mode"] == "daly-fallback"
        assert f"{k} incident(s)" in plan.fallback
        assert plan.interval_s == pytest.approx(daly_interval(120.0, 1 / rec))
        assert plan.times == pytest.approx(daly.times)


def test_short_history_ignores_a_weibull_shape():
    model = history(40, clustered=True)
    ctx = PlanContext.from_model(model, COSTS, W, 1, time_since_failure_s=60.0)
    assert ctx.weibull_shape is not None and ctx.weibull_shape < 1
    plan = make_policy("coci").plan(ctx)
    assert plan.params["mode"] == "daly-fallback"      # no dense walk after the restart
    assert np.ptp(np.diff([0.0] + plan.times)) < 1e-6 * plan.interval_s


def test_long_history_gets_the_structured_plan_back():
    model = history(200)
    assert model.n_failures >= CociDefault.min_incidents
    for nodes in (1, 16):
        ctx = PlanContext.from_model(model, COSTS, W, nodes)
        plan = make_policy("coci").plan(ctx)
        assert plan.effective_policy == "coci" and plan.fallback is None
        assert plan.params["mode"] == "exponential"
        # the same plan as for a given (not learned) rate: nothing is shrunk any more
        given = make_policy("coci").plan(PlanContext(COSTS, ctx.job_rate, W, nodes=nodes))
        assert plan.times == pytest.approx(given.times)
        rec = make_policy("daly").plan(PlanContext(COSTS, ctx.record_rate, W, nodes=nodes))
        if nodes == 1:      # every record hits the one node's job once: the record rate
            assert ctx.job_rate == pytest.approx(ctx.record_rate)
        else:               # a 3-node incident is one failure for a 16-node job: fewer
            assert ctx.job_rate < 0.9 * ctx.record_rate
            assert len(plan.times) < len(rec.times)


def test_long_clustered_history_turns_the_hazard_layer_on():
    model = history(400, clustered=True)
    assert model.hazard_shape is not None and model.hazard_shape < 1
    ctx = PlanContext.from_model(model, COSTS, W, 1, time_since_failure_s=0.0)
    plan = make_policy("coci").plan(ctx)
    assert plan.params["mode"] == "hazard"
    gaps = np.diff([0.0] + plan.times)
    assert gaps[0] < 0.7 * daly_interval(120.0, 1 / ctx.job_rate)


def test_incident_job_rate_counts_what_a_job_on_n_nodes_is_hit_by():
    span = 1000 * HOUR
    evs = [FailureEvent(tuple(f"n{i}" for i in range(5)), 10.0),     # one incident on 5 of 10
           FailureEvent(("n7",), 20.0)]                               # one on 1 node
    m = estimate(evs, 10 * span, n_records=6, cluster_nodes=10)
    assert m.job_rate(1) == pytest.approx(2 / (10 * span))           # incidents per node
    assert m.incident_job_rate(1) == pytest.approx((5 / 10 + 1 / 10) / span)   # = records
    p2 = 1 - math.comb(5, 2) / math.comb(10, 2)                      # 5-node incident, 2 nodes
    assert m.incident_job_rate(2) == pytest.approx((p2 + 2 / 10) / span)
    assert m.incident_job_rate(10) == pytest.approx(2 / span)         # every incident, once
    assert m.incident_job_rate(12) == pytest.approx(2 / span)
    # without the cluster size (job-record exposure) or any incident: the per-node rate
    assert estimate(evs, 10 * span).incident_job_rate(2) == pytest.approx(m.job_rate(2))
    assert estimate([], 10 * span, cluster_nodes=10).incident_job_rate(3) == \
        pytest.approx(3 * 0.5 / (10 * span))


def test_a_given_mtbf_is_not_shrunk():
    model = from_mtbf(100 * HOUR)
    ctx = PlanContext.from_model(model, COSTS, W, 4)
    assert ctx.incidents is None and ctx.job_rate == pytest.approx(4 / (100 * HOUR))
    assert make_policy("coci").plan(ctx).params["mode"] == "exponential"


def test_online_planner_uses_the_same_context():
    model = history(40)
    op = OnlinePlanner("coci", model, 4, COSTS, W)
    assert op.plan.params["mode"] == "daly-fallback"
    back = OnlinePlanner.from_state(op.to_state())
    assert back.failure_model.cluster_nodes == N_CLUSTER
    assert back.failure_model.incident_job_rate(4) == pytest.approx(model.incident_job_rate(4))
