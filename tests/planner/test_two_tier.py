"""The two-tier planner: first-order optimum, when the memory tier pays, the Daly guard, the
partner-loss probability and the simulator against a step-by-step reference."""
from __future__ import annotations

import math

import numpy as np
import pytest

from coci_hpc.errors import PlannerError
from coci_hpc.planner import two_tier as tt
from coci_hpc.planner import two_tier_sim as tsim
from coci_hpc.planner.policies import daly_interval

COSTS = tt.TierCosts(mem_ckpt_s=1.0, disk_ckpt_s=40.0, mem_restart_s=60.0,
                     disk_restart_s=230.0, step_time_s=5.0)
DAY = 86400.0


def test_first_order_optimum_is_the_brute_force_minimum():
    for lm, ld, c in [(1 / 3600, 1 / 360000, COSTS),
                      (1 / 7200, 1 / 20000, COSTS),
                      (1 / 600, 1 / 6000, tt.TierCosts(5.0, 10.0, 30.0, 100.0, 1.0))]:
        t, k, w = tt.first_order_optimum(c, lm, ld)
        ts = np.geomspace(1.0, 1e6, 20000)
        brute = min(float(tt.first_order_waste(ts, kk, c, lm, ld).min()) for kk in range(1, 300))
        assert w <= brute * (1 + 1e-9)
        assert w == pytest.approx(brute, rel=1e-3)
        assert tt.first_order_waste(t, k, c, lm, ld) == pytest.approx(w)


def test_ring_partner_loss_against_monte_carlo():
    rng = np.random.default_rng(1)
    for n, j in [(8, 2), (16, 3), (64, 5), (10, 5), (10, 6), (2, 1)]:
        hit = np.argsort(np.argsort(rng.random((8000, n)), axis=1), axis=1) < j
        lost = (hit & np.roll(hit, -1, axis=1)).any(axis=1).mean()
        assert tt.ring_partner_loss(j, n) == pytest.approx(lost, abs=0.02)


def test_incident_size_to_partner_loss_against_random_placements():
    """An incident on m of the machine's N nodes; the job on n random nodes with a random ring."""
    rng = np.random.default_rng(2)
    for machine, n, m in [(49, 16, 4), (98, 64, 16), (20, 20, 3), (32, 8, 10)]:
        draws = 8000
        # each row: the job's nodes in ring order (a random ordered subset), the nodes down
        job = np.argsort(rng.random((draws, machine)), axis=1)[:, :n]
        down = np.argsort(np.argsort(rng.random((draws, machine)), axis=1), axis=1) < m
        hit = np.take_along_axis(down, job, axis=1)
        partner_hit = np.roll(hit, -1, axis=1)
        p_hit, p_loss = tt.incident_effect(m, machine, n)
        assert p_hit == pytest.approx(hit.any(axis=1).mean(), abs=0.02)
        assert p_loss == pytest.approx((hit & partner_hit).any(axis=1).mean(), abs=0.02)


def test_profile_from_incidents_counts_the_hits():
    # a job on the whole cluster is hit by every incident; one-node incidents never lose a pair
    p = tt.IncidentProfile.from_incidents([1] * 100, 100 * 3600.0, 16, 16)
    assert p.job_rate == pytest.approx(1 / 3600.0)
    assert p.partner_loss == 0.0
    # a whole-cluster incident always takes a pair
    p = tt.IncidentProfile.from_incidents([16] * 10, 10 * 3600.0, 16, 8)
    assert p.partner_loss == 1.0
    # twice the cluster: two copies, twice the rate
    p2 = tt.IncidentProfile.from_incidents([1] * 100, 100 * 3600.0, 16, 32)
    assert p2.job_rate == pytest.approx(2 / 3600.0)


def test_memory_tier_kept_when_it_clearly_pays():
    prof = tt.IncidentProfile(1 / 3600.0, 0.01, 64)
    plan = tt.plan_two_tier(COSTS, prof, 3 * DAY)
    assert plan.tier == "two-tier"
    assert plan.mem_every_steps is not None and plan.disk_every_steps > plan.mem_every_steps
    assert "pays" in plan.reason
    sim = {n: a["simulated_waste"] for n, a in plan.alternatives.items()}
    assert sim[plan.params["chosen"]] < 0.7 * sim["daly"]


@pytest.mark.parametrize("prof,costs,why", [
    (tt.IncidentProfile(1 / 3600.0, 1.0, 64), COSTS, "takes a rank and its partner or ends the whole job"),
    (tt.IncidentProfile(1 / 3600.0, 0.01, 1), COSTS, "one node"),
    (tt.IncidentProfile(1 / 3600.0, 0.01, 64),
     tt.TierCosts(200.0, 40.0, 60.0, 230.0, 5.0), "does not pay"),
    # partner loss near 1 and no cheaper restart from memory: nothing left to gain
    (tt.IncidentProfile(1 / 3600.0, 0.97, 64),
     tt.TierCosts(1.0, 40.0, 230.0, 230.0, 5.0), "does not pay"),
])
def test_memory_tier_dropped_when_it_does_not_pay(prof, costs, why):
    plan = tt.plan_two_tier(costs, prof, 3 * DAY)
    assert plan.tier == "disk-only" and plan.mem_every_steps is None
    assert why in plan.reason
    assert plan.to_dict()["mem_interval_s"] is None


@pytest.mark.parametrize("seed", range(6))
def test_plan_never_wastes_more_than_daly_on_the_same_traces(seed):
    rng = np.random.default_rng(100 + seed)
    costs = tt.TierCosts(float(rng.uniform(0.05, 20)), float(rng.uniform(1, 80)),
                         float(rng.uniform(30, 200)), float(rng.uniform(150, 300)), 5.0)
    prof = tt.IncidentProfile(float(10 ** rng.uniform(-5.5, -3)), float(rng.uniform(0, 1)),
                              int(rng.integers(2, 1025)))
    work = 2 * DAY
    plan = tt.plan_two_tier(costs, prof, work, seed=seed)
    # re-simulate both on the planner's traces (same seed, same draws) and on fresh ones
    runs = plan.params["check_runs"]
    traces = tsim.poisson_traces(np.random.default_rng(seed), prof.job_rate, prof.partner_loss,
                                 work, runs)
    mine = tsim.simulate(plan.mem_every_steps, plan.disk_every_steps, costs, work, traces).mean()
    daly = tsim.simulate(None, tt.daly_steps(costs, prof.job_rate), costs, work, traces).mean()
    assert mine <= daly + 1e-9
    assert mine / work == pytest.approx(plan.alternatives[plan.params["chosen"]]["simulated_waste"])


def _reference(mem, disk, c, work, times, flags, worst=None):
    """Step-by-step: one checkpoint at a time. ``worst``: a list that gets the most work one
    failure rolled back."""
    st = c.step_time_s
    t_seg = (disk if mem is None else mem) * st
    kk = 1 if mem is None else max(1, round(disk / mem))
    cm = 0.0 if mem is None else c.mem_ckpt_s
    n = max(0, math.ceil(work / t_seg) - 1)
    fail = [(float(t), bool(f) or mem is None) for t, f in zip(times, flags) if math.isfinite(t)]
    fi, w, i = 0, 0.0, 0
    most = 0.0
    while True:
        t, j = w, i
        f, flagged = fail[fi] if fi < len(fail) else (math.inf, False)
        while True:
            if j == n:
                end = t + (work - j * t_seg)
                if f >= end:
                    if worst is not None:
                        worst.append(most)
                    return end - work
                done = j * t_seg + (f - t)
                break
            ck_end = t + t_seg + cm + (c.disk_ckpt_s if (j + 1) % kk == 0 else 0.0)
            if f < ck_end:
                done = j * t_seg + min(f - t, t_seg)
                break
            t, j = ck_end, j + 1
        fi += 1
        i = (j // kk) * kk if flagged else j
        w = f + (c.disk_restart_s if flagged else c.mem_restart_s)
        most = max(most, done - i * t_seg)
        while fi < len(fail) and fail[fi][0] < w:     # failed again while restarting
            f, flagged = fail[fi]
            fi += 1
            back = (i // kk) * kk if flagged else i
            most = max(most, (i - back) * t_seg)
            i = back
            w = f + (c.disk_restart_s if flagged else c.mem_restart_s)


def test_simulator_matches_a_step_by_step_reference():
    rng = np.random.default_rng(7)
    c = tt.TierCosts(mem_ckpt_s=3.0, disk_ckpt_s=50.0, mem_restart_s=40.0,
                     disk_restart_s=120.0, step_time_s=10.0)
    work = 6 * 3600.0
    traces = tsim.poisson_traces(rng, 1 / 1500.0, 0.3, work, 40)
    for pair in [(None, 30), (3, 24), (1, 7), (5, 5), (7, 100), (None, 5000)]:
        got = tsim.simulate(pair[0], pair[1], c, work, traces)
        want = [_reference(pair[0], pair[1], c, work, traces[0][r], traces[1][r])
                for r in range(traces[0].shape[0])]
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-6)
        # the worst single failure of each run (the grid's worst-loss key)
        _, worst = tsim.simulate_detail([pair], c, work, traces)
        want_w: list[float] = []
        for r in range(traces[0].shape[0]):
            _reference(pair[0], pair[1], c, work, traces[0][r], traces[1][r], want_w)
        np.testing.assert_allclose(worst[0], want_w, rtol=1e-9, atol=1e-6)
    # no failure: the stalls alone
    none = (np.full((1, 1), np.inf), np.zeros((1, 1), dtype=bool))
    assert tsim.simulate(2, 10, c, 1000.0, none)[0] == pytest.approx(49 * 3.0 + 9 * 50.0)


def test_bad_costs_are_clear_errors():
    with pytest.raises(PlannerError):
        tt.TierCosts(-1.0, 10.0, 1.0, 1.0, 1.0)
    with pytest.raises(PlannerError, match="step time"):
        tt.TierCosts(1.0, 10.0, 1.0, 1.0, 0.0)
    with pytest.raises(PlannerError):
        tt.IncidentProfile(0.0, 0.1, 4)
    with pytest.raises(PlannerError):
        tt.plan_two_tier(COSTS, tt.IncidentProfile(1e-4, 0.1, 4), -1.0)


def test_no_partner_loss_means_no_disk_save_within_the_horizon():
    # one-node incidents only: the memory tier serves them all; the disk interval is the horizon
    plan = tt.plan_two_tier(COSTS, tt.IncidentProfile(1 / 3600.0, 0.0, 64), DAY)
    assert plan.tier == "two-tier"
    assert plan.disk_interval_s >= DAY and plan.disk_interval_s < DAY + plan.mem_interval_s


YEAR = 365 * DAY


@pytest.mark.parametrize("seed", range(5))
def test_stationary_history_is_one_regime(seed):
    """Poisson incidents at one rate, sizes drawn from one law: no change is found, and the
    profile is the whole history's."""
    rng = np.random.default_rng(seed)
    times = np.sort(rng.uniform(0.0, 4 * YEAR, 2000))
    sizes = rng.choice([1, 1, 1, 1, 2, 4], times.size)
    assert tt.regime_start(times, sizes, 0.0, 4 * YEAR) == 0.0
    p = tt.IncidentProfile.from_incident_times(times, sizes, 0.0, 4 * YEAR, 49, 16)
    q = tt.IncidentProfile.from_incidents(sizes, 4 * YEAR, 49, 16)
    assert (p.job_rate, p.partner_loss) == (q.job_rate, q.partner_loss)


def test_a_change_in_multi_node_incidents_starts_a_new_regime():
    """Two years with many 8-node incidents, then two years with one-node incidents only (the
    total rate the same): the regime starts near the change and the profile's partner-loss
    share is the recent one (0), not the whole history's."""
    rng = np.random.default_rng(7)
    times = np.sort(rng.uniform(0.0, 4 * YEAR, 2000))
    sizes = np.where((times < 2 * YEAR) & (rng.random(times.size) < 0.2), 8, 1)
    start = tt.regime_start(times, sizes, 0.0, 4 * YEAR)
    assert 1.8 * YEAR < start < 2.2 * YEAR
    whole = tt.IncidentProfile.from_incidents(sizes, 4 * YEAR, 49, 16)
    recent = tt.IncidentProfile.from_incident_times(times, sizes, 0.0, 4 * YEAR, 49, 16)
    assert whole.partner_loss > 0.02
    assert recent.partner_loss == 0.0
    assert "current regime" in recent.note
    # the plan for the recent regime saves to disk far less often
    costs = tt.TierCosts(mem_ckpt_s=3.2, disk_ckpt_s=80.0, mem_restart_s=190.0,
                         disk_restart_s=230.0, step_time_s=5.0)
    plan = tt.plan_two_tier(costs, recent, 3 * DAY)
    assert plan.disk_every_steps > 4 * tt.plan_two_tier(costs, whole, 3 * DAY).disk_every_steps
    # coci-plan's summary says which part of the history the plan learned from
    assert any("current regime" in line for line in tt.describe(plan))


def test_a_drop_in_the_incident_rate_starts_a_new_regime():
    rng = np.random.default_rng(8)
    times = np.sort(np.concatenate([rng.uniform(0.0, YEAR, 1500), rng.uniform(YEAR, 4 * YEAR, 500)]))
    start = tt.regime_start(times, np.ones(times.size, dtype=int), 0.0, 4 * YEAR)
    assert 0.9 * YEAR < start < 1.1 * YEAR
    p = tt.IncidentProfile.from_incident_times(times, [1] * times.size, 0.0, 4 * YEAR, 16, 16)
    assert p.job_rate == pytest.approx(500 / (4 * YEAR - start), rel=0.02)


def test_incident_times_and_sizes_must_pair_up():
    with pytest.raises(PlannerError):
        tt.IncidentProfile.from_incident_times([1.0, 2.0], [1], 0.0, 10.0, 4, 4)
    # no incident at all: the whole window, the Jeffreys prior's half incident
    p = tt.IncidentProfile.from_incident_times([], [], 0.0, YEAR, 16, 16)
    assert p.job_rate == pytest.approx(0.5 / YEAR) and p.partner_loss == 0.0


def test_profile_from_model_learns_from_the_current_regime():
    """A model of node events (incidents with their nodes) gives the profile of the part after
    the change: 8-node incidents only in the first half of the window."""
    from coci_hpc.planner import failures
    rng = np.random.default_rng(9)
    times = np.sort(rng.uniform(0.0, 4 * YEAR, 1500))
    nodes = [f"n{i}" for i in range(49)]
    evs = [failures.FailureEvent(tuple(rng.choice(nodes, 8 if (t < 2 * YEAR and rng.random() < 0.2) else 1,
                                                  replace=False)), float(t), source="event")
           for t in times]
    model = failures.estimate(evs, 49 * 4 * YEAR, cluster_nodes=49)
    p = tt.profile_from_model(model, 16, window=(0.0, 4 * YEAR))
    assert p.partner_loss == 0.0 and "current regime" in p.note
    assert tt.profile_from_model(model, 16).partner_loss == 0.0     # window taken from the incidents


def test_rare_pair_losses_get_enough_check_runs_for_a_steady_disk_interval():
    """A 64-node job hit ~17 times in 72 h, 0.2 % of them taking a pair (system 16's learned
    regime): 3000 simulated incidents hold ~6 pair losses. The check simulates runs for ~200
    pair losses (here the 4000-run cap: ~130). The disk interval no longer depends on the check
    (it was the noise of where a handful of pair losses fell: K doubled on one seed): it is
    Daly's for the pair-loss rate, on every seed, rounded to a multiple of k."""
    costs = tt.TierCosts(mem_ckpt_s=3.2, disk_ckpt_s=80.0, mem_restart_s=190.0,
                         disk_restart_s=230.0, step_time_s=5.0)
    prof = tt.IncidentProfile(6.4976e-05, 0.0019609, 64)
    work = 3 * DAY
    daly = daly_interval(costs.disk_ckpt_s, 1.0 / prof.disk_rate) / costs.step_time_s
    for seed in range(4):
        plan = tt.plan_two_tier(costs, prof, work, seed=seed)
        assert plan.tier == "two-tier"
        runs = plan.params["check_runs"]
        assert runs == min(4000, math.ceil(200 / (prof.disk_rate * work)))
        assert runs * prof.disk_rate * work >= 100.0
        assert abs(plan.disk_every_steps - daly) <= plan.mem_every_steps / 2 + 1, (seed, plan.disk_every_steps, daly)
