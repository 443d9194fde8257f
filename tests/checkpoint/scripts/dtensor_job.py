"""Subprocess driver for the DTensor (FSDP2 / tensor parallel / HSDP) checkpoint tests.

Run under ``mpiexec -n N``; torch.distributed (gloo, CPU) comes up through coci's
``init_distributed``. Layouts of the same small model (uneven dims: 7 rows do not split evenly
over 2, 3 or 4 ranks):

    fsdp      fully_shard on a 1-D mesh over every rank (Shard(0), uneven chunks)
    hsdp      fully_shard on a 2-D mesh (replicate x shard), 2 x (N / 2)
    tp        parallelize_module: fc1 ColwiseParallel (Shard(0)), fc2 RowwiseParallel (Shard(1))
    plain     no wrapping (every rank holds everything, replicated)
    plain-rev no wrapping, Adam built over the parameters in reverse order (another wrapping's
              order: the optimizer state is keyed by parameter name, not position)
    sharded   a plain dict of the model's tensors, fc1.weight as Sharded(rows of this rank)

    dtensor_job.py save DIR LAYOUT STEP     train STEP Adam steps, save at STEP; print RESULT
    dtensor_job.py load DIR LAYOUT          fresh model + optimizer, load_latest; print RESULT
    dtensor_job.py bad DIR CASE             one bad input; print ERROR type + message
    dtensor_job.py asave DIR                save_async an FSDP2 state at step 1, train on; print RESULT
    dtensor_job.py cache DIR                cached layout of an unchanged state, a shape change
    dtensor_job.py live DIR                 loads into a live FSDP2 optimizer: a damaged step, then a good one

RESULT (rank 0): sha256 of every full tensor (gathered with full_tensor()), the loaded step,
and per rank the bytes the load read into its own state against the bytes that state holds.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from coci_hpc import init_distributed
from coci_hpc.checkpoint import CheckpointManager, Sharded
from coci_hpc.checkpoint.state import collect
from coci_hpc.comm import Comm
from coci_hpc.errors import CociError


class MLP(torch.nn.Module):
    def __init__(self, rows: int = 7) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(10, rows)
        self.fc2 = torch.nn.Linear(rows, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def build(layout: str, world: int, rows: int = 7) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP(rows)
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model.fc2, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model.fc2, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    elif layout not in ("plain", "plain-rev", "sharded"):
        raise SystemExit(f"unknown layout {layout}")
    params = list(model.parameters())
    return model, torch.optim.Adam(params[::-1] if layout == "plain-rev" else params, lr=1e-2)


def train(model: Any, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 10, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()


def full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def digest(t: Any) -> str:
    t = full(t).detach().contiguous()
    flat = t.reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:16] + \
        f"{list(t.shape)}{t.dtype}"


def hashes(model: Any, opt: torch.optim.Optimizer) -> dict[str, str]:
    """Every full tensor of the model and of the optimizer's state, the latter keyed by the
    parameter's name (so layouts whose optimizers order the parameters differently compare)."""
    out = {f"model/{k}": digest(v) for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{name}/{k}"] = digest(v)
    return out


def placements(model: Any, opt: torch.optim.Optimizer) -> dict[str, str]:
    out = {}
    for i, p in model.named_parameters():
        st = opt.state.get(p, {})
        for k, v in st.items():
            if k != "step":
                same = isinstance(v, DTensor) == isinstance(p, DTensor) and \
                    (not isinstance(p, DTensor) or (v.placements == p.placements and v.device_mesh == p.device_mesh))
                out[f"opt/{i}/{k}"] = "same" if same else f"{type(v).__name__} vs {type(p).__name__}"
    return out


def sharded_dict(model: Any, rank: int, world: int) -> dict[str, Any]:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    w = sd["fc1.weight"]
    chunks = torch.tensor_split(w, world, dim=0)
    sd["fc1.weight"] = Sharded(chunks[rank].contiguous())
    return sd


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    comm = Comm.world()
    init_distributed(comm=comm)
    rank, world = dist.get_rank(), dist.get_world_size()
    mgr = CheckpointManager(root, comm=comm, keep=5)
    result: dict[str, Any] = {"world": world}
    if mode == "save":
        layout, step = sys.argv[3], int(sys.argv[4])
        model, opt = build(layout, world)
        train(model, opt, step)
        if layout == "sharded":
            mgr.save(step, {"model": sharded_dict(model, rank, world)})
            result["hashes"] = {f"model/{k}": digest(v) for k, v in model.state_dict().items()}
        else:
            mgr.save(step, {"model": model, "optimizer": opt})
            result["hashes"] = hashes(model, opt)
            train(model, opt, 1)  # the continuation a loaded state must reproduce
            result["next"] = hashes(model, opt)
        result["step"] = step
    elif mode == "asave":  # the two-phase save: snapshot, training goes on, persist in the background
        model, opt = build("fsdp", world)
        train(model, opt, 1)
        result["hashes"] = hashes(model, opt)
        mgr.save_async(1, {"model": model, "optimizer": opt})
        train(model, opt, 1)  # its optimizer step waits for the snapshot, then changes the state
        mgr.wait()
        result["step"] = 1
        result["changed"] = hashes(model, opt) != result["hashes"]
    elif mode == "load":
        layout = sys.argv[3]
        model, opt = build(layout, world)
        state = {"model": model, "optimizer": opt} if len(sys.argv) < 5 else {"model": model}
        res = mgr.load_latest(state)
        result["step"] = res.step
        result["hashes"] = hashes(model, opt)
        result["placements"] = placements(model, opt)
        # the RNG states are per rank (read where this rank saved one): counted apart
        held = sum(l.nbytes for l in collect(state, rng=False)[1])
        rng = sum(p[3] for t in res.manifest["tensors"] if t["name"].startswith("per_rank/__rng__")
                  for p in t.get("parts", ()) if p[0] == rank)
        result["read"] = comm.gather((res.read_bytes - rng, held))
        # The loaded state trains on: one step, compared with the saver's. Not under tensor
        # parallel: torch's own forward fails on its uneven (7-row) shards before any load matters.
        if len(sys.argv) < 5 and layout != "tp":
            train(model, opt, 1)
            result["next"] = hashes(model, opt)
    elif mode == "bad":
        case = sys.argv[3]
        mesh = init_device_mesh("cpu", (world,))
        try:
            if case == "partial":
                dt = DTensor.from_local(torch.ones(4), mesh, [Partial()])
                mgr.save(1, {"extras": {"w": dt}})
            elif case == "subclass":
                class Odd(torch.Tensor):
                    pass
                mgr.save(1, {"extras": {"w": torch.ones(3).as_subclass(Odd)}})
            elif case == "mesh":
                from torch.distributed.device_mesh import DeviceMesh
                small = DeviceMesh("cpu", [0])  # a mesh of rank 0 alone, in a job of `world`
                mgr.save(1, {"extras": {"w": distribute_tensor(torch.ones(4, 2), small, [Shard(0)])}})
            elif case == "replica":  # HSDP 2 x 2: rank 2 holds a replica of rank 0's shard
                model, opt = build("hsdp", world)
                train(model, opt, 1)
                if rank == 2:
                    with torch.no_grad():
                        model.fc1.weight.to_local().view(-1)[3] += 1.0
                mgr.save(1, {"model": model, "optimizer": opt})
            elif case == "shape":
                model, opt = build("fsdp", world)
                train(model, opt, 1)
                mgr.save(1, {"model": model, "optimizer": opt})
                model2, opt2 = build("fsdp", world, rows=8)
                mgr.load(1, {"model": model2, "optimizer": opt2})
            result["error"] = None
        except CociError as exc:
            result["error"] = [type(exc).__name__, str(exc)]
        result["latest"] = mgr.latest_step()
    elif mode == "cache":
        model, opt = build("fsdp", world)
        train(model, opt, 1)
        sources = []
        for step in (1, 2, 3):
            mgr.save(step, {"model": model, "optimizer": opt})
            sources.append(mgr._layouts.last.get("source"))
        model2, opt2 = build("fsdp", world, rows=9)  # a shape change
        train(model2, opt2, 1)
        mgr.save(4, {"model": model2, "optimizer": opt2})
        sources.append(mgr._layouts.last.get("source"))
        result["sources"] = sources
        model3, opt3 = build("fsdp", world, rows=9)
        res = mgr.load_latest({"model": model3, "optimizer": opt3})
        result["step"] = res.step
        result["same"] = hashes(model2, opt2) == hashes(model3, opt3)
    elif mode == "live":
        # a live optimizer (moments on the host), trained past the steps it loads
        from tests.checkpoint.helpers import flip_shard_byte
        model, opt = build("fsdp", world)
        hs = []
        for step in (1, 2):
            train(model, opt, 1)
            mgr.save(step, {"model": model, "optimizer": opt})
            hs.append(hashes(model, opt))
        train(model, opt, 1)
        now = hashes(model, opt)

        def moments() -> list[tuple[int, int]]:
            return [(id(v), v.to_local().data_ptr()) for st in opt.state.values() for k, v in st.items()
                    if k != "step"]

        before = moments()
        if rank == 0:  # one flipped byte in rank 1's shard of a moment of step 2
            flip_shard_byte(Path(root), 2, lambda name: name.endswith("/exp_avg") and "fc1.weight" in name, 1, 3, 0x01)
        comm.barrier()
        try:
            mgr.load(2, {"model": model, "optimizer": opt})
            result["error"] = None
        except CociError as exc:
            result["error"] = type(exc).__name__
        # all or nothing: the live moments are the same tensors, holding what they held
        result["unchanged"] = hashes(model, opt) == now and moments() == before
        res = mgr.load(1, {"model": model, "optimizer": opt})
        result["step"] = res.step
        result["loaded"] = hashes(model, opt) == hs[0]
        result["placements"] = placements(model, opt)
        train(model, opt, 1)
        result["continues"] = hashes(model, opt) == hs[1]
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
