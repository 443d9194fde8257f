"""A host that stops answering (issue 13, "No rank ever blocks forever on a dead peer"), end to end
through coci-submit on 2 nodes: ``devcluster fail --hard --freeze`` stops rank 1's processes, so the
survivor's TCP connections stay open and silent (no reset, unlike every kill). The survivor waits
inside DDP's gloo allreduce in ``loss.backward()``; gloo's per-op timeout, bounded by the session's
peer deadline (runtime/optimeout.py), raises there within seconds instead of COCI_DIST_TIMEOUT_S
(120 s), and the survivors' checkpoint is committed long before the node is marked DOWN
(``--delay``, standing for SlurmdTimeout). The run resumes from it, repeats at most one step and
ends bit-exact."""
from __future__ import annotations

import random
import time

import pytest

from coci_hpc.runtime.distributed import DEFAULT_TIMEOUT_S
from coci_hpc.runtime.events import read_events
from tests.conftest import SlurmCluster
from tests.submit.conftest import check_peer_run, submit_peer_run, wait_step

pytestmark = pytest.mark.slurm

# The node is marked DOWN this long after it froze (SlurmdTimeout: 300 s on real sites). Long enough
# that the requeued run usually starts on n1 and the frozen n2 first (Slurm does not know yet), as
# on a real site: the dead node runs none of it (devcluster holds it stopped) and its DOWN ends it.
DELAY_S = 50
DETECT_BOUND_S = 25     # freeze -> detection: gloo bound (10 s) + the probe (5 s) + slack for a loaded machine


def test_frozen_host_is_detected_in_seconds_and_the_run_resumes_bit_exact(slurm_cluster: SlurmCluster,
                                                                          peer_reference: str) -> None:
    wd = slurm_cluster.workdir / "silent-host"
    wd.mkdir()
    job, ckpt, log0 = submit_peer_run(slurm_cluster, wd)
    wait_step(log0, random.randint(40, 120), cluster=slurm_cluster)
    t_freeze = time.time()
    try:
        slurm_cluster.run(str(slurm_cluster.devcluster), "fail", "n2", "--hard", "--freeze",
                          "--delay", str(DELAY_S))
        slurm_cluster.wait_state(job, ("PENDING",), timeout=60)
    finally:
        slurm_cluster.run(str(slurm_cluster.devcluster), "recover", "n2")
    res = check_peer_run(slurm_cluster, wd, job, ckpt, log0, peer_reference, ("REQUEUED", "NODE_FAIL"))
    lost = res["lost"]
    detect_s = lost["detect_wall"] - t_freeze
    print(f"frozen -> detected {detect_s:.1f}s, -> committed "
          f"{(lost['commit_wall'] or float('nan')) - t_freeze:.1f}s; how: {lost['how']}")
    assert detect_s < DETECT_BOUND_S < DEFAULT_TIMEOUT_S, lost
    assert lost["committed"] and lost["commit_wall"] - t_freeze < DELAY_S, lost   # before Slurm noticed
    assert [e for e in read_events(ckpt) if e["event"] == "attempt_start"][1]["steps_lost"] <= 1
