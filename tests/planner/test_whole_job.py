"""Failures that end the whole job: the model, its priors, and the disk interval that answers it."""
from __future__ import annotations

import math

import numpy as np
import pytest

from coci_hpc.errors import UsageError
from coci_hpc.planner import failures as fmod
from coci_hpc.planner import two_tier as tt
from coci_hpc.planner import two_tier_sim as tsim
from coci_hpc.planner import whole_job as wj
from coci_hpc.planner.failures import FailureEvent
from coci_hpc.planner.policies import daly_interval

DAY = 86400.0
COSTS = tt.TierCosts(mem_ckpt_s=1.0, disk_ckpt_s=40.0, mem_restart_s=60.0, disk_restart_s=230.0, step_time_s=5.0)


@pytest.mark.parametrize("mtbf_h,nodes", [(5000.0, 64), (1000.0, 16), (2000.0, 256)])
def test_given_mtbf_plans_daly_for_the_whole_job_rate(mtbf_h, nodes):
    """The acceptance test: a given MTBF says nothing of incident sizes (no partner loss), and
    the disk interval is still finite: Daly's for the rate of whole-job failures (the default
    share of the job's incidents plus the default outage rate), within the plan's rounding (a
    multiple of the memory interval, so at most half of one away)."""
    model = fmod.from_mtbf(mtbf_h * 3600.0)
    prof = tt.profile_from_model(model, nodes)
    assert prof.partner_loss == 0.0
    rate = wj.DEFAULT_SHARE * nodes / (mtbf_h * 3600.0) + 1.0 / (wj.DEFAULT_OUTAGE_HOURS * 3600.0)
    assert prof.disk_rate == pytest.approx(rate)
    work = 30 * DAY
    plan = tt.plan_two_tier(COSTS, prof, work)
    assert plan.tier == "two-tier"
    daly_steps = daly_interval(COSTS.disk_ckpt_s, 1.0 / rate) / COSTS.step_time_s
    assert plan.disk_interval_s < work                      # a disk save inside the horizon
    assert abs(plan.disk_every_steps - daly_steps) <= plan.mem_every_steps / 2 + 1
    assert plan.disk_every_steps % plan.mem_every_steps == 0
    assert "whole-job failures" in plan.disk_reason and "prior" in plan.disk_reason


def test_without_whole_job_failures_a_given_mtbf_plans_no_disk_save():
    """The old model (node failures only, share and outages 0): nothing defeats the memory tier,
    and no disk save falls in the horizon; the whole-job model is what changes that."""
    prof = tt.IncidentProfile(1 / 3600.0, 0.0, 64)
    plan = tt.plan_two_tier(COSTS, prof, DAY)
    assert plan.disk_interval_s >= DAY
    assert "no disk save before the job's end" in plan.disk_reason
    plan2 = tt.plan_two_tier(COSTS, prof.with_whole_job(wj.resolve()), DAY)
    assert plan2.disk_interval_s < DAY / 4


def test_a_job_that_ends_first_has_no_disk_save_and_says_so():
    prof = tt.IncidentProfile(1e-7, 0.0, 64).with_whole_job(wj.WholeJob(0.01, 1e-9))
    plan = tt.plan_two_tier(COSTS, prof, 6 * 3600.0)
    assert plan.disk_interval_s >= 6 * 3600.0
    assert "past the job's end" in plan.disk_reason or plan.tier == "disk-only"


def test_rates_split_every_failure_once():
    p = tt.IncidentProfile(2e-4, 0.1, 64).with_whole_job(wj.WholeJob(0.15, 1e-5))
    assert p.mem_rate + p.disk_rate == pytest.approx(p.total_rate)
    assert p.total_rate == pytest.approx(2e-4 + 1e-5)
    assert p.disk_rate == pytest.approx(2e-4 * 0.1 + 2e-4 * 0.9 * 0.15 + 1e-5)


def test_the_plan_beats_the_old_one_when_jobs_die_whole():
    """Replayed at the modelled rates, the planned disk interval wastes less than the plan with no
    disk save in the horizon (what a profile without whole-job failures gave), and no single
    failure rolls back more than 1.5 of its disk intervals of work."""
    prof = tt.IncidentProfile(1 / 7200.0, 0.0, 64).with_whole_job(wj.resolve())
    work = 3 * DAY
    new = tt.plan_two_tier(COSTS, prof, work)
    old = tt.plan_two_tier(COSTS, tt.IncidentProfile(1 / 7200.0, 0.0, 64), work)
    traces = tsim.poisson_traces(np.random.default_rng(5), prof.total_rate, prof.disk_share, work, 400)
    waste, worst = tsim.simulate_detail([(new.mem_every_steps, new.disk_every_steps),
                                         (old.mem_every_steps, old.disk_every_steps)], COSTS, work, traces)
    assert waste[0].mean() < 0.8 * waste[1].mean()
    assert worst[0].max() <= 1.5 * new.disk_interval_s
    assert worst[1].max() > 4 * new.disk_interval_s        # the old plan: one failure cost many hours


def test_given_beats_learned_beats_prior():
    p = wj.resolve()
    assert (p.share, p.share_source, p.outage_source) == (wj.DEFAULT_SHARE, "prior", "prior")
    assert p.outage_rate == pytest.approx(1 / (160 * 3600.0))
    learned = wj.resolve(learned_outages=(4, 400 * 3600.0), learned_share=(3, 1))
    assert learned.outage_rate == pytest.approx(1 / (100 * 3600.0)) and learned.outage_source == "learned"
    # shrunk towards the prior: (3 + 0.15 * 2) / (4 + 2)
    assert learned.share == pytest.approx(3.3 / 6) and learned.share_source == "learned"
    given = wj.resolve(share=0.3, outage_per_hour=0.0, learned_outages=(4, 400 * 3600.0), learned_share=(3, 1))
    assert (given.share, given.outage_rate, given.share_source) == (0.3, 0.0, "given")
    # a history with none: the prior, and the note says so
    none = wj.resolve(learned_outages=(0, 1000 * 3600.0))
    assert none.outage_source == "prior" and "no outage in 1000 h" in none.note


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, -0.1, math.nan, math.inf])
def test_a_share_outside_0_1_is_a_usage_error_naming_the_setting(bad):
    with pytest.raises(UsageError, match="COCI_WHOLE_JOB_SHARE") as e:
        wj.resolve(share=bad, share_name="COCI_WHOLE_JOB_SHARE")
    assert "between 0 and 1" in str(e.value)


@pytest.mark.parametrize("bad", [-1.0, -1e-9, math.nan, math.inf])
def test_a_negative_rate_is_a_usage_error_naming_the_option(bad):
    with pytest.raises(UsageError, match="--outage-rate"):
        wj.resolve(outage_per_hour=bad, outage_name="--outage-rate")


def test_settings_are_read_and_checked():
    assert wj.given_from_settings({})["share"] is None
    kw = wj.given_from_settings({"COCI_WHOLE_JOB_SHARE": "0.3", "COCI_OUTAGE_RATE": "0.01"})
    assert wj.resolve(**kw).share == 0.3 and wj.resolve(**kw).outage_rate == pytest.approx(0.01 / 3600)
    for env, name in (({"COCI_WHOLE_JOB_SHARE": "2"}, "COCI_WHOLE_JOB_SHARE"),
                      ({"COCI_WHOLE_JOB_SHARE": "lots"}, "COCI_WHOLE_JOB_SHARE"),
                      ({"COCI_OUTAGE_RATE": "-0.5"}, "COCI_OUTAGE_RATE")):
        with pytest.raises(UsageError, match=name):
            wj.given_from_settings(env)


def _node_events(times_nodes):
    return tuple(FailureEvent(tuple(ns), t, source="event") for t, ns in times_nodes)


def test_outages_in_the_history_are_learned_and_counted_once():
    """An incident on half the watched nodes is an outage: it leaves the node incidents and
    becomes the outage rate (learned, not the prior)."""
    nodes = [f"n{i}" for i in range(8)]
    span = 1000 * 3600.0
    inc = [(25 * 3600.0 * k + 1000.0, [nodes[k % 8]]) for k in range(40)] + [(500 * 3600.0 + 30, nodes[:5])]
    evs = _node_events(sorted(inc))
    model = fmod.estimate(list(evs), 8 * span, cluster_nodes=8)
    from dataclasses import replace
    model = replace(model, outage_times=(500 * 3600.0 + 30,), outage_window_s=span)
    prof = tt.profile_from_model(model, 4, window=(0.0, span))
    assert prof.outage_rate == pytest.approx(1 / span)
    assert prof.partner_loss == 0.0          # the 5-node incident is not also a pair loss
    assert "learned" in prof.whole_job_note
    # the same history without the outage marked: the prior, and the big incident is a pair loss
    prof0 = tt.profile_from_model(replace(model, outage_times=(), outage_window_s=span), 4, window=(0.0, span))
    assert prof0.outage_rate == pytest.approx(1 / (160 * 3600.0)) and prof0.partner_loss > 0
