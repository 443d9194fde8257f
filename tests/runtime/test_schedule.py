"""CheckpointSchedule: the planner inside the loop (serial comm; the 2-rank agreement is in *_mpi.py)."""
from __future__ import annotations

import json
import math
import time

import pytest

from coci_hpc.comm import Comm
from coci_hpc.errors import UsageError
from coci_hpc.planner.failures import from_mtbf
from coci_hpc.planner.policies import young_interval
from coci_hpc.runtime.schedule import ASSUMED_RESTART_S, CheckpointSchedule

STEP_S = 0.01


def _run(sched: CheckpointSchedule, start: int, stop: int, ts: float) -> list[int]:
    saved = []
    for step in range(start + 1, stop + 1):
        sched.observe(step, loss=math.exp(-step / 500), step_seconds=STEP_S)
        if sched.due(step):
            sched.saved(step, ts)
            saved.append(step)
    return saved


def test_first_save_measures_ts_then_young_spacing_follows_the_formula() -> None:
    mtbf_s, ts = 60.0, 0.2
    sched = CheckpointSchedule("young", from_mtbf(mtbf_s), nodes=1, horizon_s=3600, comm=Comm.serial(),
                               warmup_steps=20)
    saved = _run(sched, 0, 2000, ts)
    assert saved[0] == 20  # the Ts-measuring checkpoint
    gaps = [b - a for a, b in zip(saved[1:], saved[2:])]
    expected = young_interval(ts, mtbf_s) / STEP_S  # ~490 steps
    assert gaps and all(abs(g - expected) <= 2 for g in gaps), (gaps, expected)


def test_a_larger_checkpoint_cost_spaces_checkpoints_further_apart() -> None:
    def first_gap(ts: float) -> int:
        s = CheckpointSchedule("young", from_mtbf(60.0), nodes=1, horizon_s=3600, comm=Comm.serial())
        saved = _run(s, 0, 3000, ts)
        return saved[2] - saved[1]
    assert first_gap(0.8) > 1.8 * first_gap(0.2)  # sqrt(4) = 2


def test_state_round_trip_is_json_and_resumes_the_same_plan() -> None:
    a = CheckpointSchedule("daly", from_mtbf(120.0), nodes=2, horizon_s=3600, comm=Comm.serial())
    _run(a, 0, 300, 0.1)
    d = json.loads(json.dumps(a.state_dict()))  # JSON only: it goes into the manifest, no pickle
    b = CheckpointSchedule("daly", from_mtbf(1.0), nodes=2, horizon_s=3600, comm=Comm.serial())
    b.load_state_dict(d)
    b.resumed(300)
    a.resumed(300)  # as if both had just saved at 300
    assert b.train_time_s == pytest.approx(a.train_time_s)
    assert b.next_step() == a.next_step() is not None
    assert _run(b, 300, 1500, 0.1) == _run(a, 300, 1500, 0.1)


def test_restart_cost_is_measured_from_the_stop_save_only() -> None:
    a = CheckpointSchedule("young", from_mtbf(600.0), nodes=1, horizon_s=3600, comm=Comm.serial())
    _run(a, 0, 100, 0.1)
    periodic = a.state_dict()
    a.stopping()
    stop = a.state_dict()
    b = CheckpointSchedule("young", from_mtbf(600.0), nodes=1, horizon_s=3600, comm=Comm.serial())
    b.load_state_dict(periodic)  # a crash resumes from a periodic save: no Tr to measure
    assert b.resumed(100) is None and b.costs().restart_s == ASSUMED_RESTART_S
    c = CheckpointSchedule("young", from_mtbf(600.0), nodes=1, horizon_s=3600, comm=Comm.serial())
    c.load_state_dict(stop)
    time.sleep(0.05)
    tr = c.resumed(100)
    assert tr is not None and tr >= 0.05 and c.costs().restart_s == pytest.approx(tr)
    assert c.resumed(100) is None  # measured once


def test_bad_policy_or_warmup_fails_up_front() -> None:
    with pytest.raises(UsageError):
        CheckpointSchedule("nope", from_mtbf(60.0), nodes=1, horizon_s=60, comm=Comm.serial())
    with pytest.raises(UsageError, match="warmup_steps"):
        CheckpointSchedule("young", from_mtbf(60.0), nodes=1, horizon_s=60, comm=Comm.serial(), warmup_steps=0)


def test_a_replan_after_a_curve_fit_does_not_postpone_the_next_checkpoint() -> None:
    # coci needs a fit; until one exists it plans as young. The first fit re-plans: the next checkpoint
    # must still be one interval after the LAST checkpoint, not one interval after the re-plan.
    sched = CheckpointSchedule("young", from_mtbf(60.0), nodes=1, horizon_s=3600, comm=Comm.serial(),
                               observe_every_s=0.5)
    saved = _run(sched, 0, 1600, 0.2)
    expected = young_interval(0.2, 60.0) / STEP_S
    assert sched.planner is not None and sched.planner.replans >= 2
    assert all(abs((b - a) - expected) <= 2 for a, b in zip(saved[1:], saved[2:])), saved


def test_a_restart_after_a_failure_front_loads_checkpoints_under_a_decreasing_hazard() -> None:
    """Weibull shape 0.5: right after a failure the hazard is high, so the default policy's first
    gaps after after_failure() are shorter than on a fresh start from the same state."""
    import dataclasses

    fm = dataclasses.replace(from_mtbf(600.0), distribution="weibull", weibull_shape=0.5,
                             weibull_scale_s=600.0 / math.gamma(1 + 1 / 0.5))

    def first_gap(after_failure: bool) -> int:
        sched = CheckpointSchedule("coci", fm, nodes=1, horizon_s=7200, comm=Comm.serial(), warmup_steps=20)
        _run(sched, 0, 20, 0.2)                 # the Ts-measuring checkpoint creates the plan
        if after_failure:
            sched.after_failure(5.0)
        saved = _run(sched, 20, 4000, 0.2)
        return saved[0] - 20

    fresh, failed = first_gap(False), first_gap(True)
    assert failed < fresh, (failed, fresh)


def test_under_spare_nodes_the_plan_uses_the_measured_in_place_restart_cost() -> None:
    """coci-submit --spare-nodes restarts a failure inside the allocation in seconds; the planner's
    Tr must be that once measured, not the queue's (nor the 150 s default)."""
    def sched(in_place: bool) -> CheckpointSchedule:
        s = CheckpointSchedule("daly", from_mtbf(600.0), nodes=2, horizon_s=3600, comm=Comm.serial(),
                               warmup_steps=5, in_place=in_place)
        _run(s, 0, 10, 0.5)
        return s

    spare = sched(True)
    assert spare.costs().restart_s == ASSUMED_RESTART_S          # nothing measured yet
    spare.restarted_in_place(9.0)
    spare.restarted_in_place(7.0)
    assert spare.costs().restart_s == 8.0
    assert spare.planner is not None and spare.planner.costs.restart_s == 8.0   # re-planned with it
    back = CheckpointSchedule("daly", from_mtbf(600.0), nodes=2, horizon_s=3600, comm=Comm.serial(), in_place=True)
    back.load_state_dict(json.loads(json.dumps(spare.state_dict())))
    assert back.costs().restart_s == 8.0                          # travels in the checkpoint
    # Without spare nodes (or after a requeue measured the queue), the queue's cost stays Tr.
    queue = sched(False)
    queue.restarted_in_place(8.0)
    assert queue.costs().restart_s == ASSUMED_RESTART_S
    queue.restart_costs.append(40.0)
    assert queue.costs().restart_s == 40.0
    spare.restart_costs.append(40.0)
    assert spare.costs().restart_s == 8.0


def test_with_a_memory_tier_disk_saves_follow_the_two_tier_plan() -> None:
    """The two-tier plan's disk interval replaces the single-tier plan while it keeps a memory
    tier (set through the memory tier's plan function, as the Session wires it); a plan that
    drops the tier hands the disk back to the schedule's own plan."""
    mtbf_s, ts = 60.0, 0.2
    sched = CheckpointSchedule("young", from_mtbf(mtbf_s), nodes=1, horizon_s=3600, comm=Comm.serial())
    own = young_interval(ts, mtbf_s) / STEP_S            # ~490 steps
    saved = _run(sched, 0, 600, ts)
    plans: list[tuple[int | None, int] | None] = [(5, 150)]
    plan_fn = sched.following(lambda copy_s: plans[-1])
    assert plan_fn([0.01]) == (5, 150) and sched.two_tier_disk_every == 150
    saved = _run(sched, 600, 1800, ts)
    gaps = [b - a for a, b in zip(saved, saved[1:])]
    assert gaps and all(g == 150 for g in gaps), gaps
    plans.append((None, 885))                           # the plan dropped the memory tier
    plan_fn([0.01])
    assert sched.two_tier_disk_every is None
    saved = _run(sched, 1800, 4000, ts)
    gaps = [b - a for a, b in zip(saved, saved[1:])]
    assert gaps and all(abs(g - own) <= 2 for g in gaps), (gaps, own)
    plans.append(None)                                  # no plan yet (no save timed): no change
    plan_fn([0.01])
    assert sched.two_tier_disk_every is None


def test_a_fixed_schedule_keeps_its_interval_under_a_two_tier_plan() -> None:
    from coci_hpc.runtime.schedule import FixedSchedule
    sched = FixedSchedule(100, comm=Comm.serial())
    sched.use_two_tier((5, 30))
    saved = [s for s in range(1, 501) if sched.due(s)]
    assert saved == [100, 200, 300, 400, 500]


def test_a_two_tier_disk_interval_below_one_step_is_refused() -> None:
    sched = CheckpointSchedule("young", from_mtbf(60.0), nodes=1, horizon_s=3600, comm=Comm.serial())
    with pytest.raises(UsageError, match="disk interval"):
        sched.use_two_tier((5, 0))
