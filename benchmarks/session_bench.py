"""Cost of the Session inside the training loop: steps/s with the session vs the bare DDP loop.

    python benchmarks/session_bench.py                     # 1 and 2 ranks (mpiexec), JSON + table
    python benchmarks/session_bench.py --ranks 1 --hidden 512 --steps 200 --rounds 3
    python benchmarks/session_bench.py --latency CKPT_DIR    # restart latency split from an event log
    python benchmarks/session_bench.py --memtier             # the memory tier's cost, 1 GB FSDP2 state, 2 ranks
    python benchmarks/session_bench.py --progress [DIR]      # the progress record's cost per step (in DIR)

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

``--progress``: the progress record alone (runtime/progress.py), one process: ``ProgressRecord.mark``
(the one call the Session adds per step) timed over --steps marks per round (default 200,000),
--rounds rounds, median microseconds per mark; beside it the same write followed by ``fdatasync``
(what a durable record per step would cost, 200 writes per round) and a bare ``os.pwrite``.
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
    """The memory tier's per-step cost on the sharded benchmark's FSDP2 state
    (``sharded_bench.build``: 8 ``Linear`` layers, batch 4, parameters + Adam's two moments of
    about --memtier-mb MB over all ranks).

    1. Costs for the planner, measured here: the bare step time (median of --cal-steps steps),
       the tier's blocked time per copy (every boundary's time over --cal-steps copies at k = 1,
       the receive side's included), the disk save's stall (one blocking ``CheckpointManager.save``
       of the state, or --disk-s) and --restart-s (given).
    2. k from the two-tier planner (``plan_two_tier`` on those costs, the session's default
       failure model: per-node MTBF ``DEFAULT_MTBF_H``, one node per rank, --horizon-h), as the
       Session's ``plan_with`` computes it; --k adds fixed intervals measured the same way.
    3. Interleaved rounds (which side goes first alternates): --steps steps (rounded up to whole
       intervals of k) of the bare loop, then of the same loop with ``MemoryTier.boundary`` after
       every step (the first copy at the round's first step), the last exchange finished inside
       the round. No per-step barrier: a rank blocked in the tier holds up its peer's next
       collective, and that shows in the round's wall time (barrier to barrier).
    """
    import torch
    from sharded_bench import build

    from coci_hpc.checkpoint import CheckpointManager
    from coci_hpc.comm import Comm
    from coci_hpc.planner import failures, two_tier
    from coci_hpc.runtime import memtier
    from coci_hpc.runtime.failurehistory import DEFAULT_MTBF_H

    torch.set_num_threads(1)
    c = Comm.world()
    import coci_hpc
    coci_hpc.init_distributed(comm=c)
    world = c.size
    model, _mesh, step_fn = build(int(a.memtier_mb), world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = {"model": model, "optimizer": opt}

    def step() -> None:
        step_fn(opt)

    def say(msg: str) -> None:
        if c.rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    for _ in range(a.warmup):
        step()
    say("warm")
    tier = memtier.MemoryTier(lambda: state, c.mpi_comm.Dup(), 1, 1)

    def settle() -> float:
        """Finish the exchange in flight (counted as the tier's: it blocks)."""
        t0 = time.perf_counter()
        while True:
            tier.poll()
            if all(c.allgather(tier._send_req is None and tier._recv_req is None)):
                return time.perf_counter() - t0

    def run(n: int, k: int | None) -> tuple[float, float]:
        """n steps, bare (k None) or with the tier every k steps: (wall seconds, blocked seconds)."""
        c.barrier()
        blocked = 0.0
        t0 = time.perf_counter()
        for i in range(n):
            step()
            if k is not None:
                t1 = time.perf_counter()
                tier.boundary(i)
                blocked += time.perf_counter() - t1
        if k is not None:
            blocked += settle()
        c.barrier()
        return time.perf_counter() - t0, blocked

    # 1. measured costs
    bare_steps = []
    for _ in range(a.cal_steps):
        c.barrier()
        t0 = time.perf_counter()
        step()
        bare_steps.append(time.perf_counter() - t0)
    step_s = float(max(c.allgather(statistics.median(bare_steps))))
    # The copy's stall as the Session's boundary sees it: a copy every 2nd step, every boundary
    # timed (snapshot into the host buffer, Isend, the tests, the receive of the partner's copy);
    # finishing the last exchange is not counted here (it waits for the peer's step too).
    # One untimed exchange first: it allocates the four host buffers (a one-time cost: the first
    # touch of their pages), as a run's first copies do, not the copies the planner is about.
    tier.every = 2
    for i in (0, 2):             # two exchanges: both own slots and both receive slots
        tier.boundary(i)
        settle()
    copies0 = tier.copies
    cal = 2 * a.cal_steps
    c.barrier()
    blocked = 0.0
    for i in range(cal):
        step()
        t1 = time.perf_counter()
        tier.boundary(i)
        blocked += time.perf_counter() - t1
    settle()
    mem_s = float(max(c.allgather(blocked / max(1, tier.copies - copies0))))
    say(f"step {step_s:.4f} s, copy blocks {mem_s:.4f} s")
    if a.disk_s is not None:
        disk_s, disk_how = a.disk_s, "--disk-s"
    else:
        mgr = CheckpointManager(Path(a.tmp) / "disk", comm=c, keep=1, rng=False)
        c.barrier()
        t0 = time.perf_counter()
        mgr.save(1, state)
        c.barrier()
        disk_s, disk_how = time.perf_counter() - t0, "measured: one blocking CheckpointManager.save"
        shutil.rmtree(Path(a.tmp) / "disk", ignore_errors=True)
    # 2. k from the planner (rank 0; the simulation is deterministic in its seed)
    plan = None
    if c.rank == 0:
        costs = two_tier.TierCosts(mem_s, disk_s, a.restart_s, a.restart_s, step_s)
        model_f = failures.from_mtbf(DEFAULT_MTBF_H * 3600)
        p = two_tier.plan_two_tier(costs, two_tier.profile_from_model(model_f, world), a.horizon_h * 3600)
        plan = {"mem_every_steps": p.mem_every_steps, "disk_every_steps": p.disk_every_steps,
                "reason": p.reason, "costs": costs.to_dict(), "mtbf_node_h": DEFAULT_MTBF_H, "nodes": world,
                "horizon_h": a.horizon_h, "disk_s_from": disk_how}
    plan = c.bcast(plan)
    say(f"disk save {disk_s:.3f} s; plan {plan['mem_every_steps']} / {plan['disk_every_steps']}")
    assert plan is not None
    ks: list[tuple[str, int]] = []
    if plan["mem_every_steps"]:
        ks.append(("planned", int(plan["mem_every_steps"])))
    ks = [("fixed", k) for k in a.k if k not in {v for _, v in ks}] + ks
    # 3. interleaved rounds per k
    results = []
    done: dict[tuple[int, int], tuple[list[float], list[float], list[float]]] = {}
    for how, k in ks:
        # The window: whole intervals of k when they fit in --steps, else --steps steps holding
        # one copy (at its first step) and its completion. A boundary with no exchange in flight
        # only tests a request (microseconds), so the extra time of the window is the extra time
        # of one interval of k steps: the fraction is extra / (copies * k * bare step).
        n = -(-a.steps // k) * k if k <= a.steps else a.steps
        copies = -(-n // k)
        tier.every = k
        off_w: list[float] = []
        on_w: list[float] = []
        on_b: list[float] = []
        if (n, copies) in done:     # the same window with the same copies: measured already
            off_w, on_w, on_b = done[(n, copies)]
        for r in range(a.rounds if (n, copies) not in done else 0):
            for side in ((None, k) if r % 2 == 0 else (k, None)):
                w, b = run(n, side)
                if side is None:
                    off_w.append(w)
                else:
                    on_w.append(w)
                    on_b.append(b)
        done[(n, copies)] = (off_w, on_w, on_b)
        say(f"k={k}: on {[round(x, 3) for x in on_w]} off {[round(x, 3) for x in off_w]}")
        blocked = [max(x) for x in zip(*c.allgather(on_b))]   # the slowest rank's, per round
        span = [copies * k * off / n for off in off_w]        # bare seconds of the intervals covered
        per_round = [(on - off) / sp for on, off, sp in zip(on_w, off_w, span)]
        results.append({"k": k, "k_from": how, "window_steps": n, "copies_per_window": copies,
                        "direct": n == copies * k,
                        "off_wall_s": off_w, "on_wall_s": on_w, "blocked_s": blocked,
                        "step_s": statistics.median(off_w) / n,
                        "extra_per_copy_s": statistics.median((on - off) / copies for on, off in zip(on_w, off_w)),
                        "memtier_overhead": statistics.median(per_round),
                        "memtier_overhead_pooled": (sum(on_w) - sum(off_w)) / sum(span),
                        "memtier_overhead_rounds": per_round,
                        "memtier_blocked_ratio": statistics.median(b / sp for b, sp in zip(blocked, span))})
    state_bytes = sum(l.nbytes for l in memtier.collect(state, rng=False)[1])
    import resource
    out = c.gather({"state_bytes": state_bytes, "copies": tier.copies, "skipped": tier.skipped,
                    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    "allocations": tier.allocations(),
                    "slot_bytes": sum(int(s.buf.size) for s in (*tier.own, *tier.recv))})
    if c.rank == 0:
        assert out is not None
        print(json.dumps({"ranks": world, "state_mb_total": sum(o["state_bytes"] for o in out) / 2**20,
                          "cal_step_s": step_s, "mem_copy_blocked_s": mem_s, "disk_save_s": disk_s,
                          "plan": plan, "results": results, "per_rank": out}), flush=True)


def progress_cost(directory: str | None, rounds: int, marks: int) -> int:
    """The progress record's cost per step: ``mark`` vs a bare pwrite vs pwrite + fdatasync."""
    from coci_hpc.comm import Comm
    from coci_hpc.runtime.progress import SLOT, ProgressRecord, encode

    root = Path(directory or tempfile.mkdtemp(prefix="coci-progress-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    rec = ProgressRecord(root, Comm.serial())
    rec.begin(1, 0)
    fd = os.open(root / ".progress" / "bench-raw", os.O_RDWR | os.O_CREAT, 0o644)
    raw = encode(1, 0, 0.0)
    mark_us, pwrite_us, sync_us = [], [], []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            for step in range(1, marks + 1):
                rec.mark(step)
            mark_us.append((time.perf_counter() - t0) / marks * 1e6)
            t0 = time.perf_counter()
            for step in range(1, marks + 1):
                os.pwrite(fd, raw, (step & 1) * SLOT)
            pwrite_us.append((time.perf_counter() - t0) / marks * 1e6)
            t0 = time.perf_counter()
            for step in range(1, 201):
                os.pwrite(fd, raw, (step & 1) * SLOT)
                os.fdatasync(fd)
            sync_us.append((time.perf_counter() - t0) / 200 * 1e6)
    finally:
        os.close(fd)
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
    res = {"benchmark": "progress_record", "dir": str(root), "rounds": rounds, "marks_per_round": marks,
           "mark_us": statistics.median(mark_us), "pwrite_us": statistics.median(pwrite_us),
           "pwrite_fdatasync_us": statistics.median(sync_us),
           "mark_us_rounds": mark_us, "pwrite_fdatasync_us_rounds": sync_us}
    print(json.dumps(res, indent=1))
    print(f"\nmark {res['mark_us']:.2f} us/step, bare pwrite {res['pwrite_us']:.2f} us, pwrite + fdatasync "
          f"{res['pwrite_fdatasync_us']:.1f} us (medians of {rounds} rounds) in {root}")
    return 0


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
    ap.add_argument("--k", type=int, nargs="*", default=[10],
                    help="--memtier: fixed intervals measured besides the planner's k (default 10: Orbax's)")
    ap.add_argument("--cal-steps", type=int, default=5, help="--memtier: steps timed for the planner's costs")
    ap.add_argument("--disk-s", type=float, help="--memtier: the disk save's stall (default: one save, timed)")
    ap.add_argument("--restart-s", type=float, default=30.0,
                    help="--memtier: restart seconds for the planner (the restart latency table: 20-38 s)")
    ap.add_argument("--horizon-h", type=float, default=24.0, help="--memtier: the planner's horizon (hours)")
    ap.add_argument("--progress", nargs="?", const="", metavar="DIR",
                    help="the progress record's cost per step instead (in DIR; default a temporary directory)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        (memtier_worker if a.memtier else worker)(a)
        return 0
    if a.latency:
        return latency(a.latency)
    if a.progress is not None:
        return progress_cost(a.progress or None, a.rounds, a.steps if a.steps != 300 else 200_000)
    if a.memtier:
        if a.ranks == [1, 2]:
            a.ranks = [2]           # the tier needs a partner: 2 ranks unless asked otherwise
        if a.steps == 300:
            a.steps = 30
        if a.rounds == 5:
            a.rounds = 3
        if a.warmup == 20:
            a.warmup = 2
    results = []
    for n in a.ranks:
        tmp = tempfile.mkdtemp(prefix="coci-session-bench-")
        try:
            args = [sys.executable, "-m", "mpi4py", __file__, "--worker", "--tmp", tmp, "--hidden", str(a.hidden),
                    "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
                    "--rounds", str(a.rounds), "--cost-rounds", str(a.cost_rounds)]
            if a.memtier:
                args += ["--memtier", "--memtier-mb", str(a.memtier_mb), "--k", *map(str, a.k),
                         "--cal-steps", str(a.cal_steps), "--restart-s", str(a.restart_s),
                         "--horizon-h", str(a.horizon_h)] + ([] if a.disk_s is None else ["--disk-s", str(a.disk_s)])
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
        print(f"\n{'ranks':>5} {'state MB':>9} {'k':>5} {'k from':>8} {'window':>6} {'step s':>8} "
              f"{'overhead':>9} {'pooled':>8} {'blocked':>8}  (medians over rounds; goal <= 0.02)")
        for r in results:
            for x in r["results"]:
                print(f"{r['ranks']:>5} {r['state_mb_total']:>9.1f} {x['k']:>5} {x['k_from']:>8} "
                      f"{x['window_steps']:>6} {x['step_s']:>8.4f} {x['memtier_overhead']:>9.4f} "
                      f"{x['memtier_overhead_pooled']:>8.4f} {x['memtier_blocked_ratio']:>8.4f}")
            p = r["plan"]
            print(f"      planner: k={p['mem_every_steps']} disk every {p['disk_every_steps']} from copy "
                  f"{r['mem_copy_blocked_s']:.4f} s, disk {r['disk_save_s']:.3f} s, step {r['cal_step_s']:.4f} s, "
                  f"restart {p['costs']['mem_restart_s']:g} s, MTBF {p['mtbf_node_h']:g} h/node, "
                  f"{p['nodes']} nodes; {p['reason']}")
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
