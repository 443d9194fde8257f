"""Subprocess driver for checkpoint tests (run plainly or under mpiexec).

    ckpt_job.py write DIR STEP SEED     save full_state(SEED) at STEP; print REPL_HASH / SHARD rows
    ckpt_job.py read DIR                load the latest into a fresh state; print the same
    ckpt_job.py die DIR                 save step 1, then start step 2 and hang mid-write (to be killed)
"""
from __future__ import annotations

import json
import sys
import time

import torch

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint.rawio import write_posix
from coci_hpc.comm import Comm
from tests.checkpoint.helpers import empty_state, full_state, replicated_hash
from tests.faults.faulty import patch_writes


def report(comm: Comm, state: dict, step: int) -> None:
    rows = comm.gather(state["extras"]["emb"].local.tolist())
    if comm.rank == 0:
        flat = [r for part in rows for r in part]
        print("RESULT " + json.dumps({"hash": replicated_hash(state), "rows": flat, "step": step,
                                      "world": comm.size}), flush=True)


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    comm = Comm.world()
    mgr = CheckpointManager(root, comm=comm)
    if mode == "write":
        step, seed = int(sys.argv[3]), int(sys.argv[4])
        state = full_state(seed, comm.rank, comm.size)
        mgr.save(step, state)
        report(comm, state, step)
    elif mode == "read":
        state = empty_state(comm.rank, comm.size)
        res = mgr.load_latest(state)
        report(comm, state, res.step)
    elif mode == "die":
        mgr.save(1, full_state(1))
        real = write_posix

        def write_then_hang(path, items, **kw):
            real(path, items[:1], fsync=True)  # some data reaches the file ...
            print("MIDWRITE", flush=True)
            time.sleep(600)                    # ... and the writer is killed here

        patch_writes(write_then_hang)
        mgr.save(2, full_state(2))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
