"""A PyTorch Lightning script with coci_hpc: the toy regression task of examples/train.py as a
LightningModule, DDP on the CPU (gloo), and the two coci lines in ``Trainer(...)``; with
``--strategy fsdp2`` the model is sharded with FSDP2 (``fully_shard`` in ``configure_model``)
under ``CociModelParallelStrategy``, its parameters and Adam moments DTensors split over the ranks.

    python examples/lightning_train.py --steps 300 --ckpt-dir /tmp/run
    mpiexec -n 2 python -m mpi4py examples/lightning_train.py --steps 300 --ckpt-dir /tmp/run --policy fixed:50
    mpiexec -n 2 python -m mpi4py examples/lightning_train.py --strategy fsdp2 --steps 300 --ckpt-dir /tmp/run-fsdp
    coci-submit --partition gpu --nodes 2 --time 10 examples/lightning_train.py --steps 300

Killed or preempted and started again with the same arguments, ``trainer.fit()`` resumes from the
checkpoint directory by itself (no ``ckpt_path``) and ends with the parameters of an uninterrupted
run: rank 0 prints ``step=<n> loss=<value>`` per optimizer step and ``final_params_sha256=<hex>`` at
the end (of the full parameters: an FSDP2 run's shards are gathered for it). ``--step-time S`` adds S seconds of pretend work per step.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as L  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from toy_task import make_data, params_sha256  # noqa: E402

from coci_hpc.integrations.lightning import CociCallback, CociCheckpointIO, cluster_layout  # noqa: E402
from coci_hpc.integrations.lightning_model_parallel import CociModelParallelStrategy  # noqa: E402

D_IN, HIDDEN, SAMPLES, BATCH = 16, 64, 2048, 32


class Regressor(L.LightningModule):
    def __init__(self, step_time: float = 0.0, fsdp2: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(HIDDEN, 1))
        self.step_time, self.fsdp2 = step_time, fsdp2

    def configure_model(self) -> None:
        if self.fsdp2:              # ModelParallelStrategy: shard each layer, then the whole net
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.step_time:
            time.sleep(self.step_time)
        if self.trainer.is_global_zero:     # the step this batch completes (global_step counts done steps)
            print(f"step={self.trainer.global_step + 1} loss={loss.item():.6f}", flush=True)
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.Adam(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, required=True, help="train until this many optimizer steps are done")
    ap.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: $COCI_CKPT_DIR)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default=None, help="checkpoint policy (default: $COCI_POLICY or coci)")
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of pretend extra work per step")
    ap.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp",
                    help="ddp (one rank: single device), or fsdp2: CociModelParallelStrategy over all ranks")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    layout = cluster_layout()                    # num_nodes, devices: from srun / mpiexec / coci-submit
    torch.manual_seed(args.seed)                 # same initial weights on every rank
    model = Regressor(args.step_time, fsdp2=args.strategy == "fsdp2")
    x, y = make_data(SAMPLES, D_IN)
    # StatefulDataLoader: Lightning saves its position with the loop, so a stop mid-epoch resumes
    # at the next batch. Under DDP CociCallback has Lightning inject a DistributedSampler that saves
    # its epoch (the order comes from the epoch, not from this loader's own generator).
    loader = StatefulDataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    world = layout["num_nodes"] * layout["devices"]
    # FSDP2 over all ranks, however they were launched (Lightning's "auto" would make the mesh
    # nodes x devices per node: tensor parallel inside a node)
    strategy = CociModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1) \
        if args.strategy == "fsdp2" else "ddp" if world > 1 else "auto"
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", strategy=strategy,
                        **layout, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0,
                        plugins=[CociCheckpointIO()],                                       # coci line 1
                        callbacks=[CociCallback(ckpt_dir=args.ckpt_dir, policy=args.policy)])  # coci line 2
    torch.manual_seed(args.seed * 1000 + 1 + trainer.global_rank)   # per-rank dropout streams
    trainer.fit(model, loader)

    digest = params_sha256(model)
    if trainer.is_global_zero:
        print(f"final_params_sha256={digest}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
