"""Run under mpiexec (1 or 2 ranks): load exported weights into a DDP replica and into an FSDP2
model (fully_shard on a CPU mesh, gloo), from safetensors, DCP, a torch.save file and straight
from the coci checkpoint (init_from and CociStorageReader); every tensor bit-identical to the
source weights; an FSDP2 rank holds only its slice. Prints one "ok ..." line per check.

    python pretrained_job.py HF_DIR DCP_DIR TORCH_FILE COCI_ROOT
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from coci_hpc.interop.dcp_reader import CociStorageReader
from coci_hpc.interop.pretrained import load_pretrained
from coci_hpc.runtime.distributed import init_distributed
from tests.checkpoint.helpers import Net
from tests.interop.helpers import same_bits


def fresh() -> Net:
    torch.manual_seed(1234 + dist.get_rank())   # different from the source and between ranks
    net = Net()
    with torch.no_grad():
        for b in net.buffers():
            b.zero_()
    return net


def check_plain(model: torch.nn.Module, ref: dict[str, torch.Tensor], what: str) -> None:
    sd = model.state_dict()
    for k, v in sd.items():
        name = k.removeprefix("module.")
        assert same_bits(v, ref[name]), f"{what}: {k} differs"
    print(f"ok {what} rank {dist.get_rank()}", flush=True)


def check_sharded(model: torch.nn.Module, ref: dict[str, torch.Tensor], what: str) -> None:
    n_dt = 0
    for k, v in model.state_dict().items():
        if isinstance(v, DTensor):
            n_dt += 1
            full = v.full_tensor()
            assert same_bits(full, ref[k]), f"{what}: {k} differs"
            rows = torch.chunk(ref[k], dist.get_world_size(), dim=0)
            mine = rows[dist.get_rank()] if dist.get_rank() < len(rows) else ref[k][:0]
            assert same_bits(v.to_local(), mine), f"{what}: {k}: local shard is not rank's rows"
        else:
            assert same_bits(v, ref[k]), f"{what}: buffer {k} differs"
    assert n_dt == 4, n_dt
    print(f"ok {what} rank {dist.get_rank()}", flush=True)


def fsdp2() -> torch.nn.Module:
    model = fresh()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    hf, dcp_dir, torch_file, coci = (Path(a) for a in sys.argv[1:5])
    init_distributed("gloo")
    ref = load_file(hf / "model.safetensors") if (hf / "model.safetensors").exists() else {
        k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}

    for src, what in ((hf, "hf"), (dcp_dir, "dcp"), (torch_file, "torch"), (coci, "coci")):
        ddp = DDP(fresh())
        load_pretrained(src, ddp)
        check_plain(ddp, ref, f"ddp<-{what}")
        model = fsdp2()
        load_pretrained(src, model)
        check_sharded(model, ref, f"fsdp2<-{what}")

    model = fsdp2()   # DCP's own planner through our StorageReader: each rank asks for its box
    sd = model.state_dict()
    dcp.load(sd, storage_reader=CociStorageReader(coci))
    check_sharded(model, ref, "fsdp2<-dcp.load(CociStorageReader)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
