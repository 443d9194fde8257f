"""Subprocess driver for the replicated-state tests (2 ranks under mpiexec, gloo).

    replicas_job.py bn DIR        DDP + BatchNorm: 6 steps straight, and 3 steps, save, a fresh
                                  model loads it, 3 more; print RESULT with both runs' digests
    replicas_job.py bn_wrapped DIR  the same with the BatchNorm under activation checkpointing's
                                  wrapper, the DDP wrapper itself saved and loaded
    replicas_job.py moments DIR   Adam moments that differ between ranks (local gradients, lr=0):
                                  the save must be refused naming the leaf; print RESULT
"""
from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import coci_hpc
from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError

D_IN, WIDE = 32, 512


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own batch: its BatchNorm running statistics differ from the other rank's."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, D_IN, generator=g) * (1 + rank)
    return x, x.sum(dim=1, keepdim=True)


def bn_model(wrapped: bool = False) -> tuple[torch.nn.Module, DDP, torch.optim.Optimizer]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    # The large first layer comes first: the bytes of today's split fall so that rank 1 would
    # write the BatchNorm buffers from its own copy.
    norm = torch.nn.BatchNorm1d(WIDE)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, WIDE), checkpoint_wrapper(norm) if wrapped else norm,
                                torch.nn.ReLU(), torch.nn.Linear(WIDE, 1))
    return model, DDP(model), torch.optim.SGD(model.parameters(), lr=0.01)


def train(ddp: DDP, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch(rank, step)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def bn(comm: Comm, root: str, wrapped: bool = False) -> dict:
    model, ddp, opt = bn_model(wrapped)
    train(ddp, opt, comm.rank, range(6))
    straight = digest(model)

    model, ddp, opt = bn_model(wrapped)
    train(ddp, opt, comm.rank, range(3))
    stats_differ = comm.allgather(model[1].running_mean.sum().item())
    mgr = CheckpointManager(root, comm=comm)
    mgr.save(3, {"model": ddp if wrapped else model, "optimizer": opt})
    mgr.close()

    model, ddp, opt = bn_model(wrapped)
    mgr = CheckpointManager(root, comm=comm)
    mgr.load_latest({"model": ddp if wrapped else model, "optimizer": opt})
    mgr.close()
    train(ddp, opt, comm.rank, range(3, 6))
    m = cat.read_step(root, 3)
    writers = sorted({s["rank"] for s in m["shards"] if s["dataset"].endswith("running_mean")})
    return {"straight": comm.allgather(straight), "resumed": comm.allgather(digest(model)),
            "stats_at_save": stats_differ, "running_mean_written_by": writers,
            "names": sorted(t["name"] for t in m["tensors"] if t["name"].startswith("replicated/model/"))}


def moments(comm: Comm, root: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)                       # equal parameters on both ranks
    opt = torch.optim.Adam(model.parameters(), lr=0.0)  # they stay equal; the moments do not
    x, y = batch(comm.rank, 0)
    F.mse_loss(model(x[:, :8]), y).backward()           # no DDP: each rank's own gradient
    opt.step()
    mgr = CheckpointManager(root, comm=comm)
    out: dict = {}
    try:
        mgr.save(1, {"model": model, "optimizer": opt})
        out["saved"] = True
    except CheckpointError as exc:
        out.update(saved=False, message=exc.message, hint=exc.hint)
    out["steps_after_refusal"] = [c.step for c in mgr.list()]
    # Made equal (rank 0's moments everywhere), the same manager saves.
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                torch.distributed.broadcast(v, 0)
    mgr.save(1, {"model": model, "optimizer": opt})
    out["steps_after_fix"] = [c.step for c in mgr.list()]
    mgr.close()
    return out


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    coci_hpc.init_distributed()
    comm = Comm.world()
    out = bn(comm, root, mode == "bn_wrapped") if mode.startswith("bn") else moments(comm, root)
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
