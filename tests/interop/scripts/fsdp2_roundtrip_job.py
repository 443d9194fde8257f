"""Run under mpiexec: an FSDP2 checkpoint out to other formats and back into other layouts.

    fsdp2_roundtrip_job.py save ROOT REF
        2 ranks: a model wrapped with fully_shard on a CPU mesh (gloo), rows that do not split
        evenly over the ranks (63 = 32 + 31), buffers of other dtypes, two Adam steps; saved with
        CheckpointManager at step 2. Rank 0 writes REF (safetensors): the full tensors of the
        model as the FSDP2 model holds them (``full_tensor()``), and of Adam's moments under
        ``optimizer.<fqn>.<exp_avg|exp_avg_sq>``: the reference every check compares with.
    fsdp2_roundtrip_job.py load REF COCI HF TORCH DCP
        1 or 2 ranks: every source loaded into a DDP replica and into a fresh FSDP2 model (its
        full tensors and each rank's local rows compared with REF); then DCP's own ``dcp.load``
        through CociStorageReader straight from the FSDP2 checkpoint into an FSDP2 and a DDP state.

Prints one ``ok ...`` line per check and rank.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.interop.dcp_reader import CociStorageReader
from coci_hpc.interop.pretrained import load_pretrained
from coci_hpc.runtime.distributed import init_distributed
from tests.checkpoint.helpers import Net
from tests.interop.helpers import same_bits

HIDDEN = 63   # fc1 has 63 rows: FSDP2 gives rank 0 32 of them and rank 1 31
STEP = 2


def fresh(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(h=HIDDEN)


def fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def save(root: Path, ref_file: Path) -> None:
    model = fsdp2(fresh(7))
    with torch.no_grad():   # buffers (not sharded by FSDP2) with values a fresh model does not have
        model.bf16.copy_(torch.randn(3, 5).to(torch.bfloat16))
        model.mask.copy_(torch.rand(7) > 0.5)
        model.count.fill_(41)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3 + dist.get_rank())   # each rank its own batch
    for _ in range(STEP):
        opt.zero_grad()
        model(torch.randn(8, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
    w = model.fc1.weight
    assert isinstance(w, DTensor) and w.to_local().shape[0] == (32, 31)[dist.get_rank()], w.to_local().shape
    mgr = CheckpointManager(root)
    mgr.save(STEP, {"model": model, "optimizer": opt})
    mgr.close()
    ref = {}
    for k, v in model.state_dict().items():   # full_tensor() is collective: every rank calls it
        ref[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            ref[f"optimizer.{names[p]}.{k}"] = st[k].full_tensor().detach().clone()
    if dist.get_rank() == 0:
        save_file(ref, str(ref_file))
    print(f"ok save rank {dist.get_rank()}", flush=True)


def check_plain(model: torch.nn.Module, ref: dict[str, torch.Tensor], what: str) -> None:
    sd = model.state_dict()
    assert len(sd) == 7, sorted(sd)
    for k, v in sd.items():
        assert same_bits(v, ref[k.removeprefix("module.")]), f"{what}: {k} differs"
    print(f"ok {what} rank {dist.get_rank()}", flush=True)


def check_sharded(model: torch.nn.Module, ref: dict[str, torch.Tensor], what: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    n_dt = 0
    for k, v in model.state_dict().items():
        if isinstance(v, DTensor):
            n_dt += 1
            assert same_bits(v.full_tensor(), ref[k]), f"{what}: {k} differs"
            rows = torch.chunk(ref[k], world, dim=0)   # FSDP2's split: this rank holds only these
            assert same_bits(v.to_local(), rows[rank]), f"{what}: {k}: local shard is not rank's rows"
        else:
            assert same_bits(v, ref[k]), f"{what}: buffer {k} differs"
    assert n_dt == 4, n_dt
    print(f"ok {what} rank {rank}", flush=True)


def load(ref_file: Path, sources: dict[str, Path]) -> None:
    ref = load_file(str(ref_file))
    seed = 1234 + dist.get_rank()   # different from the saved model and between ranks
    for what, src in sources.items():
        ddp = DDP(fresh(seed))
        load_pretrained(src, ddp)
        check_plain(ddp, ref, f"ddp<-{what}")
        model = fsdp2(fresh(seed))
        load_pretrained(src, model)
        check_sharded(model, ref, f"fsdp2<-{what}")

    # DCP's own planner over the FSDP2 checkpoint: each rank asks for its box (FSDP2) or all (DDP)
    model = fsdp2(fresh(seed))
    sd = model.state_dict()
    dcp.load(sd, storage_reader=CociStorageReader(sources["coci"]))
    check_sharded(model, ref, "fsdp2<-dcp.load(CociStorageReader)")
    ddp = DDP(fresh(seed))
    plain = ddp.module.state_dict()
    dcp.load(plain, storage_reader=CociStorageReader(sources["coci"]))
    ddp.module.load_state_dict(plain)
    check_plain(ddp, ref, "ddp<-dcp.load(CociStorageReader)")


def main() -> None:
    init_distributed("gloo")
    if sys.argv[1] == "save":
        save(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        ref_file, *paths = (Path(a) for a in sys.argv[2:7])
        load(ref_file, dict(zip(("coci", "hf", "torch", "dcp"), paths)))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
