"""A training script whose data comes through DataLoader worker processes, forked AND spawned,
made preemption-safe by coci_hpc (see docs/how-to/dataloader-workers.md).

    python examples/train_workers.py --steps 60 --ckpt-dir /tmp/run
    sbatch slurm/templates/train_preemptible.sbatch python examples/train_workers.py --steps 60 --ckpt-dir DIR
    coci-submit --nodes 1 examples/train_workers.py -- --steps 60

Each step trains on one batch of a ``fork`` loader and one of a ``spawn`` loader (torchdata's
``StatefulDataLoader``, 2 workers each, in the Session's state: a restart resumes at the batch the
loop consumed, not at the ones the workers had prefetched). A plain ``DataLoader`` with fork
workers is iterated before ``Session()`` (a validation pass whose workers stay alive): Slurm's
signals reach those workers too. Interrupted (stop signal, then the same command again) it ends
with ``final_params_sha256=`` of an uninterrupted run.

For bit-exact resumption each loader has a generator of its own for its sampler and another for
its workers' seed: a loader that shares one generator between the two, or draws from the global
RNG, resumes at the right batch but shuffles the following epochs differently.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset

# Run from a checkout: the repository (coci_hpc) and this folder (toy_task, the examples' shared
# task; also when coci-submit runs the script with runpy, which adds no folder to sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toy_task import params_sha256  # noqa: E402

import coci_hpc  # noqa: E402  (first: workers started from here on are deaf to Slurm's signals)

D_IN, HIDDEN, SAMPLES, BATCH = 8, 32, 192, 12


class Regression(Dataset):
    """A fixed synthetic task; an item depends on its index only (no RNG in the workers)."""

    def __init__(self, n: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, D_IN, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(D_IN, 1, generator=g))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def loader(data: Dataset, context: str, seed: int, workers: int):
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler
    return StatefulDataLoader(data, batch_size=BATCH, num_workers=workers, multiprocessing_context=context,
                              sampler=RandomSampler(data, generator=torch.Generator().manual_seed(seed)),
                              generator=torch.Generator().manual_seed(seed + 1))


def forever(dl):
    # Started lazily (at the first next(), after the Session restored the loader's position).
    while True:
        yield from dl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: $COCI_CKPT_DIR)")
    ap.add_argument("--policy", default="fixed:10")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of pretend extra work per step")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist = coci_hpc.init_distributed()
    data = Regression()
    mine = Subset(data, range(dist.rank, len(data), dist.world_size))
    # A validation pass before training, through a plain DataLoader with forked workers that stay
    # alive (its iterator is kept): they exist before Session() installs any handler.
    val = iter(DataLoader(data, batch_size=64, num_workers=args.workers, multiprocessing_context="fork"))
    val_x, _ = next(val)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(HIDDEN, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(args.seed * 1000 + 1 + dist.rank)   # per-rank dropout streams
    forked = loader(mine, "fork", args.seed * 10 + 1, args.workers)
    spawned = loader(mine, "spawn", args.seed * 10 + 3, args.workers)
    session = coci_hpc.Session({"model": model, "optimizer": opt, "forked": forked, "spawned": spawned},
                               total_steps=args.steps, ckpt_dir=args.ckpt_dir, policy=args.policy)
    for step, (xa, ya), (xb, yb) in zip(session.steps(), forever(forked), forever(spawned)):
        loss = F.mse_loss(ddp(torch.cat([xa, xb])), torch.cat([ya, yb]))
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        session.observe(loss.detach())
        if dist.rank == 0:
            print(f"step={step + 1} loss={loss.item():.6f}", flush=True)
    del val, val_x
    if dist.rank == 0:
        print(f"final_params_sha256={params_sha256(model)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
