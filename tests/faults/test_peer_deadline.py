"""A peer that vanishes in the middle of a checkpoint save (issue 13): with ``Comm.peer_deadline_s``
set (the Session sets it), every collective of the store is polled against that deadline and
raises PeerLost instead of blocking for ever, and an MPI-IO call that cannot be polled is guarded
by a timer that hands the stuck call to ``Comm.on_stuck``. Two real MPI ranks; "rank 1 vanished"
is rank 1 not joining (it sleeps, then leaves): to rank 0 that is the same as a SIGKILLed peer
under ``srun --mpi=pmix`` (its collectives never complete)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, clean_env

SCRIPT = r'''
import json, os, sys, time
from pathlib import Path
import numpy as np, torch
from mpi4py import MPI
from coci_hpc.comm import Comm
from coci_hpc.errors import PeerLost
from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint.rawio import WriteItem, write_mpiio

out = Path(sys.argv[1]); comm = Comm.world(); r = comm.rank
res = {}
# 1. Both ranks present: the polled collectives give what the blocking ones give.
blocking = [comm.bcast({"a": [1, 2]} if r == 0 else None), comm.allgather(("x", r)), comm.gather(r * 10),
            comm.scatter([{"to": i} for i in range(2)] if r == 0 else None), comm.allreduce_min(r + 0.5),
            comm.allreduce_max(r + 0.5)]
comm.peer_deadline_s = 2.0
polled = [comm.bcast({"a": [1, 2]} if r == 0 else None), comm.allgather(("x", r)), comm.gather(r * 10),
          comm.scatter([{"to": i} for i in range(2)] if r == 0 else None), comm.allreduce_min(r + 0.5),
          comm.allreduce_max(r + 0.5)]
comm.barrier()
res["same"] = repr(blocking) == repr(polled)
# 2. Rank 1 does not join rank 0's save: rank 0 gets PeerLost within the deadline, then at once.
torch.manual_seed(0)   # replicated state: equal on every rank (the store refuses to mix differing copies)
model = torch.nn.Linear(8, 4)
mgr = CheckpointManager(out / "ckpt", comm)
mgr.save(1, {"model": model})
comm.peer_deadline_s = 0.5
if r == 0:
    t0 = time.monotonic()
    try:
        mgr.save_async(2, {"model": model})
        res["save"] = "returned"
    except PeerLost as exc:
        res["save"] = "PeerLost"
        res["save_s"] = time.monotonic() - t0
        res["msg"] = str(exc)
    t0 = time.monotonic()
    try:
        comm.barrier()
    except PeerLost:
        res["again_s"] = time.monotonic() - t0
    # 3. An MPI-IO write the peer never joins: the guard's timer calls on_stuck.
    fired = []
    comm.lost = False
    comm.on_stuck = lambda what: (fired.append((what, time.monotonic() - t1)),
                                  (out / "rank0.json").write_text(json.dumps({**res, "stuck": fired})),
                                  os._exit(0))
    (out / "f.bin").write_bytes(b"\0" * 4096)
    t1 = time.monotonic()
    write_mpiio(MPI.COMM_WORLD, out / "f.bin", [WriteItem(0, np.ones(16, np.uint8))], guard=comm)
    (out / "rank0.json").write_text(json.dumps({**res, "stuck": "never"}))
else:
    time.sleep(4)
os._exit(0)     # no MPI_Finalize: it would wait for the abandoned requests
'''


def test_a_peer_lost_mid_save_raises_peer_lost_and_a_stuck_mpiio_call_is_handed_over(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    # Rank 0 leaves without MPI_Finalize (it would wait for the abandoned requests): mpiexec then
    # reports an improper exit and ends rank 1; what matters is what rank 0 wrote.
    p = subprocess.run(["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, str(script),
                        str(tmp_path)], capture_output=True, text=True, timeout=120, env=clean_env(), cwd=ROOT)
    assert (tmp_path / "rank0.json").exists(), p.stdout + p.stderr
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["same"] is True
    assert res["save"] == "PeerLost", res
    assert 0.4 <= res["save_s"] < 3.0, res
    assert "did not complete within 0.5s" in res["msg"]
    assert res["again_s"] < 0.1                      # lost: the next collective raises at once
    what, after = res["stuck"][0]
    assert "did not return within 0.5s" in what and 0.4 <= after < 3.0, res["stuck"]
