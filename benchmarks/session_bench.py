"""Cost of the Session inside the training loop: steps/s with the session vs the bare DDP loop.

    python benchmarks/session_bench.py                     # 1 and 2 ranks (mpiexec), JSON + table
    python benchmarks/session_bench.py --ranks 1 --hidden 512 --steps 200 --rounds 3
    python benchmarks/session_bench.py --latency CKPT_DIR    # restart latency split from an event log

Each worker trains the examples/train.py model (wider: --hidden, --batch set the step time) with
DDP on gloo, and alternates rounds of the bare loop and of the same loop under ``Session`` (policy
``fixed:N`` with N past the end: the per-step cost only; checkpoints are the planner's business and
are measured by benchmarks/checkpoint_bench.py). Each round times --steps steps after --warmup
steps; the ratio is session steps/s over bare steps/s, the median over rounds (the rounds alternate
so that load from other processes on the machine hits both sides alike). On a shared machine the
throughput of one round swings by tens of percent, so the median-step ratio (median bare step
time over median session step time, per round) is printed too: it ignores bursts of foreign load.
Last, the session's own cost per step is measured directly (an empty loop body under the session
vs bare, 5,000 steps; with 2 ranks it includes the allreduce's latency) and turned into the ratio
it implies at the measured step time: step / (step + cost); with the survivors' partner copy
(the default) and without it, in --cost-rounds alternating rounds, medians.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import coci_hpc
    from coci_hpc.runtime.data import ResumableSampler

    torch.set_num_threads(1)
    dist = coci_hpc.init_distributed()
    torch.manual_seed(0)
    d_in, n = 16, 4096
    model = torch.nn.Sequential(torch.nn.Linear(d_in, a.hidden), torch.nn.ReLU(), torch.nn.Linear(a.hidden, a.hidden),
                                torch.nn.ReLU(), torch.nn.Linear(a.hidden, 1))
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(n, d_in), torch.randn(n, 1)
    sampler = ResumableSampler(n, seed=0, rank=dist.rank, world_size=dist.world_size)

    def train_step() -> torch.Tensor:
        idx = torch.from_numpy(sampler.next_batch(a.batch))
        loss = F.mse_loss(ddp(x[idx]), y[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return loss.detach()

    total = a.warmup + a.steps

    import numpy as np

    marks = np.zeros(a.steps + 1)   # start time of each timed step (and the end of the last)

    def bare() -> tuple[float, float]:
        for step in range(total + 1):
            if step >= a.warmup:
                marks[step - a.warmup] = time.perf_counter()
            if step == total:
                return a.steps / (marks[-1] - marks[0]), float(np.median(np.diff(marks)))
            train_step()
        raise AssertionError

    def with_session(r: int) -> float:
        ckpt = Path(a.tmp) / f"round{r}"
        s = coci_hpc.Session({"model": model, "optimizer": opt, "loader": sampler}, total + 1, ckpt_dir=ckpt,
                             policy=f"fixed:{10 * total}", environ={})
        for step in s.steps():
            if step >= a.warmup:
                marks[step - a.warmup] = time.perf_counter()
            s.observe(train_step())
        return a.steps / (marks[-1] - marks[0]), float(np.median(np.diff(marks)))

    def boundary_cost_us(n: int = 5000, survivors: bool = True, r: int = 0) -> float:
        """The session's own cost per step: an empty loop body under the session (2 ranks: includes
        the allreduce latency), minus the same empty loop bare. Robust to foreign load."""
        s = coci_hpc.Session({"model": model, "optimizer": opt}, n, ckpt_dir=Path(a.tmp) / f"empty{survivors}{r}",
                             policy=f"fixed:{10 * n}", environ={}, survivors=survivors)
        loss = torch.tensor(1.0)
        for step in s.steps():
            if step == 100:
                t0 = time.perf_counter()
            s.observe(loss)
        t_session = (time.perf_counter() - t0) / (n - 100)
        t0 = time.perf_counter()
        for _ in range(n - 100):
            pass
        return 1e6 * (t_session - (time.perf_counter() - t0) / (n - 100))

    rounds = []
    for r in range(a.rounds):
        if r % 2:   # alternate which side goes first, so that drift hits both alike
            (s, sm), (b, bm) = with_session(r), bare()
        else:
            (b, bm), (s, sm) = bare(), with_session(r)
        rounds.append({"bare_steps_s": b, "session_steps_s": s, "ratio": s / b,
                       "bare_median_step_ms": 1000 * bm, "session_median_step_ms": 1000 * sm,
                       "median_step_ratio": bm / sm})
    # With the survivors' partner copy (the default) and without it, side by side: alternating
    # rounds (which goes first alternates too), the median of each side, so that foreign load
    # on a shared machine hits both alike. The empty body calls no optimizer.step(), so the copy
    # is taken at the boundary: the same work per step.
    costs_off: list[float] = []
    costs_on: list[float] = []
    for r in range(a.cost_rounds):
        for surv in ((False, True) if r % 2 == 0 else (True, False)):
            (costs_on if surv else costs_off).append(boundary_cost_us(survivors=surv, r=r))
    cost_bare_session = statistics.median(costs_off)
    cost = statistics.median(costs_on)
    step_ms = statistics.median(x["bare_median_step_ms"] for x in rounds)
    if dist.rank == 0:
        print(json.dumps({"ranks": dist.world_size, "boundary_cost_us": cost,
                          "ratio_from_cost": step_ms / (step_ms + cost / 1000),
                          "boundary_cost_no_partner_us": cost_bare_session,
                          "boundary_cost_rounds_us": costs_on, "boundary_cost_no_partner_rounds_us": costs_off,
                          "ratio_from_cost_no_partner": step_ms / (step_ms + cost_bare_session / 1000),
                          "hidden": a.hidden, "batch": a.batch, "rounds": rounds,
                          "step_time_ms": statistics.median(x["bare_median_step_ms"] for x in rounds),
                          "ratio": statistics.median(x["ratio"] for x in rounds),
                          "median_step_ratio": statistics.median(x["median_step_ratio"] for x in rounds)}),
              flush=True)


def memtier_worker(a: argparse.Namespace) -> None:
    """The memory tier's per-step cost on an FSDP2 state of about --memtier-mb MB (parameters and
    Adam's two moments, over all ranks): alternating rounds of the bare FSDP2 loop and the same loop
    with ``MemoryTier.boundary`` every step (a copy every --k steps); per round the median step time
    of each, and the time the boundary itself blocked (the copy into the reused host buffer, the
    Isend, the tests of the exchange in flight)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    import coci_hpc
    from coci_hpc.runtime import memtier

    torch.set_num_threads(1)
    comm = coci_hpc.init_distributed()
    world = comm.world_size
    torch.manual_seed(0)
    # params * 4 bytes * 3 (param + exp_avg + exp_avg_sq) ~ memtier-mb; square layers of width h
    h = 1024
    layers = max(1, round(a.memtier_mb * 2**20 / (12 * h * h)))
    model = torch.nn.Sequential(*[torch.nn.Linear(h, h) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(a.batch, h)
    state = {"model": model, "optimizer": opt}
    from coci_hpc.comm import Comm
    c = Comm.world()
    tier = memtier.MemoryTier(lambda: state, c.mpi_comm.Dup(), 1, a.k)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    rounds = []
    s = 0
    for _ in range(a.rounds):
        bare, tiered, blocked = [], [], 0.0
        for _ in range(a.steps):
            c.barrier()
            t0 = time.perf_counter()
            step()
            bare.append(time.perf_counter() - t0)
        for _ in range(a.steps):
            s += 1
            c.barrier()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            tier.boundary(s)
            t2 = time.perf_counter()
            tiered.append(t2 - t0)
            blocked += t2 - t1
        rounds.append({"bare_step_s": statistics.median(bare), "tier_step_s": statistics.median(tiered),
                       "blocked_per_step_s": blocked / a.steps,
                       "mean_bare_s": statistics.fmean(bare), "mean_tier_s": statistics.fmean(tiered)})
    state_bytes = sum(l.nbytes for l in memtier.collect(state, rng=False)[1])
    out = c.gather({"rounds": rounds, "state_bytes": state_bytes, "copies": tier.copies, "skipped": tier.skipped,
                    "allocations": tier.allocations()})
    if c.rank == 0:
        assert out is not None
        r0 = out[0]["rounds"]
        bare_med = statistics.median(r["mean_bare_s"] for r in r0)
        print(json.dumps({"ranks": world, "k": a.k, "state_mb_total": sum(o["state_bytes"] for o in out) / 2**20,
                          "step_s": bare_med,
                          "memtier_overhead": statistics.median((r["mean_tier_s"] - r["mean_bare_s"]) / r["mean_bare_s"]
                                                                for r in r0),
                          "memtier_blocked_ratio": statistics.median(r["blocked_per_step_s"] / r["mean_bare_s"]
                                                                     for r in r0),
                          "per_rank": out}))


def latency(ckpt_dir: str) -> int:
    """Every restart in a run's event log: how the previous attempt ended and the latency split."""
    from coci_hpc.runtime.events import read_events

    events = read_events(ckpt_dir)
    starts = {e["attempt"]: e for e in events if e["event"] == "attempt_start"}
    rows = []
    for e in events:
        if e["event"] == "resumed":
            lat, prev = e["restart_latency_s"], starts.get(e["attempt"], {}).get("prev_end", {})
            rows.append({"attempt": e["attempt"], "prev_end": prev.get("reason"), "step": e["step"], **lat})
    print(json.dumps({"benchmark": "restart_latency", "ckpt_dir": ckpt_dir, "restarts": rows}, indent=1))
    print(f"\n{'attempt':>7} {'previous end':>15} {'total s':>8} {'slurm requeue s':>16} {'process start s':>16} "
          f"{'restore s':>10}")
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        print(f"{r['attempt']:>7} {r['prev_end'] or '?':>15} {f(r['total']):>8} {f(r['slurm_requeue_s']):>16} "
              f"{f(r['process_start_s']):>16} {f(r['restore_s']):>10}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cost-rounds", type=int, default=3,
                    help="alternating rounds of the boundary cost with and without the partner copy")
    ap.add_argument("--latency", metavar="CKPT_DIR", help="print the restart latency split from CKPT_DIR/events.jsonl")
    ap.add_argument("--memtier", action="store_true",
                    help="the memory tier's per-step cost on an FSDP2 state (--memtier-mb, --k) instead")
    ap.add_argument("--memtier-mb", type=float, default=1024, help="FSDP2 state size over all ranks (MB)")
    ap.add_argument("--k", type=int, default=10, help="memory-tier interval in steps (the planner's k)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        (memtier_worker if a.memtier else worker)(a)
        return 0
    if a.latency:
        return latency(a.latency)
    results = []
    for n in a.ranks:
        tmp = tempfile.mkdtemp(prefix="coci-session-bench-")
        try:
            args = [sys.executable, "-m", "mpi4py", __file__, "--worker", "--tmp", tmp, "--hidden", str(a.hidden),
                    "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
                    "--rounds", str(a.rounds), "--cost-rounds", str(a.cost_rounds)]
            if a.memtier:
                args += ["--memtier", "--memtier-mb", str(a.memtier_mb), "--k", str(a.k)]
            cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(n), *args]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            if p.returncode != 0:
                print(p.stdout, p.stderr, file=sys.stderr)
                return 1
            results.append(json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1]))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if a.memtier:
        print(json.dumps({"benchmark": "memtier_overhead", "results": results}, indent=1))
        print(f"\n{'ranks':>5} {'k':>4} {'state MB':>9} {'step s':>8} {'overhead':>9} {'blocked':>8}  (goal <= 0.02)")
        for r in results:
            print(f"{r['ranks']:>5} {r['k']:>4} {r['state_mb_total']:>9.1f} {r['step_s']:>8.4f} "
                  f"{r['memtier_overhead']:>9.4f} {r['memtier_blocked_ratio']:>8.4f}")
        return 0
    print(json.dumps({"benchmark": "session_overhead", "results": results}, indent=1))
    print(f"\n{'ranks':>5} {'step ms':>8} {'bare steps/s':>13} {'session steps/s':>16} {'ratio':>7} "
          f"{'median-step ratio':>18} {'session us/step':>16} {'ratio from cost':>16} {'no-partner us/step':>19} "
          f"{'ratio from cost, no partner':>28}  (medians over rounds)")
    for r in results:
        b = statistics.median(x["bare_steps_s"] for x in r["rounds"])
        s = statistics.median(x["session_steps_s"] for x in r["rounds"])
        print(f"{r['ranks']:>5} {r['step_time_ms']:>8.1f} {b:>13.1f} {s:>16.1f} {r['ratio']:>7.4f} "
              f"{r['median_step_ratio']:>18.4f} {r['boundary_cost_us']:>16.1f} {r['ratio_from_cost']:>16.5f} "
              f"{r['boundary_cost_no_partner_us']:>19.1f} {r['ratio_from_cost_no_partner']:>28.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
