"""Subprocess driver: the state matrix under the FAKE device boundary (tests/checkpoint/fake_device.py).

Run under ``mpiexec -n N`` (gloo, CPU meshes). Every case builds the state, trains it, tags its
memory as the device's (:meth:`DeviceBoundary.adopt`), saves it one way and loads it into a
freshly built state (tagged too), then compares every full tensor (``full_tensor()``) and one more
Adam step with the saver's:

    boundary_job.py matrix DIR [--no-fake]   every case for this world; RESULT {case: problems}
    boundary_job.py load DIR LAYOUT [--no-fake]  load DIR/sync-fsdp (saved by matrix) into LAYOUT
    ... --device cuda             the same on a GPU (no fake: tests/gpu/run)
    boundary_job.py mixed DIR         a DTensor shard on another device than its mesh: save, load

Cases (layout: plain = DDP-style replicated tensors, fsdp, tp, hsdp (2+ ranks, even)):
    sync-LAYOUT     CheckpointManager.save / load_latest
    async-LAYOUT    save_async with every deferrable leaf copied in the background, one more
                    training step (its optimizer step waits for the snapshot), wait, load
    memtier-LAYOUT  the memory tier's copy (copy_state: device tensors straight into a reused
                    page-locked Slot on the side stream, a second copy into the other slot),
                    every rank's copy to rank 0, write_snapshots, load
    survivors-plain the survivors' save (capture + write_checkpoint by rank 0), load
    export-LAYOUT   export to Hugging Face safetensors (rank 0), load_pretrained into a fresh
                    model (model tensors only)

RESULT (rank 0): {"cases": {case: [problems]}, "hashes": {...}, "crossings": {...}}.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from coci_hpc import init_distributed
from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint.lustre import DEFAULT_ALIGN, DEFAULT_ALIGN_THRESHOLD, IOTuning
from coci_hpc.comm import Comm
from tests.checkpoint.fake_device import DeviceBoundary

DEVICE = "cpu"   # --device cuda: the same cases on a real GPU (tests/gpu/run), without the fake
TUNING = IOTuning(False, DEFAULT_ALIGN, DEFAULT_ALIGN_THRESHOLD, None)


class MLP(torch.nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(10, rows)
        self.fc2 = torch.nn.Linear(rows, 6)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def build(layout: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP(8 if layout == "tp" else 7).to(DEVICE)   # tp: torch's forward needs even shards; fsdp: uneven
    if layout == "fsdp":
        mesh = init_device_mesh(DEVICE, (world,))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "hsdp":
        mesh = init_device_mesh(DEVICE, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh(DEVICE, (world,))
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 10, generator=gen).to(DEVICE)).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            model.seen.add_(1.0)


def digest(t: Any) -> str:
    t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    bad = "" if not t.is_floating_point() or bool(torch.isfinite(t).all()) else " NON-FINITE"
    return hashlib.sha256(raw).hexdigest()[:12] + bad


def hashes(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, str]:
    out = {f"model/{k}": digest(v) for k, v in model.state_dict().items()}
    if opt is not None:
        for name, p in model.named_parameters():
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"opt/{name}/{k}"] = digest(v)
    return out


def diff(want: dict[str, str], got: dict[str, str]) -> list[str]:
    return [f"{k}: {want.get(k)} != {got.get(k)}" for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]


class Job:
    def __init__(self, root: Path, fake: DeviceBoundary | None) -> None:
        self.root, self.fake = root, fake
        self.comm = Comm.world()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def fresh(self, layout: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model, opt = build(layout, self.world)
        if self.fake is not None:
            self.fake.adopt(model, opt)   # the parameters are on the device; the optimizer has no state yet
        return model, opt

    def trained(self, layout: str, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model, opt = self.fresh(layout)
        train(model, opt, steps)
        if self.fake is not None:
            self.fake.adopt(model, opt)   # Adam's moments, made by the first step, are device memory
        return model, opt

    def mgr(self, case: str) -> CheckpointManager:
        return CheckpointManager(self.root / case, comm=self.comm, keep=3)

    def check_load(self, case: str, want: dict[str, str], want_next: dict[str, str] | None, layout: str,
                   step: int | None = None) -> list[str]:
        """A fresh state loads ``step`` (newest) of ``case``: the saved tensors, and the same next step."""
        model, opt = self.fresh(layout)
        mgr = self.mgr(case)
        state = {"model": model, "optimizer": opt}
        mgr.load_latest(state) if step is None else mgr.load(step, state)
        mgr.close()
        problems = diff(want, hashes(model, opt))
        if want_next is not None:
            train(model, opt, 1, seed=2)
            problems += [f"next step: {p}" for p in diff(want_next, hashes(model, opt))]
        return problems

    # -- the cases -----------------------------------------------------------------------------
    def sync(self, layout: str) -> tuple[list[str], dict[str, str]]:
        case = f"sync-{layout}"
        model, opt = self.trained(layout)
        mgr = self.mgr(case)
        mgr.save(2, {"model": model, "optimizer": opt})
        mgr.close()
        want = hashes(model, opt)
        train(model, opt, 1, seed=2)
        return self.check_load(case, want, hashes(model, opt), layout), want

    def asave(self, layout: str) -> list[str]:
        case = f"async-{layout}"
        model, opt = self.trained(layout)
        mgr = self.mgr(case)
        mgr._async.overlap_min_bytes = 0   # every deferrable leaf copied by the background thread
        state = {"model": model, "optimizer": opt}
        mgr.save_async(2, state)
        want2 = hashes(model, opt)         # (full_tensor is a collective: every rank, same point)
        train(model, opt, 1, seed=2)       # the optimizer step waits for the snapshot, then changes the state
        mgr.wait()
        want3 = hashes(model, opt)
        mgr.save_async(3, state)           # into the reused host buffers
        train(model, opt, 1, seed=3)
        mgr.wait()
        mgr.close()
        problems = [f"step 2 {p}" for p in self.check_load(case, want2, want3, layout, step=2)]
        return problems + [f"step 3 {p}" for p in self.check_load(case, want3, None, layout)]

    def memtier(self, layout: str) -> list[str]:
        from coci_hpc.runtime.memtier import Slot, copy_state, decode, write_snapshots

        case = f"memtier-{layout}"
        model, opt = self.trained(layout)
        slots = [Slot(), Slot()]
        state = {"model": model, "optimizer": opt}
        copy_state(slots[0], self.rank, 2, state)      # device tensors: side-stream copies into the slot
        want = hashes(model, opt)
        train(model, opt, 1, seed=2)
        want_next = hashes(model, opt)
        copy_state(slots[1], self.rank, 3, state)      # the other slot; the first is kept
        train(model, opt, 1, seed=3)                                    # the live state moves on
        raw = self.comm.gather(bytes(slots[0].buf[:slots[0].nbytes]))
        if self.rank == 0:
            snaps = {r: decode(np.frombuffer(b, dtype=np.uint8)) for r, b in enumerate(raw)}
            write_snapshots(self.root / case, 2, snaps, self.world, TUNING, keep=3)
        self.comm.barrier()
        return self.check_load(case, want, want_next, layout)

    def survivors(self) -> list[str]:
        from coci_hpc.runtime.partner import RankState, capture
        from coci_hpc.runtime.survivors import write_checkpoint

        case = "survivors-plain"
        model, opt = self.trained("plain")
        state = {"model": model, "optimizer": opt}
        packed = self.comm.gather(capture(state, self.rank, 2).pack())
        want = hashes(model, opt)
        if self.rank == 0:
            per_rank = {r: RankState.unpack(b) for r, b in enumerate(packed)}
            write_checkpoint(self.root / case, 2, state, per_rank, self.world, TUNING, keep=3)
        self.comm.barrier()
        train(model, opt, 1, seed=2)
        return self.check_load(case, want, hashes(model, opt), "plain")

    def export(self, layout: str) -> list[str]:
        from coci_hpc.interop.export import export
        from coci_hpc.interop.pretrained import load_pretrained

        out = self.root / f"export-{layout}"
        if self.rank == 0:
            export(self.root / f"sync-{layout}", out, to="hf")
        self.comm.barrier()
        model, opt = self.trained(layout)
        want = hashes(model, None)
        fresh, _ = self.fresh(layout)
        load_pretrained(out, fresh)
        got = hashes(fresh, None)
        return diff({k: v for k, v in want.items() if k != "model/seen"},
                    {k: v for k, v in got.items() if k != "model/seen"})


def mixed(job: Job) -> dict[str, Any]:
    """Save, then load, a state with a DTensor whose local shard is on the meta device while its
    mesh is a CPU one (on a GPU: a CPU shard of a CUDA mesh's tensor). Both refused, naming it
    and its mesh (a meta shard is refused as having no memory, before the devices are compared)."""
    from torch.distributed.tensor import Shard

    from coci_hpc.errors import CheckpointError, UsageError

    mesh = init_device_mesh("cpu", (job.world,))
    odd = DTensor.from_local(torch.empty(3, 4, device="meta"), mesh, [Shard(0)], run_check=False)
    model, opt = job.trained("fsdp")
    out: dict[str, Any] = {}
    mgr = job.mgr("mixed")
    try:
        mgr.save(2, {"model": model, "extras": {"w": odd}})
        out["save"] = None
    except (CheckpointError, UsageError) as exc:
        out["save"] = str(exc)
    out["latest_after_save"] = mgr.latest_step()
    good = DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)], run_check=False)
    mgr.save(2, {"model": model, "optimizer": opt, "extras": {"w": good}})
    fresh, fresh_opt = job.fresh("fsdp")
    before = hashes(fresh, fresh_opt)
    try:
        mgr.load(2, {"model": fresh, "optimizer": fresh_opt, "extras": {"w": odd}})
        out["load"] = None
    except (CheckpointError, UsageError) as exc:
        out["load"] = str(exc)
    out["unchanged"] = hashes(fresh, fresh_opt) == before
    mgr.close()
    return out


def oom(job: Job) -> dict[str, Any]:
    """Load an FSDP2 checkpoint into a fresh FSDP2 model and optimizer on a device with too
    little free memory. Budgets: almost none (the fresh optimizer's moment targets, made while
    checking, do not fit: refused, naming a tensor, nothing changed); exactly those targets (the
    loaded moments go into them: it loads); none at all for the model alone (loaded into its own
    shards: it loads)."""
    from coci_hpc.checkpoint.dtensor import local_of
    from coci_hpc.errors import CheckpointError

    assert job.fake is not None, "the oom case needs the fake device"
    model, opt = job.trained("fsdp")
    mgr = job.mgr("oom")
    mgr.save(2, {"model": model, "optimizer": opt})
    want = hashes(model, opt)
    out: dict[str, Any] = {}
    for case in ("check", "install", "model-only"):
        fresh, fresh_opt = job.fresh("fsdp")
        before = hashes(fresh, fresh_opt)
        targets = 2 * sum(local_of(p).untyped_storage().nbytes() for p in fresh.parameters())  # Adam's moments
        # model-only: no device memory at all; a module's own shards are loaded into themselves
        job.fake.device_budget = {"check": 64, "install": targets, "model-only": 0}[case]
        got: dict[str, Any] = {}
        try:
            mgr.load(2, {"model": fresh} if case == "model-only" else {"model": fresh, "optimizer": fresh_opt})
            got["error"] = None
            got["loaded"] = hashes(fresh, None if case == "model-only" else fresh_opt) == (
                {k: v for k, v in want.items() if k.startswith("model/")} if case == "model-only" else want)
        except CheckpointError as exc:
            got["error"], got["hint"] = str(exc), exc.hint
        job.fake.device_budget = None
        got["unchanged"] = hashes(fresh, fresh_opt) == before
        got["has_optimizer_state"] = bool(fresh_opt.state)
        out[case] = got
    mgr.close()
    return out


def layouts(world: int) -> list[str]:
    return ["plain", "fsdp", "tp"] + (["hsdp"] if world >= 2 and world % 2 == 0 else [])


def main() -> int:
    global DEVICE
    mode, root = sys.argv[1], Path(sys.argv[2])
    if "--device" in sys.argv:
        DEVICE = sys.argv[sys.argv.index("--device") + 1]
    fake = None if "--no-fake" in sys.argv else DeviceBoundary()
    init_distributed(comm=Comm.world())
    job = Job(root, fake)
    result: dict[str, Any] = {"world": job.world, "cases": {}, "fake": fake is not None}
    with fake.installed() if fake is not None else contextlib.nullcontext():
        if mode == "matrix":
            only = [a for a in sys.argv[3:] if not a.startswith("--") and a != DEVICE]
            for layout in layouts(job.world):
                if only and layout not in only:
                    continue
                problems, want = job.sync(layout)
                result["cases"][f"sync-{layout}"] = problems
                if layout == "fsdp":
                    result["hashes"] = want
                result["cases"][f"async-{layout}"] = job.asave(layout)
                if layout == "plain":
                    result["cases"]["survivors-plain"] = job.survivors()
                else:
                    result["cases"][f"memtier-{layout}"] = job.memtier(layout)
                if layout in ("plain", "fsdp"):
                    result["cases"][f"export-{layout}"] = job.export(layout)
        elif mode == "load":
            layout = sys.argv[3]
            model, opt = job.fresh(layout)
            mgr = CheckpointManager(root / "sync-fsdp", comm=job.comm, keep=3)
            res = mgr.load_latest({"model": model, "optimizer": opt})
            mgr.close()
            result["step"], result["hashes"] = res.step, hashes(model, opt)
        elif mode == "oom":   # too little device memory for the loaded shards: refused, nothing changed
            result["errors"] = oom(job)
        elif mode == "mixed":   # one tensor's shards on another device than its mesh: refused, nothing changed
            result["errors"] = mixed(job)
        if fake is not None:
            result["crossings"] = dict(fake.crossings)
    if job.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
