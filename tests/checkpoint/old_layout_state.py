"""The state stored in tests/fixtures/ckpt_v2_per_rank_datasets (format 2: one HDF5 dataset per
rank and per-rank leaf, ``rank00000/...``), written on 2 ranks by the code before per-rank state
was packed (commit 90721d3), with:

    mpiexec -n 2 python -m tests.checkpoint.old_layout_state OUTDIR

Old checkpoints must keep loading, so the fixture is committed rather than regenerated.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from coci_hpc.checkpoint import PerRank, Sharded

ROWS = (3, 2)  # the sharded tensor's rows on each of the 2 saving ranks


def old_state(rank: int, world: int = 2) -> dict[str, Any]:
    """Rank ``rank``'s state as saved; ``world`` other than 2 reshards the Sharded rows."""
    rows = torch.arange(15, dtype=torch.float64).reshape(5, 3)
    split = ROWS if world == 2 else tuple(len(p) for p in torch.arange(5).tensor_split(world))
    lo = sum(split[:rank])
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                  "b": torch.tensor([1.5], dtype=torch.float32)},
        "mine": PerRank({"v": torch.full((rank + 2,), rank, dtype=torch.int64),
                         "s": torch.tensor(rank * 1.0 + 0.5)}),
        "rows": Sharded(rows[lo:lo + split[rank]].clone()),
        "step": 9,
    }


if __name__ == "__main__":
    from coci_hpc.checkpoint import CheckpointManager
    from coci_hpc.comm import Comm

    comm = Comm.world()
    mgr = CheckpointManager(sys.argv[1], comm=comm, rng=False, backend="serial")
    mgr.save(9, old_state(comm.rank, comm.size))
    mgr.close()
