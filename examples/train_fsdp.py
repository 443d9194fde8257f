"""examples/train.py with FSDP2 instead of DDP: the model's parameters and Adam's moments are
DTensors sharded over the ranks (``torch.distributed.fsdp.fully_shard``), and the script uses the
same four session lines. Each rank saves only its own shards; the checkpoint loads on any number
of ranks.

    python examples/train_fsdp.py --steps 300 --ckpt-dir /tmp/run-fsdp
    mpiexec -n 2 python -m mpi4py examples/train_fsdp.py --steps 300 --ckpt-dir /tmp/run-fsdp --policy fixed:50
    srun --mpi=pmix python examples/train_fsdp.py ...      (or: coci-submit ... examples/train_fsdp.py ...)

Killed and started again with the same arguments it resumes from its checkpoint directory; rank 0
prints ``step=<n> loss=<value>`` per step and ``final_params_sha256=<hex>`` (of the full,
gathered parameters) at the end. On a lost rank a survivors' save cannot rebuild that rank's
shards: the run falls back to its last checkpoint (docs/how-to/fsdp.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toy_task import make_data, params_sha256  # noqa: E402

import coci_hpc  # noqa: E402
from coci_hpc.runtime.data import ResumableSampler  # noqa: E402

D_IN, HIDDEN, SAMPLES, BATCH = 16, 64, 2048, 32


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, required=True, help="train until this many steps are done")
    ap.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: $COCI_CKPT_DIR)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default=None,
                    help="checkpoint policy: coci, young, daly, checkfreq, fixed:N (default: $COCI_POLICY or coci)")
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of pretend extra work per step")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist = coci_hpc.init_distributed()          # gloo here, NCCL on GPUs; from MPI or Slurm's env
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.backend else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.world_size,))
    torch.manual_seed(args.seed)                # same initial weights on every rank, before sharding
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(HIDDEN, 1)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)               # parameters are now DTensors, Shard(0) over the ranks
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)   # its moments are DTensors like the parameters
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.7)
    torch.manual_seed(args.seed * 1000 + 1 + dist.rank)   # per-rank dropout streams
    x, y = (t.to(device) for t in make_data(SAMPLES, D_IN))
    sampler = ResumableSampler(SAMPLES, seed=args.seed, rank=dist.rank, world_size=dist.world_size)

    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": sampler}
    session = coci_hpc.Session(state, total_steps=args.steps, ckpt_dir=args.ckpt_dir, policy=args.policy)
    for step in session.steps():
        idx = torch.from_numpy(sampler.next_batch(BATCH)).to(device)
        loss = F.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()                         # FSDP2 reduce-scatters the gradients
        opt.step()
        sched.step()
        if args.step_time:
            time.sleep(args.step_time)
        session.observe(loss.detach())
        if dist.rank == 0:
            print(f"step={step + 1} loss={loss.item():.6f}", flush=True)

    digest = params_sha256(model)
    if dist.rank == 0:
        print(f"final_params_sha256={digest}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
