"""Per-step CPU cost of the survivors' partner copy in a training loop, without the lockstep.

    python benchmarks/partner_copy_bench.py            # 2 ranks (mpiexec), JSON + table
    python benchmarks/partner_copy_bench.py --steps 3000 --rounds 7

session_bench.py measures the session's cost with both ranks spinning on the step agreement,
which multiplies a few microseconds of work several times over on a loaded machine. Here each of
2 ranks runs a tiny local training step (forward with dropout, backward, optimizer step; no DDP,
no session, no agreement) with :class:`~coci_hpc.runtime.survivors.Survival`'s hooks and
boundary work, and times it against the same loop without them, in alternating rounds (medians).
Time is the thread's CPU time (``time.thread_time``), not wall time: on a machine shared with
other runs, waiting for a core would swamp the few microseconds measured.

- ``off``: no partner copy;
- ``optimizer``: the copy at the first ``optimizer.step()`` of a step only (before issue 13's
  window was closed);
- ``forward``: the copy at the end of forward instead (now: it leaves before the gradient
  allreduce; the optimizer step then takes no second capture).

The cost of a mode is its median step time minus ``off``'s, in microseconds; the ratio it implies
at a step time is step / (step + cost) (``--step-ms``, default 11.2 ms: session_bench's step).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODES = ("off", "optimizer", "forward")


def worker(a: argparse.Namespace) -> None:
    import torch

    from coci_hpc.comm import Comm
    from coci_hpc.runtime.survivors import Survival

    torch.set_num_threads(1)
    comm = Comm.world()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    state = {"model": model, "optimizer": opt}

    def run(mode: str) -> float:
        sv = None
        if mode != "off":
            sv = Survival(state, comm, ranks_per_node=1, copy_at_forward=mode == "forward")
            sv.boundary(0)
        marks = []
        for step in range(1, a.steps + 1):
            if step == 100:
                marks.append(time.thread_time())
            opt.zero_grad(set_to_none=False)
            model(x).sum().backward()
            opt.step()
            if sv is not None:
                sv.boundary(step)
        t = (time.thread_time() - marks[0]) / (a.steps - 99)
        if sv is not None:
            comm.mpi_comm.Barrier()
            assert sv.partner is not None
            sv.partner.drain()
            sv.close()          # the hooks off, the partner link's connections closed
        comm.mpi_comm.Barrier()
        return 1e6 * t

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        order = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for m in order:
            times[m].append(run(m))
    med = {m: statistics.median(v) for m, v in times.items()}
    out = {"rank": comm.rank, "step_us": med, "rounds_us": times,
           "cost_us": {m: med[m] - med["off"] for m in MODES if m != "off"}}
    all_out = comm.gather(out)
    if comm.rank == 0:
        print(json.dumps({"ranks": all_out}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=11.2, help="step time the ratio is given at")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "mpi4py", __file__,
           "--worker", "--steps", str(a.steps), "--rounds", str(a.rounds)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        print(p.stdout, p.stderr, file=sys.stderr)
        return 1
    ranks = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])["ranks"]
    cost = {m: statistics.median(r["cost_us"][m] for r in ranks) for m in MODES if m != "off"}
    res = {"benchmark": "partner_copy", "steps": a.steps, "rounds": a.rounds, "step_ms": a.step_ms, "ranks": ranks,
           "cost_us": cost, "ratio": {m: a.step_ms / (a.step_ms + c / 1000) for m, c in cost.items()},
           "forward_minus_optimizer_us": cost["forward"] - cost["optimizer"]}
    print(json.dumps(res, indent=1))
    print(f"\n{'mode':>10} {'rank 0 CPU us':>15} {'rank 1 CPU us':>15} {'cost us':>8} "
          f"{'ratio at ' + format(a.step_ms, 'g') + ' ms':>16}  (medians over rounds)")
    for m in MODES:
        c = cost.get(m, 0.0)
        print(f"{m:>10} {ranks[0]['step_us'][m]:>15.1f} {ranks[1]['step_us'][m]:>15.1f} {c:>8.1f} "
              f"{a.step_ms / (a.step_ms + c / 1000):>16.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
