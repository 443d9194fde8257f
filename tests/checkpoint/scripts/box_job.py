"""Subprocess driver for the compact (format 4) box shards of column-sharded DTensors.

Run under ``mpiexec -n N``. The model and training of :mod:`dtensor_job`, with 8 rows so that
tensor parallel trains on 2 ranks (fc2 is RowwiseParallel: Shard(1), a column-sharded box,
one run per row in the file):

    box_job.py save DIR LAYOUT STEP     train STEP Adam steps, save at STEP; print RESULT
    box_job.py load DIR LAYOUT          fresh model + optimizer, load_latest; print RESULT

RESULT (rank 0): sha256 of every full tensor (gathered with full_tensor()) and the loaded step.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from dtensor_job import build, hashes, train  # noqa: E402

from coci_hpc import init_distributed  # noqa: E402
from coci_hpc.checkpoint import CheckpointManager  # noqa: E402
from coci_hpc.comm import Comm  # noqa: E402

ROWS = 8


def main() -> int:
    mode, root, layout = sys.argv[1], sys.argv[2], sys.argv[3]
    comm = Comm.world()
    init_distributed(comm=comm)
    world = dist.get_world_size()
    mgr = CheckpointManager(root, comm=comm, keep=5)
    result: dict[str, Any] = {"world": world}
    model, opt = build(layout, world, rows=ROWS)
    if mode == "save":
        step = int(sys.argv[4])
        train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
        result["hashes"] = hashes(model, opt)
        result["step"] = step
    else:
        res = mgr.load_latest({"model": model, "optimizer": opt})
        result["step"] = res.step
        result["hashes"] = hashes(model, opt)
    if comm.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
