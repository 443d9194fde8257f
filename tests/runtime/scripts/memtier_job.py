"""Subprocess driver for the memory-tier tests (``mpiexec -n N``, FSDP2 on a CPU mesh, gloo).

    memtier_job.py copy DIR K STEPS             train STEPS steps with the tier every K steps
    memtier_job.py recover DIR K STEPS LOST     ... then ranks LOST (comma list) "die": the others
                                                run the survivors' save from the memory tier; every
                                                rank loads the result into a fresh model

RESULT (rank 0, one JSON line): per rank what it checked (see the tests in test_memtier.py).
Ranks per node for the partner choice: MEMTIER_JOB_RPN (default 1: every rank its own node).
MEMTIER_JOB_MESH=hsdp: HSDP (2-D mesh, replicate x shard) instead of FSDP2 on a 1-D mesh.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

from coci_hpc import init_distributed
from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint.lustre import LustrePolicy, tuning_for
from coci_hpc.checkpoint.state import collect
from coci_hpc.comm import Comm
from coci_hpc.runtime import memtier


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(10, 7)   # 7 rows: uneven FSDP2 chunks over 2 or 4 ranks
        self.fc2 = torch.nn.Linear(7, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def build(world: int) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP()
    if os.environ.get("MEMTIER_JOB_MESH") == "hsdp":  # 2-D: replicate x shard, 2 x (world / 2)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def step_once(model: Any, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    opt.zero_grad()
    model(torch.randn(4, 10, generator=gen)).pow(2).mean().backward()
    opt.step()


def digest(t: Any) -> str:
    t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:16]


def hashes(model: Any, opt: torch.optim.Optimizer) -> dict[str, str]:
    out = {f"model/{k}": digest(v) for k, v in model.state_dict().items()}
    for idx, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{idx}/{k}"] = digest(v)
    return out


def local_bytes(state: dict[str, Any]) -> dict[str, str]:
    """This rank's DTensor local shards now, by leaf name (sha256 of the raw bytes)."""
    return {l.name: hashlib.sha256(l.array.view(np.uint8).tobytes()).hexdigest()[:16]
            for l in collect(state, rng=False)[1] if l.kind == "dtensor" and l.array is not None}


def slot_bytes(slot: memtier.Slot) -> dict[str, str]:
    return {l.name: hashlib.sha256(l.array.view(np.uint8).tobytes()).hexdigest()[:16]
            for l in slot.snapshot().leaves if l.kind == "dtensor" and l.array is not None}


def settle(tier: memtier.MemoryTier, comm: Comm, want: int) -> None:
    """Let the exchange of step ``want`` finish on every rank (a test's quiet moment). Every rank
    decides from the same gathered values, so all of them leave together: a rank that left alone
    would leave the others waiting in the next collective for it."""
    sent = comm.allgather(max(s.step for s in tier.own) == want)
    if not all(sent):           # skipped (the last copy still in flight): it will never arrive
        raise SystemExit(f"rank {comm.rank}: the copy of step {want} was never sent by rank(s) "
                         f"{[r for r, ok in enumerate(sent) if not ok]} (skipped: the copy before it was "
                         f"still in flight)")
    end = time.monotonic() + 30
    while True:
        tier.poll()
        done = tier._send_req is None and tier.complete is not None and tier.complete.step == want
        states = comm.allgather((done, time.monotonic() > end))
        if all(d for d, _ in states):
            return
        if any(late for _, late in states):
            raise SystemExit(f"rank {comm.rank}: the exchange of step {want} did not finish in 30 s on "
                             f"rank(s) {[r for r, (d, _) in enumerate(states) if not d]}")
        time.sleep(0.01)


def main() -> int:
    mode, root, k, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    comm = Comm.world()
    init_distributed(comm=comm)
    rank, world = dist.get_rank(), dist.get_world_size()
    rpn = int(os.environ.get("MEMTIER_JOB_RPN", "1"))
    model, opt = build(world)
    state = {"model": model, "optimizer": opt}
    tier = memtier.MemoryTier(lambda: state, comm.mpi_comm.Dup(), rpn, k)
    result: dict[str, Any] = {"rank": rank, "partner": tier.partner, "source": tier.source}
    if mode == "plan":          # rank 0's plan (here: k = 3) reaches every rank, applied at one step
        memtier.REPLAN_EVERY = 4
        tier.plan_fn = lambda copy_s: (3, 50) if copy_s else None
        switched, copies = [], []
        for s in range(1, steps + 1):
            step_once(model, opt, s)
            tier.boundary(s)
            switched.append(tier.every)
            copies.append(tier.copies)
        result["every"] = switched
        result["copies"] = copies
        gathered = comm.gather(result)
        if rank == 0:
            print("RESULT " + json.dumps(gathered), flush=True)
        return 0
    at_step: dict[int, dict[str, str]] = {}        # own local shards at each memory-tier step
    full_at: dict[int, dict[str, str]] = {}        # full tensors (gathered) at each memory-tier step
    allocs: list[int] = []
    addrs: list[list[int]] = []
    seen: list[int] = []                           # the step of the source's copy held after each boundary
    for s in range(1, steps + 1):
        step_once(model, opt, s)
        tier.boundary(s)
        seen.append(-1 if tier.complete is None else tier.complete.step)
        if s % k == 0:
            at_step[s] = local_bytes(state)
        full_at[s] = hashes(model, opt)
        if mode == "recover" and s == 1:       # the disk tier's checkpoint
            CheckpointManager(root, comm=comm, keep=3).save(1, state)
        allocs.append(tier.allocations())
        addrs.append([sl.buf.ctypes.data for sl in (*tier.own, *tier.recv)])
    last = steps - steps % k
    settle(tier, comm, last)
    assert tier.complete is not None
    result["complete_step"] = tier.complete.step
    result["complete_rank"] = tier.complete.rank
    result["received"] = slot_bytes(tier.complete)
    result["own_at_last"] = at_step[last]
    result["allocs"] = allocs
    # after the first two copies (the second allocates the other slot), nothing new is allocated
    # after the first two copies each way (both slots of each side exist), nothing is allocated
    result["addrs_stable"] = all(a == addrs[2 * k + 1] for a in addrs[2 * k + 1:]) if steps > 2 * k + 1 else None
    result["skipped"] = tier.skipped
    result["seen"] = seen
    if mode == "recover":
        lost = [int(x) for x in sys.argv[5].split(",")]
        # The "lost" ranks stop taking part (their memory is gone); the survivors train one more
        # step (a partial step: the failure surfaces in its agreement), then save from the tier.
        tuning = tuning_for(root, LustrePolicy(), world)
        if rank not in lost:
            # The window a survivor waits for the others' staged copies: a live rank not staged by
            # its end is taken for lost (its state then comes from its partner). 3 s was too short
            # for 4 ranks on 2 loaded cores (CI 2026-11-29: rank 3 counted lost beside rank 1).
            out = memtier.survivors_save(root, steps, tier, tuning, keep=3, window_s=8.0)
            result["outcome"] = {"writer": out.writer, "committed": out.committed, "tier": out.tier,
                                 "step": out.step, "from_partner": out.ranks_from_partner, "reason": out.reason,
                                 "lost": out.lost}
        comm.barrier()          # the test's stand-in for the relaunch: everyone back
        model2, opt2 = build(world)
        state2 = {"model": model2, "optimizer": opt2}
        mgr = CheckpointManager(root, comm=comm, keep=3)
        res = mgr.load_latest(state2)
        result["loaded_step"] = None if res is None else res.step
        result["loaded"] = hashes(model2, opt2)
        result["expected"] = full_at.get(res.step) if res is not None else None
        if res is not None and res.step + 1 in full_at:  # the loaded state trains on as the run did
            step_once(model2, opt2, res.step + 1)
            result["resumed"] = hashes(model2, opt2) == full_at[res.step + 1]
    gathered = comm.gather(result)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
