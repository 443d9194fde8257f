"""What a user's training script looks like with coci_hpc: a small deterministic model, DDP over
1 or more ranks, and the four session lines.

    python examples/train.py --steps 300 --ckpt-dir /tmp/run --seed 0
    mpiexec -n 2 python -m mpi4py examples/train.py --steps 300 --ckpt-dir /tmp/run --policy fixed:50
    srun --mpi=pmix python examples/train.py ...          (or through coci-submit / slurm/templates)

Killed and started again with the same arguments, it resumes from its checkpoint directory and
ends with the same parameters as an uninterrupted run: rank 0 prints ``step=<n> loss=<value>`` per
step and ``final_params_sha256=<hex>`` at the end. Without --ckpt-dir / --policy the values come
from coci-submit's environment (COCI_CKPT_DIR, COCI_POLICY); given here, they win.
``--step-time S`` adds S seconds of pretend work per step (a realistic step time for benchmarks
and tests; it does not change the numbers).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# Run from a checkout: the repository (coci_hpc) and this folder (toy_task, the examples' shared
# task; also when coci-submit runs the script with runpy, which adds no folder to sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toy_task import make_data, params_sha256  # noqa: E402

import coci_hpc  # noqa: E402
from coci_hpc.checkpoint import Sharded  # noqa: E402
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
    ap.add_argument("--sharded-state", action="store_true",
                    help="add a Sharded tensor to the state (an EMA of the first layer's weights, its rows "
                         "split over the ranks, ZeRO-style): such state cannot be rebuilt from the survivors "
                         "of a lost rank, so a peer failure falls back to the last regular checkpoint")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist = coci_hpc.init_distributed()          # gloo here, NCCL on GPUs; from MPI or Slurm's env
    # NCCL (chosen when CUDA is there) needs the model on this rank's GPU; gloo trains on the CPU.
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.backend else torch.device("cpu")
    torch.manual_seed(args.seed)                # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(HIDDEN, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.7)
    torch.manual_seed(args.seed * 1000 + 1 + dist.rank)   # per-rank dropout streams (CUDA's too)
    x, y = (t.to(device) for t in make_data(SAMPLES, D_IN))
    sampler = ResumableSampler(SAMPLES, seed=args.seed, rank=dist.rank, world_size=dist.world_size)

    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": sampler}
    rows = slice(dist.rank * HIDDEN // dist.world_size, (dist.rank + 1) * HIDDEN // dist.world_size)
    if args.sharded_state:
        state["weight_ema"] = Sharded(model[0].weight.detach()[rows].clone())
    session = coci_hpc.Session(state, total_steps=args.steps, ckpt_dir=args.ckpt_dir, policy=args.policy)
    for step in session.steps():
        idx = torch.from_numpy(sampler.next_batch(BATCH)).to(device)
        loss = F.mse_loss(ddp(x[idx]), y[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        sched.step()
        if args.sharded_state:              # does not touch the model: the final hash stays the same
            state["weight_ema"].local.mul_(0.99).add_(model[0].weight.detach()[rows], alpha=0.01)
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
