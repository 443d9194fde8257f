"""Driver for the store-semantics scenarios (run plainly or under mpiexec; prints RESULT lines).

    semantics_job.py exit_async DIR          save 1, save_async 2 (slow persist), end without close()
    semantics_job.py raise_async DIR         save 1, save_async 2, then the LAST rank raises while the
                                             others enter a training allreduce
    semantics_job.py disk_full DIR sync|async raise|retire_oldest
                                             keep=2 saves of 4 MiB into a small filesystem
    semantics_job.py hold DIR SECONDS        take the directory's writer lock and keep it
    semantics_job.py hang DIR sync|async     the last rank's data write hangs; timeout_s=3
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint.rawio import write_posix
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError, CociError
from tests.faults.faulty import patch_writes

N = 1 << 20  # 4 MiB of float32 per checkpoint


def result(comm: Comm, **values) -> None:
    print("RESULT " + json.dumps({"rank": comm.rank, **values}), flush=True)


def slow_writes(seconds: float, only_rank: int | None, comm: Comm) -> None:
    real = write_posix

    def slow(path, items, **kw):
        if only_rank is None or comm.rank == only_rank:
            time.sleep(seconds)
        return real(path, items, **kw)

    patch_writes(slow)


def state_of(value: float) -> dict:
    return {"w": torch.full((N,), value)}


def main() -> int:
    mode, root = sys.argv[1], Path(sys.argv[2])
    comm = Comm.world()
    last = comm.size - 1
    if mode == "exit_async":
        mgr = CheckpointManager(root, comm=comm)
        mgr.save(1, state_of(1.0))
        slow_writes(1.0, None, comm)
        mgr.save_async(2, state_of(2.0))
        result(comm, started=2)
        return 0  # no close(): the exit guard must finish and commit step 2
    if mode == "raise_async":
        mgr = CheckpointManager(root, comm=comm)
        mgr.save(1, state_of(1.0))
        slow_writes(1.0, None, comm)
        mgr.save_async(2, state_of(2.0))
        if comm.rank == last:
            raise RuntimeError("training step failed on this rank")
        comm.allreduce_max(1.0)  # a training collective the failed rank never joins
        return 0
    if mode == "disk_full":
        how, policy = sys.argv[3], sys.argv[4]
        mgr = CheckpointManager(root, comm=comm, keep=2, on_no_space=policy)
        outcome = "committed"
        for step in (1, 2, 3):
            try:
                if how == "sync":
                    mgr.save(step, state_of(float(step)))
                else:
                    mgr.save_async(step, state_of(float(step)))
                    mgr.wait()
            except CheckpointError as exc:
                outcome = str(exc)
                break
        steps = [c.step for c in cat.scan(root)]
        target = state_of(0.0)
        loaded = mgr.load_latest(target).step
        ok = bool(torch.all(target["w"] == float(loaded)))
        extra = sorted(p.name for p in root.iterdir() if not p.name.startswith(".coci-writer.lock"))
        mgr.close()
        # Short fields: two ranks' long lines could interleave in mpiexec's output.
        result(comm, outcome=outcome[:40], names_option="on_no_space='retire_oldest'" in outcome,
               steps=steps, loaded=loaded, intact=ok, entries=extra)
        return 0
    if mode == "hold":
        mgr = CheckpointManager(root, comm=comm)
        result(comm, locked=True, pid=os.getpid())
        time.sleep(float(sys.argv[3]))
        mgr.close()
        return 0
    if mode == "hang":
        how = sys.argv[3]
        mgr = CheckpointManager(root, comm=comm, timeout_s=3.0, backend="serial")
        mgr.save(1, state_of(1.0))
        real, never = write_posix, threading.Event()

        def hang(path, items, **kw):
            if comm.rank == last:
                never.wait()
            return real(path, items, **kw)

        patch_writes(hang)
        t0 = time.monotonic()
        try:
            if how == "sync":
                mgr.save(2, state_of(2.0))
            else:
                mgr.save_async(2, state_of(2.0))
                while not mgr.poll():
                    comm.allreduce_max(1.0)  # training goes on meanwhile
                    time.sleep(0.05)
            result(comm, error=None)
        except CociError as exc:
            result(comm, error=str(exc)[:300], failed=sorted(getattr(exc, "failed_ranks", {})),
                   seconds=round(time.monotonic() - t0, 1), latest=mgr.latest_step(),
                   step2=cat.step_dir(root, 2).exists())
        return 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
