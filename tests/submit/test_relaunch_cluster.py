"""`coci-submit --spare-nodes` on the local cluster switched to 3 nodes (and back): a crash and a hard
node failure are restarted inside the allocation, never requeued, and the run ends bit-exact; a script
that crashes every time ends after --max-restarts with the reason."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coci_hpc.runtime.events import read_events
from tests.conftest import ROOT, SlurmCluster, reference_hash, wait_for
from tests.submit.conftest import rank0_logs, reference_then_submit_with_a_spare, submit_in

pytestmark = pytest.mark.slurm

STEPS = 400


def _n_attempts(ckpt: Path) -> int:
    return sum(e["event"] == "attempt_start" for e in read_events(ckpt))


def test_crash_then_node_failure_restart_in_place_bit_exact(three_nodes: SlurmCluster) -> None:
    cluster = three_nodes
    wd = cluster.workdir / "relaunch"
    ref_hash, ckpt, job = reference_then_submit_with_a_spare(cluster, wd, STEPS)
    failures = []
    try:
        # 1. A crash (rank 1's processes SIGKILLed, no node down): restarted in place at once, on the
        # spare n3 rather than on n2, whose task was lost (Slurm may mark a dying node down later).
        # The waits below are generous (the new ranks' process start took 33 s at load 10, 26 Nov);
        # the latency itself is judged at the end, against the measured process start.
        wait_for(lambda: any(e["event"] == "checkpoint" for e in read_events(ckpt)), "the first checkpoint", 180)
        time.sleep(random.uniform(0, 1.5))
        failures.append(("crash", time.time()))
        cluster.run(str(cluster.devcluster), "kill-tasks", "n2")
        wait_for(lambda: _n_attempts(ckpt) >= 2 and any(e["event"] == "resumed" and e["attempt"] == 2
                                                         for e in read_events(ckpt)), "the restart", 180)
        # 2. A hard node failure at a random step: n2 dies, Slurm marks it DOWN 1 s later. The step is
        # drawn between two checkpoints (after step 100's commit, before step 150 at ~18 steps/s), so
        # that the loss surfaces inside a step, the path this test times. A loss during a save's
        # collectives (polled against the peer deadline since issue 13) is
        # test_peer_failure_cluster.py's test_peer_killed_mid_save_survivor_saves_that_step_within_seconds.
        wait_for(lambda: any(e["event"] == "checkpoint" and e["attempt"] == 2 for e in read_events(ckpt)),
                  "the restarted run's first checkpoint", 120)
        time.sleep(random.uniform(0.2, 1.5))
        # rank 1's node now: n3, the spare, unless that start failed and the loop moved rank 1
        # again (CI, 29 Nov: the new rank on n3 died of a segfault before training, so the loop
        # restarted it on n2; the test then failed an idle n3)
        victim = [e for e in read_events(ckpt) if e["event"] == "relaunch"][-1]["nodes"][1]
        failures.append(("node", time.time()))
        cluster.run(str(cluster.devcluster), "fail", victim, "--hard", "--delay", "1")
        rows = cluster.wait_gone(job, timeout=300)
    except AssertionError:          # a wait timed out: show what the run did (CI keeps no files)
        out, err = rank0_logs(wd, job)
        print(out[-3000:], err[-6000:], *read_events(ckpt), sep="\n")
        raise
    finally:
        for node in ("n2", "n3"):
            cluster.run(str(cluster.devcluster), "recover", node, check=False)
    out, err = rank0_logs(wd, job)
    print(out[-3000:], err[-4000:], rows, sep="\n")
    events = read_events(ckpt)
    relaunches = [e for e in events if e["event"] == "relaunch"]
    resumed = [e for e in events if e["event"] == "resumed"]
    print(json.dumps(relaunches, indent=1))
    # One sacct attempt, COMPLETED: never requeued (a --no-kill job that lost a node also shows the
    # RESIZING record of its shrink, same job, no restart).
    states = [r["State"] for r in rows]
    assert states[-1] == "COMPLETED" and set(states) <= {"RESIZING", "COMPLETED"}, rows
    assert reference_hash(out) == ref_hash
    # two restarts, one per failure; one more only where a restarted rank died before training
    # (its start, not a failure of the test's making: printed, and allowed once)
    assert [r["action"] for r in relaunches] in (["relaunch"] * 2, ["relaunch"] * 3), relaunches
    assert relaunches[0]["nodes"] == ["n1", "n3"] and "no node down" in relaunches[0]["reason"]
    assert relaunches[0]["lost_task_on"] == ["n2"]
    if len(relaunches) == 3:
        print("a restarted rank died before training:", relaunches[1]["reason"])
        assert relaunches[1]["nodes"] == ["n1", victim]
    # The loop decided before Slurm marked the node down: it is left out because it lost a task.
    assert relaunches[-1]["lost_task_on"] == [victim] and victim not in relaunches[-1]["nodes"]
    assert _n_attempts(ckpt) == 3 and len(resumed) == 2
    latencies = [r["wall"] - t for (_, t), r in zip(failures, resumed)]
    # The survivor learnt of each loss from the relaunch loop's peer notice (srun saw the task end),
    # not from its 5 s peer deadline, so it started its save sooner than that deadline after the kill
    # command (whose own start, a Python process, is included).
    peer_lost = [e for e in events if e["event"] == "peer_lost"]
    noticed = [e["detect_wall"] - t for (_, t), e in zip(failures, peer_lost)]
    print("failure -> survivor's peer_lost s:", [round(x, 2) for x in noticed], [e["how"] for e in peer_lost])
    assert len(peer_lost) == 2 and all("the relaunch loop saw it end" in e["how"] for e in peer_lost), peer_lost
    assert all(x < 5.0 for x in noticed), noticed
    lost = [e.get("steps_lost") for e in events if e["event"] == "attempt_start"][1:]
    print("restart latency (failure -> resumed) s:", [round(x, 2) for x in latencies], "steps lost:", lost)
    st = subprocess.run([sys.executable, "-m", "coci_hpc.cli.status", str(ckpt), "--no-png"], capture_output=True,
                        text=True, env={**cluster.env, "PYTHONPATH": str(ROOT)}, timeout=120)
    print(st.stdout)
    where = ",".join(relaunches[-1]["nodes"])
    assert st.returncode == 0 and f"attempt 3: restarted in place on {where}" in st.stdout, st.stdout + st.stderr
    # Acceptance: at most 10 s per in-place restart (relaunch_bench's 5 failures, in README). Nearly
    # all of it is now the new ranks' process start (interpreter, `import torch`, the torch._dynamo
    # import inside DDP's constructor): CPU they share with whatever else runs, 3-6 s at load 3-5
    # and 9-11 s at load 10 on the shared 2-core development machine. So every restart must take at
    # most 10 s, unless its process start alone took over 7 s (an overloaded machine); in every case
    # the parts outside the start (detect, decide, relaunch, restore: this code's) take at most 2.5 s
    # (the survivor's 5 s deadline alone made them over 5 s before the peer notice).
    from coci_hpc import history

    splits = [a.in_place for a in history.load(ckpt, use_sacct=False).attempts if a.in_place]
    starts = [s["process_start_s"] for s in splits]
    rest = [s["total_s"] - s["process_start_s"] for s in splits]
    print("process start s:", [round(x, 2) for x in starts], "the rest s:", [round(x, 2) for x in rest],
          "load:", os.getloadavg())
    assert len(starts) == 2 and all(r <= 2.5 for r in rest), (starts, rest)
    assert all(0 < x and (x <= 10.0 or st > 7.0) for x, st in zip(latencies, starts)), (latencies, starts)


def test_crash_every_time_ends_after_max_restarts(three_nodes: SlurmCluster) -> None:
    cluster = three_nodes
    wd = cluster.workdir / "relaunch-crash"
    wd.mkdir()
    (wd / "crash.py").write_text("import sys\nprint('crashing', flush=True)\nsys.exit(3)\n")
    job = submit_in(cluster, wd, "--nodes", "2", "--spare-nodes", "1", "--max-restarts", "2",
                  "--ckpt-dir", str(wd / "ckpt"), str(wd / "crash.py"))
    rows = cluster.wait_gone(job, timeout=120)
    out, err = rank0_logs(wd, job)
    print(out, err[-3000:], rows, sep="\n")
    assert [r["State"] for r in rows] == ["FAILED"], rows
    assert out.count("crashing") == 3   # rank 0: the first launch and 2 restarts
    assert "again after 2 in-place restart(s) (--max-restarts 2)" in err
    assert "exited with status 3" in err


def test_two_node_failures_with_one_spare_second_requeues_bit_exact(three_nodes: SlurmCluster) -> None:
    """The first hard node failure uses the spare (restart in place); the second leaves one healthy
    node for two ranks: the loop requeues the job, which starts again once the nodes are back and
    still ends with the uninterrupted run's parameters."""
    cluster = three_nodes
    dc = str(cluster.devcluster)
    wd = cluster.workdir / "relaunch-twice"
    ref_hash, ckpt, job = reference_then_submit_with_a_spare(cluster, wd, 300)

    def relaunches() -> list[dict]:
        return [e for e in read_events(ckpt) if e["event"] == "relaunch"]
    try:
        wait_for(lambda: any(e["event"] == "checkpoint" for e in read_events(ckpt)), "the first checkpoint", 180)
        cluster.run(dc, "fail", "n2", "--hard", "--delay", "1")
        wait_for(lambda: any(e["event"] == "resumed" and e["attempt"] == 2 for e in read_events(ckpt)),
                  "the in-place restart", 90)
        time.sleep(random.uniform(0.5, 2))
        cluster.run(dc, "fail", "n3", "--hard", "--delay", "1")
        # (up to the loop's 30 s step grace when the loss caught the survivor inside a checkpoint write)
        wait_for(lambda: len(relaunches()) >= 2, "the second decision", 150)
    finally:
        # The requeued job asks for its nodes again: give them back.
        cluster.run(dc, "recover", "n2", check=False)
        cluster.run(dc, "recover", "n3", check=False)
    rows = cluster.wait_gone(job, timeout=300)
    out, err = rank0_logs(wd, job)
    print(out[-2000:], err[-4000:], rows, json.dumps(relaunches(), indent=1), sep="\n")
    events = read_events(ckpt)
    assert [(r["action"], r["nodes"]) for r in relaunches()] == [("relaunch", ["n1", "n3"]), ("requeue", [])]
    assert "1 healthy node(s) left" in relaunches()[1]["reason"]
    # sacct -D of a --no-kill job that shrank and was requeued: RESIZING rows, then COMPLETED (the
    # requeue shows in Slurm's restart count, SLURM_RESTART_COUNT 1 in the third attempt).
    states = [r["State"] for r in rows]
    assert states[-1] == "COMPLETED" and set(states) <= {"RESIZING", "REQUEUED", "COMPLETED"}, rows
    starts = [e for e in events if e["event"] == "attempt_start"]
    assert len(starts) == 3 and [s["restart_count"] for s in starts] == [0, 0, 1]
    assert starts[2]["prev_end"]["reason"] == "node_failure"
    assert reference_hash(out) == ref_hash
