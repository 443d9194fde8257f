"""Planner state and plans survive JSON (the checkpoint store keeps them in user extras)."""
import json
import math

import pytest

from coci_hpc.planner.costs import Costs
from coci_hpc.planner.failures import from_mtbf
from coci_hpc.planner.online import OnlinePlanner
from coci_hpc.planner.plan import Plan
from coci_hpc.planner.policies import PlanContext, make_policy


def feed(p, start, stop):
    for i in range(start, stop):
        t = 5.0 * i
        p.observe(10 * i, t, 2 * math.exp(-1e-3 * t) + 0.1)


def test_plan_json_roundtrip():
    ctx = PlanContext(Costs(5, 60, 0.5), 1 / 7200, 7200.0)
    p = make_policy("daly").plan(ctx)
    q = Plan.from_dict(json.loads(p.to_json()))
    assert q == p


def test_online_planner_replans_on_first_fit_and_roundtrips():
    op = OnlinePlanner("coci-paper:capped", from_mtbf(4 * 3600), 2, Costs(1.6, 120, 0.5),
                       6 * 3600, refit_every=20)
    assert op.plan.effective_policy == "young" and op.plan.fallback
    feed(op, 0, 100)
    assert op.plan.effective_policy == "coci-paper:capped" and op.replans >= 1
    state = json.loads(json.dumps(op.to_state(), allow_nan=False))
    op2 = OnlinePlanner.from_state(state)
    assert op2.plan == op.plan
    assert op2.tracker.samples == op.tracker.samples
    # both continue identically
    feed(op, 100, 160)
    feed(op2, 100, 160)
    assert op2.plan == op.plan
    nxt = op.next_checkpoint(500.0)
    assert nxt is not None and nxt.time_s > 500.0
    assert op.should_checkpoint(nxt.step, nxt.step - 1)
    steps = [c.step for c in op.plan.checkpoints]
    k = steps.index(nxt.step)
    prev = steps[k - 1] if k else op.plan.step_now
    if nxt.step - prev > 1:      # no planned step strictly between two planned checkpoints
        assert not op.should_checkpoint(nxt.step - 1, prev)


def test_online_planner_extends_past_horizon():
    op = OnlinePlanner("young", from_mtbf(3600), 1, Costs(1.0, 10.0, 1.0), 600.0)
    nxt = op.next_checkpoint(700.0)
    assert nxt is not None and nxt.time_s > 700.0


def test_state_version_checked():
    op = OnlinePlanner("young", from_mtbf(3600), 1, Costs(1.0, 10.0), 600.0)
    st = op.to_state()
    st["version"] = 99
    with pytest.raises(ValueError):
        OnlinePlanner.from_state(st)


def test_online_planner_passes_hazard_and_time_since_failure_and_keeps_it():
    from dataclasses import replace
    model = replace(from_mtbf(24 * 3600), distribution="weibull", weibull_shape=0.5)
    fresh = OnlinePlanner("coci", model, 1, Costs(30.0, 150.0), 86400.0)
    restarted = OnlinePlanner("coci", model, 1, Costs(30.0, 150.0), 86400.0,
                              time_since_failure_s=150.0)
    assert restarted.plan.params["mode"] == "hazard"
    assert restarted.plan.params["time_since_failure_s"] == 150.0
    assert restarted.plan.times[0] < fresh.plan.times[0]      # sooner right after a failure
    state = json.loads(json.dumps(restarted.to_state()))
    back = OnlinePlanner.from_state(state)
    assert back.time_since_failure_s == 150.0 and back.plan == restarted.plan
    # a re-plan later in the run sees the failure further in the past
    later = back.replan(1000, 3600.0)
    assert later.params["time_since_failure_s"] == 3750.0
    del state["time_since_failure_s"]                         # states written before this field
    assert OnlinePlanner.from_state(state).time_since_failure_s is None


def test_a_history_model_is_kept_as_one_string_made_once_and_old_states_still_load():
    """A real history's model holds its incidents (thousands): the state keeps it as one JSON
    string, made once per model (not rebuilt and flattened at every save and memory-tier copy),
    that loads back to the same model; a state written with the model as a dict still loads."""
    from coci_hpc.planner.failures import FailureEvent, estimate
    evs = [FailureEvent((f"n{i % 7}",), 1000.0 * i, reason="hw", source="event") for i in range(300)]
    model = estimate(evs, 7 * 300 * 1000.0, cluster_nodes=7)
    op = OnlinePlanner("coci", model, 4, Costs(5, 60, 0.5), 6 * 3600)
    a, b = op.to_state(), op.to_state()
    assert "failure_model" not in a and a["failure_model_json"] is b["failure_model_json"]
    back = OnlinePlanner.from_state(json.loads(json.dumps(a)))
    assert back.failure_model == model and len(back.failure_model.events) == 300
    old = {k: v for k, v in a.items() if k != "failure_model_json"}
    old["failure_model"] = model.to_dict()
    assert OnlinePlanner.from_state(old).failure_model == model
    op.failure_model = from_mtbf(3600.0)           # a new model (the partition's history arrived)
    assert json.loads(op.to_state()["failure_model_json"])["events"] == []
