"""The memory tier's two-tier plan in a whole Session (FSDP2 on 2 ranks under mpiexec, CPU mesh,
gloo; tests/session/scripts/two_tier_train.py): with ``COCI_MEMTIER_K`` unset, rank 0 plans
(k, D) from the costs the run measured, every rank copies to its partner every k steps from one
common step on, and the disk saves follow D instead of the schedule's own single-tier plan, which
a control run without the memory tier (``COCI_MEMTIER_K=0``) shows to be different. Both runs end
with the same parameters: checkpoint timing never changes training."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from coci_hpc.runtime import memtier
from coci_hpc.runtime.events import read_events
from tests.conftest import ROOT, run_ranks

SCRIPT = str(ROOT / "tests" / "session" / "scripts" / "two_tier_train.py")
# The job's MTBF 2 s with 1 incident in 10 taking a rank and its partner, a blocking disk save of
# ~0.1 s against a memory copy of ~5 ms, steps of ~20 ms: the memory tier pays clearly (simulated
# waste ~0.6 of the work against ~0.8 for disk only), D ~ 60-110 steps (it moves with the
# measured costs), the single-tier plan's interval ~ 20-40 steps. The run goes past the plan at
# step REPLAN_EVERY, the margin before k applies and 3 D of up to ~160 steps, so at least two
# whole intervals follow the switch (CI, 2026-11-29: D 120 from step 210 left one in 540 steps);
# not near a multiple of REPLAN_EVERY (a plan begun at the last boundaries would never be
# applied, yet printed).
STEPS, MTBF_S = 700, 2.0
PLAN_RE = re.compile(r"two-tier plan: (.*); memory copy every (\S+) step\(s\), disk save every (\d+) step\(s\)")


def dedup(xs: list[Any]) -> list[Any]:
    """``xs`` without consecutive repeats: the values in the order they took effect."""
    return [x for i, x in enumerate(xs) if i == 0 or xs[i - 1] != x]


def planned_saves(run: Path) -> list[int]:
    return [e["step"] for e in read_events(run) if e["event"] == "checkpoint" and e["kind"] == "planned"]


def gaps(steps: list[int]) -> list[int]:
    return [b - a for a, b in zip(steps, steps[1:])]


def test_two_tier_plan_sets_k_on_every_rank_and_the_disk_interval(tmp_path: Path) -> None:
    p = run_ranks(2, SCRIPT, str(tmp_path), str(STEPS), str(MTBF_S), timeout=240)
    by_rank = {r["rank"]: r for r in json.loads(next(l for l in p.stdout.splitlines()
                                                     if l.startswith("RESULT "))[len("RESULT "):])}
    tier0, tier1, control = by_rank[0]["tier"], by_rank[1]["tier"], by_rank[0]["control"]
    plans = PLAN_RE.findall(p.stderr)
    assert plans, p.stderr[-3000:]
    assert all(k != "-" and "memory tier pays" in why for why, k, _ in plans), plans   # the setup's premise
    ks, ds = [int(k) for _, k, _ in plans], [int(d) for _, _, d in plans]
    why = f"plans {list(zip(ks, ds))}, costs {tier0['costs']}"

    # k: from the plan, on both ranks at the same step, after the plan at REPLAN_EVERY and its margin
    assert tier0["every"] == tier1["every"], why
    every = tier0["every"]
    assert dedup(every) == dedup([memtier.DEFAULT_EVERY, *ks]), (dedup(every), why)
    if ks[0] != memtier.DEFAULT_EVERY:
        assert every.index(ks[0]) >= memtier.REPLAN_EVERY + memtier.PLAN_MARGIN, why
    # ... and the tier copies exactly every k in force from its phase, on both ranks; a new k takes
    # over at a copy step of the old one, so no two copies are closer than the smaller k (copies a
    # step apart would find the first in flight: CI, 2026-11-29, k 10 -> 9 at step 621)
    assert tier0["phase"] == tier1["phase"], why
    for r in (tier0, tier1):
        made = [s for s in range(1, STEPS) if r["copies"][s] > r["copies"][s - 1]]
        assert made == [s for s in range(1, STEPS) if (s - r["phase"][s]) % r["every"][s] == 0], (made, r["every"])
        for a, b in zip(made, made[1:]):
            assert b - a in (r["every"][a], r["every"][b]), (a, b, made, why)
        assert r["skipped"] == 0

    # D: rank 0's disk interval is the plan's, set at the plan (from step REPLAN_EVERY on)
    disk = tier0["disk"]
    assert dedup(disk) == dedup([None, *ds]), (dedup(disk), why)
    switch = next(s for s, d in enumerate(disk) if d is not None)
    assert switch >= memtier.REPLAN_EVERY, (switch, why)
    saves = planned_saves(tmp_path / "tier")
    after = [(a, b) for a, b in zip(saves, saves[1:]) if a >= switch]
    assert len(after) >= 2, (saves, why)
    for a, b in after:
        # the save after a is at the first step s whose interval in force (set at boundary s - 1,
        # where s is decided) has passed: exactly D after a, also across a replan (unless the
        # replan shortened D below the steps already done: then at once). Under one D throughout,
        # that is b - a == D exactly. (No interval need lie under one D: a replan every
        # REPLAN_EVERY steps moves D by a few steps, and D ~ 120-145 leaves some runs none.)
        assert b - a >= disk[b - 1] and all(s - a < disk[s - 1] for s in range(a + 1, b)), (a, b, saves, why)

    # ... which is not what the schedule's own single-tier plan does: without the memory tier
    # (the control) disk saves come well under D apart. Not its first interval, nor this run's
    # before the plan: each is planned from one save's cost, a cold one, and came out 121 and 136
    # steps against D 117 and 130 under load (2026-11-29); later ones use the median of several.
    assert set(control["every"]) == {None} and set(control["disk"]) == {None}
    own = gaps(planned_saves(tmp_path / "control"))
    assert len(own) >= 5 and [s for s in saves if s < switch], (own, saves)
    assert max(own[1:]) < min(ds), (own, why)

    # every plan said is in the event log (coci-status shows the newest), with the failures its
    # disk interval answers: the setup's partner losses and the whole-job defaults
    logged = [e for e in read_events(tmp_path / "tier") if e["event"] == "two_tier_plan"]
    assert [(str(e["memory_every"]), e["disk_every"]) for e in logged] == [(k, int(d)) for _, k, d in plans]
    assert all("partner losses" in e["disk_reason"] and "whole-job failures" in e["disk_reason"]
               for e in logged), logged

    # checkpoint timing never changes training: the same final parameters
    assert tier0["final"] == control["final"] == by_rank[1]["control"]["final"]
