"""The memory tier (coci_hpc.runtime.memtier) on real FSDP2 state under mpiexec: the partner's
copy is bit-exact, the host buffers are reused, a lost rank's shards come back from its partner
bit-exactly, and a rank lost with its partner falls back to the disk tier and says so."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import clean_env, run_ranks

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "memtier_job.py")


def job(n: int, *args: Any, rpn: int = 1) -> list[dict[str, Any]]:
    env = clean_env()
    env["MEMTIER_JOB_RPN"] = str(rpn)
    out = run_ranks(n, SCRIPT, *map(str, args), timeout=240, env=env).stdout
    line = next(l for l in out.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("n,rpn", [(2, 1), (4, 2)])
def test_partner_copy_is_bit_exact_and_buffers_are_reused(tmp_path: Path, n: int, rpn: int) -> None:
    k = 2
    res = job(n, "copy", tmp_path, k, 5 * k, rpn=rpn)
    by_rank = {r["rank"]: r for r in res}
    for r in res:
        # partner on the next "node" (rpn ranks per node), as the per-rank copy chooses it
        assert r["partner"] == (r["rank"] + (rpn if rpn < n else 1)) % n
        src = by_rank[r["source"]]
        assert r["complete_step"] == 5 * k and r["complete_rank"] == src["rank"]
        # the copy this rank holds is its source's local FSDP2 shards at that step, byte for byte
        assert r["received"] == src["own_at_last"] and r["received"]
        assert r["skipped"] == 0
        # A copy sent at boundary s is taken in by the receiver's next boundary: the step's gloo
        # collectives order every rank's boundary s before any rank's boundary s + 1, and nothing
        # calls MPI in between. (One Iprobe per boundary took it in a boundary late: the sender's
        # request was then still open at the next copy's step and that copy was skipped, or the
        # driver waited for a copy never sent; under mpiexec that hung the HSDP test.)
        for t, got in enumerate(r["seen"], start=1):
            newest_before = (t - 1) // k * k          # the newest copy sent at a boundary before t
            assert newest_before <= got <= t or (newest_before == 0 and got == -1), (t, r["seen"])
        # two own + two received slots, allocated in the first copies, never again
        assert r["allocs"][-1] == 4 and r["allocs"][2 * k + 1:] == [4] * (len(r["allocs"]) - 2 * k - 1)
        assert r["addrs_stable"] is True


def test_lost_rank_recovers_from_partner_bit_exactly(tmp_path: Path) -> None:
    res = job(2, "recover", tmp_path, 3, 7, "1")
    out = res[0]["outcome"]
    assert out["committed"] and out["tier"] == "memory" and out["step"] == 6 and out["from_partner"] == [1]
    assert out["lost"] == [1]                            # the rank that posted nothing
    for r in res:
        assert r["loaded_step"] == 6                     # lost 7 - 6 = 1 <= k steps
        assert r["loaded"] == r["expected"]              # gathered full tensors, bit for bit


def test_node_loss_with_two_ranks_per_node(tmp_path: Path) -> None:
    # ranks 2, 3 (one "node") lost; their partners 0, 1 hold their copies
    res = job(4, "recover", tmp_path, 2, 5, "2,3", rpn=2)
    writers = [r["outcome"] for r in res if "outcome" in r and r["outcome"]["writer"]]
    assert len(writers) == 1
    assert writers[0]["tier"] == "memory" and writers[0]["step"] == 4 and writers[0]["from_partner"] == [2, 3]
    assert writers[0]["lost"] == [2, 3]
    for r in res:
        assert r["loaded_step"] == 4 and r["loaded"] == r["expected"]


def test_rank_and_partner_lost_falls_back_to_disk(tmp_path: Path) -> None:
    # 4 ranks, 2 per node: ranks 1 and 3 are each other's partners; losing both loses both copies
    res = job(4, "recover", tmp_path, 2, 5, "1,3", rpn=2)
    writers = [r["outcome"] for r in res if "outcome" in r and r["outcome"]["writer"]]
    assert len(writers) == 1
    w = writers[0]
    assert not w["committed"] and w["tier"] == "disk" and "disk tier" in w["reason"]
    assert "[1, 3]" in w["reason"]
    assert w["lost"] == [1, 3] and w["from_partner"] == []   # what the event log's `lost` says (not "?")
    for r in res:
        assert r["loaded_step"] == 1 and r["loaded"] == r["expected"]   # the disk checkpoint of step 1


def test_k_from_the_plan_reaches_every_rank_at_the_same_step(tmp_path: Path) -> None:
    res = job(2, "plan", tmp_path, 2, 30)
    a, b = res[0]["every"], res[1]["every"]
    assert a == b                                    # every rank switched at the same step
    assert a[0] == 2 and a[-1] == 3                  # from the starting k to the planned one
    first = a.index(3)
    assert first >= 4 + 10                           # planned at step 4+ (a copy timed), applied >= 10 steps on
    # the new k takes over at a copy step of the old (step first + 1): copies 2 apart, then 3
    made = [i + 1 for i, (c, before) in enumerate(zip(res[0]["copies"], [0, *res[0]["copies"]])) if c > before]
    switch = first + 1
    assert made == [s for s in range(1, 31) if (s % 2 == 0 if s < switch else (s - switch) % 3 == 0)], (made, switch)


def test_a_new_k_takes_over_at_a_copy_step_of_the_old_one() -> None:
    from coci_hpc.runtime.memtier import OFF_EVERY, PLAN_MARGIN, switch_step

    for every, phase, step in [(10, 0, 600), (10, 0, 605), (9, 0, 605), (7, 30, 200), (2, 0, 4), (500, 0, 400)]:
        at = switch_step(step, every, phase)
        assert (at - phase) % every == 0                              # a copy step of the old k
        assert at >= step + max(PLAN_MARGIN, 2 * every)               # every rank has the message by then
        assert at - every < step + max(PLAN_MARGIN, 2 * every)        # ... and the first such step
    assert switch_step(600, 10, 615) == 625                           # not before a phase still to come
    assert switch_step(600, OFF_EVERY, 0) == 600 + PLAN_MARGIN        # the tier off: the margin alone


class _Sched:
    """The schedule's side of ``memtier.plan_with``: a given 30-day MTBF on 16 nodes, measured
    costs (``measured=False``: no disk save timed yet)."""

    nodes = 16

    def __init__(self, measured: bool = True) -> None:
        from coci_hpc.planner.failures import from_mtbf

        self.failure_model = from_mtbf(30 * 24 * 3600.0)
        self.measured = measured

    def costs(self) -> Any:
        from coci_hpc.planner.costs import Costs

        return Costs(5.0, 120.0, 0.5)


def test_plan_with_uses_the_two_tier_planner_on_measured_costs() -> None:
    from coci_hpc.runtime import memtier

    said: list[str] = []
    k, disk = memtier.plan_with(_Sched(), 24 * 3600.0, said.append)([0.05, 0.05])
    from coci_hpc.planner import two_tier
    p = two_tier.plan_two_tier(two_tier.TierCosts(0.05, 5.0, 120.0, 120.0, 0.5),
                               two_tier.profile_from_model(_Sched().failure_model, 16), 24 * 3600.0)
    assert (k, disk) == (p.mem_every_steps, p.disk_every_steps) and k is not None and disk > k
    assert said and f"memory copy every {k} step(s)" in said[0]
    # with no partner loss known (a given MTBF) the disk interval answers the whole-job failures
    assert disk * 0.5 < 24 * 3600.0 and "whole-job failures" in said[0]
    # no disk save timed yet: no plan
    assert memtier.plan_with(_Sched(measured=False), 24 * 3600.0, said.append)([0.05]) is None


def test_plan_with_reads_the_settings_and_logs_the_plan(tmp_path: Path) -> None:
    """COCI_WHOLE_JOB_SHARE / COCI_OUTAGE_RATE reach the plan (a bad value stops the start,
    naming it); the plan goes into the event log, where coci-status shows both intervals."""
    import pytest

    from coci_hpc import history
    from coci_hpc.errors import UsageError
    from coci_hpc.runtime import memtier
    from coci_hpc.runtime.events import EventLog, read_records

    with pytest.raises(UsageError, match="COCI_WHOLE_JOB_SHARE"):
        memtier.plan_with(_Sched(), 3600.0, print, {"COCI_WHOLE_JOB_SHARE": "1.2"})
    path = tmp_path / "events.jsonl"
    log = EventLog(path, attempt=1, job_id=None)
    log.write("attempt_start", nodes=["a", "b"], ranks=2)
    lo = memtier.plan_with(_Sched(), 24 * 3600.0, print, {"COCI_OUTAGE_RATE": "0"}, path, log)([0.05])
    hi = memtier.plan_with(_Sched(), 24 * 3600.0, print, {"COCI_OUTAGE_RATE": "0.02"}, path, log)([0.05])
    assert lo is not None and hi is not None and hi[1] < lo[1]      # more outages: disk saves closer
    plans = [r for r in read_records(path) if r.EVENT == "two_tier_plan"]
    assert [(p.memory_every, p.disk_every) for p in plans] == [lo, hi]
    text = history.render_text(history.build(read_records(path), str(tmp_path)))
    assert f"disk save every {hi[1]} step(s)" in text and "disk: Daly's interval" in text
    assert "outages 1 per 50 h (given)" in text and "two-tier plan (attempt 1" in text


def test_tier_off_on_every_rank_when_host_memory_is_short() -> None:
    from coci_hpc.comm import Comm
    from coci_hpc.runtime import memtier

    said: list[str] = []
    state = {"w": __import__("torch").ones(1000)}
    tier = memtier.for_session(lambda: state, Comm.serial(), 1, ["replicated/w"], True, {}, said.append,
                               available=lambda: 1000)
    assert tier is None and said and "memory tier off" in said[0] and "host memory" in said[0]
    # nothing held in parts (data-parallel) or the tier switched off: no tier, nothing said
    assert memtier.for_session(lambda: state, Comm.serial(), 1, [], True, {}, said.append) is None
    assert memtier.for_session(lambda: state, Comm.serial(), 1, ["x"], True, {"COCI_MEMTIER_K": "0"},
                               said.append) is None and len(said) == 1
