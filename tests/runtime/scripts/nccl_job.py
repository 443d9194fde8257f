"""Subprocess driver for the NCCL watcher's end-to-end tests (tests/runtime/test_ncclwatch.py):
``mpiexec -n 2``, the Session under MPI, data-parallel training whose gradient allreduce goes through
the FAKE NCCL backend of tests/runtime/fake_nccl.py (gloo underneath).

    nccl_job.py --steps N --ckpt-dir DIR    train until N steps are done (resuming from DIR); rank 0
                                            prints final_params_sha256=... at the end

Set in the environment, not on the command line (a resumed run must be the same command for the
Session's run record):

    NCCL_JOB_FREEZE_AT=S   rank 1 prints ``FROZEN <unix time>`` and stops itself (SIGSTOP: a frozen
                           host, whose process never runs again) inside step S, before its gradient
                           allreduce: rank 0 then waits in that allreduce, which never returns
    NCCL_JOB_NO_WATCH=1    the watcher is left out (``ncclwatch.for_session`` answers None): the
                           emulated hang must then block rank 0 for good
"""
from __future__ import annotations

import argparse
import faulthandler
import hashlib
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import coci_hpc
from coci_hpc.comm import Comm
from coci_hpc.runtime import ncclwatch
from coci_hpc.runtime.data import ResumableSampler
from coci_hpc.runtime.distributed import rendezvous
from tests.runtime import fake_nccl

SAMPLES, D_IN, BATCH = 256, 8, 16


def main() -> int:
    faulthandler.register(signal.SIGQUIT, all_threads=True)   # a hung run's stacks, on demand
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt-dir", required=True)
    args = ap.parse_args()
    root, steps = args.ckpt_dir, args.steps
    freeze_at = int(os.environ.get("NCCL_JOB_FREEZE_AT", "-1"))
    if os.environ.get("NCCL_JOB_NO_WATCH") == "1":
        ncclwatch.for_session = lambda *a, **k: None      # type: ignore[assignment]
    torch.set_num_threads(1)
    comm = Comm.world()
    fake_nccl.register()
    values, _ = rendezvous(comm)
    rank, world = int(values["RANK"]), int(values["WORLD_SIZE"])
    dist.init_process_group(fake_nccl.NAME, init_method=f"tcp://{values['MASTER_ADDR']}:{values['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(0)                                  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, D_IN, generator=gen), torch.randn(SAMPLES, 1, generator=gen)
    torch.manual_seed(1000 + rank)                        # per-rank dropout streams: the RNG is state too
    sampler = ResumableSampler(SAMPLES, seed=0, rank=rank, world_size=world)
    state = {"model": model, "optimizer": opt, "loader": sampler}
    session = coci_hpc.Session(state, total_steps=steps, ckpt_dir=root)
    for step in session.steps():
        idx = torch.from_numpy(sampler.next_batch(BATCH))
        loss = F.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        if rank == 1 and step + 1 == freeze_at:
            print(f"FROZEN {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        for p in model.parameters():                      # the gradient allreduce (DDP's, by hand)
            assert p.grad is not None
            dist.all_reduce(p.grad)                       # the fake's wait: NCCL's wait on the stream
            p.grad.div_(world)
        opt.step()
        session.observe(loss.detach())
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    if rank == 0:
        print(f"final_params_sha256={digest}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
