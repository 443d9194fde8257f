"""Subprocess driver for tests/session/test_two_tier_session.py (``mpiexec -n 2``): a real FSDP2
training (CPU device mesh, gloo) under a real :class:`coci_hpc.Session` with the default policy,
run twice in the same processes on the same data: once with the memory tier as the Session sets
it up (``COCI_MEMTIER_K`` unset: k from the two-tier plan), once without it (``COCI_MEMTIER_K=0``,
the control: the schedule's own single-tier plan decides the disk saves).

    two_tier_train.py DIR STEPS MTBF_S

The failure model: a history of incidents on a 2-node cluster every ``MTBF_S`` seconds, one in
``PAIR_EVERY`` taking both nodes (a rank and its partner: what the memory tier cannot serve).
Stand-in, named as such: the restart cost the planner assumes until it has measured one
(``schedule.ASSUMED_RESTART_S``, 150 s) is ``RESTART_S`` here, since a restart of minutes against
an MTBF of seconds leaves nothing to plan; every other cost is measured by the run. Saves are
blocking (``async_save=False``): a disk save then costs several memory copies, as it does on a
real file system, instead of about one (the two-phase save's snapshot). Second stand-in, named as
such: a shared file system's commit latency (``COMMIT_LATENCY_S`` added to each manifest commit,
the metadata round trips a Lustre commit pays and this local disk does not). Without it a disk
save of this 2 KB model costs ~14 ms here, about one memory copy plus a step, and whether the
memory tier pays is decided inside the simulation's noise: the test's premise would then hang on
how fast this disk happens to be that day.

Rank 0 prints one ``RESULT`` JSON line: per run, every rank's memory-tier interval after each
step boundary (``every[s]``: after boundary s; counted from ``phase[s]``) and how many copies it had made by then
(``copies[s]``), rank 0's two-tier disk interval after each (``disk[s]``; None: the schedule's
own plan), the measured costs, and the hash of the final (gathered) parameters. The Session's
own lines (the plans it made) go to stderr as usual.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import coci_hpc
from coci_hpc.checkpoint import catalog
from coci_hpc.comm import Comm
from coci_hpc.planner import failures
from coci_hpc.runtime import schedule

PAIR_EVERY = 10             # one incident in 10 takes both nodes
INCIDENTS = 20
RESTART_S = 0.5
COMMIT_LATENCY_S = 0.1     # stand-in for a shared file system's metadata latency (see above)
HORIZON_S = 60.0            # short: the single-tier plan (kept in the state rank 0 copies) stays small


def failure_model(mtbf_s: float) -> failures.FailureModel:
    """``INCIDENTS`` node events on nodes n0, n1, one every ``mtbf_s`` seconds (no Weibull fit)."""
    events = [failures.FailureEvent(("n0", "n1") if i % PAIR_EVERY == 0 else (f"n{i % 2}",), 1e9 + i * mtbf_s,
                                    source="event") for i in range(INCIDENTS)]
    return failures.estimate(events, 2 * INCIDENTS * mtbf_s, weibull_min_gaps=10**6, cluster_nodes=2)


def slow_commits() -> None:
    """Every manifest commit pays ``COMMIT_LATENCY_S`` first (the stand-in above)."""
    write = catalog.StepCatalog.write_manifest

    def slow(self: catalog.StepCatalog, step: int, manifest: dict[str, Any]) -> Path:
        time.sleep(COMMIT_LATENCY_S)
        return write(self, step, manifest)
    catalog.StepCatalog.write_manifest = slow  # type: ignore[method-assign]


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of the full parameters (each DTensor gathered: a collective)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(name.encode())
        h.update(full.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(ckpt_dir: Path, steps: int, mtbf_s: float, environ: dict[str, str], world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    session = coci_hpc.Session({"model": model, "optimizer": opt}, total_steps=steps, ckpt_dir=ckpt_dir,
                               failure_model=failure_model(mtbf_s), horizon_s=HORIZON_S, async_save=False,
                               environ=environ)
    tier = session.survival.memtier
    every: list[int | None] = []
    phase: list[int | None] = []
    copies: list[int] = []
    disk: list[int | None] = []
    for step in session.steps():
        # what holds after boundary `step` (the restore's for step 0)
        every.append(None if tier is None else tier.every)
        phase.append(None if tier is None else tier.phase)
        copies.append(0 if tier is None else tier.copies)
        disk.append(session.schedule.two_tier_disk_every)
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        session.observe(loss.detach())
    return {"every": every, "phase": phase, "copies": copies, "disk": disk, "skipped": None if tier is None else tier.skipped,
            "final": digest(model), "costs": str(session.schedule.costs())}


def main() -> int:
    root, steps, mtbf_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    schedule.ASSUMED_RESTART_S = RESTART_S
    slow_commits()
    torch.set_num_threads(1)
    dist = coci_hpc.init_distributed()
    env = {k: v for k, v in os.environ.items() if k != "COCI_MEMTIER_K"}
    runs = {"tier": train(root / "tier", steps, mtbf_s, env, dist.world_size),
            "control": train(root / "control", steps, mtbf_s, {**env, "COCI_MEMTIER_K": "0"}, dist.world_size)}
    got = Comm.world().gather({"rank": dist.rank, **runs})
    if dist.rank == 0:
        print("RESULT " + json.dumps(got), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
