"""State builders shared by the checkpoint tests and their subprocess scripts."""
from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint import PerRank, Sharded
from coci_hpc.runtime.data import ResumableSampler


class Net(torch.nn.Module):
    def __init__(self, d: int = 32, h: int = 64) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d, h)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(h, 4)
        self.register_buffer("bf16", torch.zeros(3, 5, dtype=torch.bfloat16))
        self.register_buffer("mask", torch.zeros(7, dtype=torch.bool))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def rows_of(rank: int, world: int, total: int = 10) -> range:
    parts = np.array_split(np.arange(total), world)
    return range(int(parts[rank][0]), int(parts[rank][-1]) + 1) if len(parts[rank]) else range(0)


def full_state(seed: int, rank: int = 0, world: int = 1, train_steps: int = 3, big: int = 0) -> dict[str, Any]:
    """Every kind of state: model (fp32, bf16, bool, int64), Adam, LR scheduler, grad scaler,
    sampler, planner state, extras (tuples, int keys, inf, numpy), a sharded and a per-rank value.
    ``big`` adds a float32 parameter of that many elements (to exercise overlapped snapshots)."""
    torch.manual_seed(seed)
    model = Net()
    if big:
        model.register_parameter("big", torch.nn.Parameter(torch.randn(big)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    for _ in range(train_steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 32)).pow(2).mean() + (model.big.sum() * 1e-3 if big else 0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    with torch.no_grad():
        model.bf16.copy_(torch.randn(3, 5).to(torch.bfloat16))
        model.mask.copy_(torch.rand(7) > 0.5)
        model.count.fill_(seed + 41)
    sampler = ResumableSampler(100, seed=seed, rank=rank, world_size=world)
    sampler.next_batch(5)
    gen = torch.Generator().manual_seed(seed + 7)
    sharded_global = torch.randn(10, 3, generator=gen, dtype=torch.float64)
    rows = rows_of(rank, world)
    return {
        "model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "loader": sampler,
        "planner": {"theta": [0.5, -1.25], "lambda_per_min": 0.00417, "next": None},
        "extras": {"name": "run", "pair": (1, (2.5, "x")), "by_int": {3: "three", 10: [1, 2]},
                   "inf": float("inf"), "arr": np.arange(6, dtype=np.int32).reshape(2, 3) + seed,
                   "emb": Sharded(sharded_global[rows.start:rows.stop].clone())},
        "mine": PerRank({"rank": rank, "vec": torch.full((4,), float(rank + seed))}),
    }


def empty_state(rank: int = 0, world: int = 1, big: int = 0) -> dict[str, Any]:
    """A state of the same structure with different values, to load into."""
    s = full_state(999, rank, world, train_steps=1, big=big)
    s["extras"] = {"emb": Sharded(torch.zeros(len(rows_of(rank, world)), 3, dtype=torch.float64))}
    s["planner"] = {}
    s["mine"] = PerRank({})
    return s


def _bytes(t: Any) -> bytes:
    if isinstance(t, Sharded):
        t = t.local
    if isinstance(t, torch.Tensor):
        t = t.detach().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.numpy().tobytes()
    if isinstance(t, np.ndarray):
        return str(t.dtype).encode() + str(t.shape).encode() + t.tobytes()
    return repr(t).encode()


def canonical(tree: Any) -> Any:
    """A comparable form of a state tree with tensors replaced by their exact bytes."""
    if hasattr(tree, "state_dict") and not isinstance(tree, (dict, torch.Tensor)):
        tree = tree.state_dict()
    if isinstance(tree, PerRank):
        return ("PerRank", canonical(tree.value))
    if isinstance(tree, dict):
        return {k: canonical(v) for k, v in sorted(tree.items(), key=lambda kv: str(kv[0]))}
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, [canonical(v) for v in tree])
    if isinstance(tree, (torch.Tensor, np.ndarray, Sharded)):
        return hashlib.sha256(_bytes(tree)).hexdigest()
    return (type(tree).__name__, repr(tree))


def replicated_hash(state: dict[str, Any]) -> str:
    keep = {k: v for k, v in state.items() if k not in ("mine",)}
    extras = dict(keep["extras"])
    extras.pop("emb", None)
    keep["extras"] = extras
    keep.pop("loader")  # per-rank position differs by construction; compared separately
    return hashlib.sha256(repr(canonical(keep)).encode()).hexdigest()


def rng_draws() -> tuple:
    return (random.random(), float(np.random.random()), torch.rand(3).tolist())


def flip_shard_byte(root: Path, step: int, which: Callable[[str], bool], rank: int, at: int, mask: int) -> None:
    """XOR ``mask`` into byte ``at`` of the shard ``rank`` wrote of the first tensor of committed
    step ``step`` whose name ``which`` accepts (its CRC in the manifest no longer matches)."""
    from coci_hpc.checkpoint import catalog as cat
    from coci_hpc.checkpoint import manifest as mf

    m = cat.read_step(root, step)
    t = next(t for t in m["tensors"] if which(t["name"]))
    sh = next(s for s in m["shards"] if s["dataset"] == t["dataset"] and s["rank"] == rank)
    with open(cat.step_dir(root, step) / mf.DATA_FILE, "r+b") as f:
        f.seek(t["offset"] + sh["start"] + at)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ mask]))
