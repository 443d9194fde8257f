"""A host that goes silent under coci-submit's relaunch loop (``--spare-nodes 1``, the local cluster
switched to 3 nodes and back, as tests/submit/test_relaunch_cluster.py): ``devcluster fail --hard
--freeze`` stops rank 1's processes on n2 and marks n2 DOWN only ``DELAY_S`` later (SlurmdTimeout's
stand-in). srun's step ends only when its last task does, so the loop used to restart only once the
node was declared dead (30.4 s after a freeze with ``--delay 30``). Now the survivors' writer leaves
a marker after its save, and once every task on the other nodes has ended the loop ends the step
itself (relaunch.silent_nodes): the restart on the spare begins well before n2 is DOWN, n2 (whose
task never ended) is the suspect rather than the survivor srun reported first, the job completes in
its single allocation and the run is bit-exact."""
from __future__ import annotations

import json
import os
import random
import subprocess
import time

import pytest

from coci_hpc.runtime.events import read_events
from tests.conftest import SlurmCluster, reference_hash, wait_for
from tests.submit.conftest import rank0_logs, reference_then_submit_with_a_spare

pytestmark = pytest.mark.slurm

DELAY_S = 60            # n2 is marked DOWN this long after it froze
RESTART_BOUND_S = 25    # freeze -> the loop ends the step: gloo's bound (10 s) + the probe (5 s) + slack


def test_silent_host_is_restarted_in_place_before_it_is_declared_down(three_nodes: SlurmCluster) -> None:
    cluster = three_nodes
    dc = str(cluster.devcluster)
    wd = cluster.workdir / "silent-relaunch"
    ref_hash, ckpt, job = reference_then_submit_with_a_spare(cluster, wd, 400)
    fail = None
    try:
        wait_for(lambda: any(e["event"] == "checkpoint" for e in read_events(ckpt)), "the first checkpoint", 180)
        time.sleep(random.uniform(0.5, 2.0))
        t_freeze = time.time()
        # Blocks for DELAY_S (then SIGKILLs what it froze and marks n2 DOWN): in the background.
        fail = subprocess.Popen([dc, "fail", "n2", "--hard", "--freeze", "--delay", str(DELAY_S)], env=cluster.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: any(e["event"] == "resumed" and e["attempt"] == 2 for e in read_events(ckpt)),
                  "the in-place restart", DELAY_S + 60)
        t_resumed = time.time()
        rows = cluster.wait_gone(job, timeout=300)
    finally:
        if fail is not None:     # n2 must be DOWN (the delayed mark done) before it is recovered
            out, _ = fail.communicate(timeout=DELAY_S + 60)
            print(out)
        cluster.run(dc, "recover", "n2", check=False)
    out, err = rank0_logs(wd, job)
    print(out[-2000:], err[-4000:], rows, sep="\n")
    events = read_events(ckpt)
    relaunches = [e for e in events if e["event"] == "relaunch"]
    lost = [e for e in events if e["event"] == "peer_lost"]
    print(json.dumps(relaunches + lost, indent=1))
    ended_s = relaunches[0]["step_ended_wall"] - t_freeze
    print(f"frozen -> peer_lost {lost[0]['detect_wall'] - t_freeze:.1f}s, -> committed "
          f"{(lost[0]['commit_wall'] or float('nan')) - t_freeze:.1f}s, -> step ended {ended_s:.1f}s, "
          f"-> resumed {t_resumed - t_freeze:.1f}s (n2 DOWN at {DELAY_S}s); load {os.getloadavg()}")
    assert "no task on n2 has ended" in err
    # One restart in place, on the spare; n2, whose task never ended, is the suspect (not n1, whose
    # survivor's exit srun reported first), and the decision did not wait for Slurm.
    assert [(r["action"], r["nodes"], r["lost_task_on"]) for r in relaunches] == [("relaunch", ["n1", "n3"], ["n2"])]
    assert ended_s < RESTART_BOUND_S < DELAY_S, relaunches
    assert t_resumed - t_freeze < DELAY_S, (t_resumed, t_freeze)
    assert len(lost) == 1 and lost[0]["committed"], lost
    # A single allocation, never requeued (RESIZING: n2 left the --no-kill job when it went DOWN).
    states = [r["State"] for r in rows]
    assert states[-1] == "COMPLETED" and set(states) <= {"RESIZING", "COMPLETED"}, rows
    starts = [e for e in events if e["event"] == "attempt_start"]
    assert len(starts) == 2 and starts[1]["steps_lost"] <= 1, starts
    assert reference_hash(out) == ref_hash
