"""A small, real, resumable training run: MLP on synthetic data with Adam, an LR scheduler,
dropout and a shuffled resumable loader, checkpointed with coci_hpc's CheckpointManager.

    python examples/train_resumable.py --steps 200 --ckpt-dir /tmp/run --ckpt-every 50
    mpiexec -n 2 python examples/train_resumable.py --steps 200 --ckpt-dir /tmp/run --ckpt-every 50

It resumes from the latest committed checkpoint in --ckpt-dir automatically, and prints
``PARAM_HASH <sha256>`` of the final parameters (rank 0). With 2+ ranks it is data parallel:
gradients are averaged with an MPI allreduce, each rank reads its own shard of every batch.
``--preemptible`` (inside a Slurm job submitted with ``--signal=USR1@N --requeue``): on the signal
every rank stops at the next step boundary, saves, and rank 0 requeues the job; the requeued job
resumes from that checkpoint. ``--plan POLICY --mtbf-hours H`` lets the COCI planner choose the
checkpoint steps instead of ``--ckpt-every`` (Ts measured by an early checkpoint, Tr across a
requeue). ``--profile-out FILE`` records {"samples": [{"step", "time_s", "loss"}], "ckpt_cost_s",
"restart_cost_s": null, "step_time_s"} for the checkpoint planner.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Run from a checkout: the repository (coci_hpc) and this folder (toy_task, the examples' shared
# task; also when coci-submit runs the script with runpy, which adds no folder to sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toy_task import make_data, params_sha256

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.comm import Comm
from coci_hpc.planner.failures import from_mtbf
from coci_hpc.planner.profile import Profile
from coci_hpc.runtime.data import ResumableSampler
from coci_hpc.runtime.preemption import PreemptionGuard
from coci_hpc.runtime.schedule import CheckpointSchedule


def allreduce_grads(model: torch.nn.Module, comm: Comm) -> None:
    if comm.size == 1:
        return
    from mpi4py import MPI

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.mpi_comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
    flat /= comm.size
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, required=True, help="train until this global step")
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--async", dest="use_async", action="store_true", help="two-phase async saves")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-out", help="write a planner profile JSON here (rank 0)")
    ap.add_argument("--preemptible", action="store_true",
                    help="on Slurm's --signal, save at the next step boundary and requeue this job")
    ap.add_argument("--signal-lead", type=float, default=None,
                    help="the N of --signal=USR1@N, to tell a time-limit warning from a preemption")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds of pretend extra work per step")
    ap.add_argument("--plan", metavar="POLICY",
                    help="choose checkpoint steps with the planner (coci, young, daly, checkfreq, fixed:N)")
    ap.add_argument("--mtbf-hours", type=float, default=70.0, help="per-node MTBF for --plan (hours)")
    ap.add_argument("--plan-warmup", type=int, default=20, help="steps before the first (Ts-measuring) save")
    args = ap.parse_args(argv)

    comm = Comm.world()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    d_in = 16
    model = torch.nn.Sequential(torch.nn.Linear(d_in, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(args.hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.7)
    torch.manual_seed(args.seed * 1000 + 1 + comm.rank)  # per-rank dropout streams
    x, y = make_data(args.samples, d_in)
    sampler = ResumableSampler(args.samples, seed=args.seed, rank=comm.rank, world_size=comm.size)
    planner: dict | CheckpointSchedule = {"ckpt_every": args.ckpt_every}
    if args.plan:
        # A one-hour horizon: the example runs for minutes.
        planner = CheckpointSchedule(args.plan, from_mtbf(args.mtbf_hours * 3600), nodes=comm.size,
                                     horizon_s=3600, comm=comm, warmup_steps=args.plan_warmup)
    schedule = planner if isinstance(planner, CheckpointSchedule) else None
    extras: dict = {}
    state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": sampler,
             "planner": planner, "extras": extras}

    mgr = CheckpointManager(args.ckpt_dir, comm=comm, keep=args.keep)
    step = 0
    t_restart = time.perf_counter()
    if mgr.latest_step() is not None:
        step = mgr.load_latest(state).step
        if comm.rank == 0:
            print(f"resumed from step {step} in {time.perf_counter() - t_restart:.3f}s", flush=True)
        restart_cost = schedule.resumed(step) if schedule is not None else None
        if restart_cost is not None and comm.rank == 0:
            print(f"measured restart cost (stop-save to resumed) {restart_cost:.1f}s", flush=True)

    samples, step_times, ckpt_costs = [], [], []
    t0 = time.perf_counter()
    model.train()
    with contextlib.ExitStack() as stack:
        guard = stack.enter_context(PreemptionGuard(comm, signal_lead_s=args.signal_lead)) \
            if args.preemptible else None
        while step < args.steps:
            ts = time.perf_counter()
            idx = torch.from_numpy(sampler.next_batch(args.batch))
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=False)
            loss.backward()
            allreduce_grads(model, comm)
            opt.step()
            sched.step()
            step += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
            step_times.append(time.perf_counter() - ts)
            if schedule is not None:
                schedule.observe(step, float(loss.detach()), step_times[-1])
            samples.append({"step": step, "time_s": time.perf_counter() - t0, "loss": float(loss.detach())})
            if schedule.due(step) if schedule is not None else step % args.ckpt_every == 0:
                extras["last_loss"] = float(loss.detach())
                tc = time.perf_counter()
                if args.use_async:
                    mgr.save_async(step, state)
                else:
                    mgr.save(step, state)
                ckpt_costs.append(time.perf_counter() - tc)
                if schedule is not None:
                    schedule.saved(step, ckpt_costs[-1])
                if comm.rank == 0:
                    nxt = "" if schedule is None else f" (plan {args.plan}: next at step {schedule.next_step()})"
                    print(f"saved step {step}{nxt}", flush=True)
            elif args.use_async:
                mgr.poll()
            if guard is not None and guard.stop_requested():  # collective: every rank stops at this step
                mgr.wait()  # an async save in flight commits first
                if mgr.latest_step() != step:
                    if schedule is not None:
                        schedule.stopping()
                    extras["last_loss"] = float(loss.detach())
                    mgr.save(step, state)
                mgr.close()
                if comm.rank == 0:
                    print(f"STOP at step {step} ({guard.reason()}): saved, requeue", flush=True)
                guard.requeue()
                return 0
    mgr.close()

    digest = params_sha256(model)
    if comm.rank == 0:
        print(f"PARAM_HASH {digest} step {step}", flush=True)
        if args.profile_out:
            Profile.from_dict({"samples": samples, "total_steps": args.steps,
                               "ckpt_cost_s": float(np.mean(ckpt_costs)) if ckpt_costs else None,
                               "step_time_s": float(np.median(step_times)) if step_times else None}
                              ).save(args.profile_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
