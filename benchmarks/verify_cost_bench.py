"""What verify-on-load costs: cold loads of one checkpoint with the CRC-32C check (pass 1 of the
load, as shipped) and with it switched off; plus checksum speed on one core.

    python benchmarks/verify_cost_bench.py [--layers 6] [--rounds 4] [--dir /tmp] [--json]

The state is ``layers`` x Linear(4096, 4096) + Adam (~200 MB per layer). Each round loads once in
each mode, in turn, after ``echo 1 > /proc/sys/vm/drop_caches`` (root; else the page cache stays
warm and the script says so). Prints a table on stderr and JSON on stdout (medians).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def drop_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import numpy as np
    import torch

    from coci_hpc.checkpoint import CheckpointManager
    from coci_hpc.checkpoint.h5read import DatasetReader
    from coci_hpc.checkpoint.integrity import checksum

    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(args.layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    root = Path(tempfile.mkdtemp(prefix="coci-verify-bench-", dir=args.dir))
    try:
        mgr = CheckpointManager(root, comm=None)
        mgr.save(1, state)
        nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
        real = DatasetReader.verify
        # The load checks every shard first (pass 1), then copies the checked bytes into the
        # state (pass 2); "no check" skips pass 1 (the bytes are taken as checked).
        modes = {"checked (shipped)": real, "no check": lambda self, keys: None}
        times: dict[str, list[float]] = {m: [] for m in modes}
        cold = True
        for _ in range(args.rounds):
            for mode, verify in modes.items():
                DatasetReader.verify = verify  # type: ignore[method-assign]
                cold = drop_cache() and cold
                t0 = time.perf_counter()
                mgr.load(1, state)
                times[mode].append(time.perf_counter() - t0)
        DatasetReader.verify = real  # type: ignore[method-assign]
        mgr.close()
        buf = np.ones(1 << 28, np.uint8)
        speed = {}
        for alg in ("crc32c", "crc32"):
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                checksum(buf, alg)
                best = min(best, time.perf_counter() - t0)
            speed[alg] = buf.nbytes / best / 1e9
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"state {nbytes / 1e9:.2f} GB, {args.rounds} rounds, page cache "
          f"{'dropped' if cold else 'WARM (not root)'}; load seconds", file=sys.stderr)
    print(f"{'mode':<22} {'median':>7}  all", file=sys.stderr)
    for m, v in times.items():
        print(f"{m:<22} {med[m]:>7.3f}  {' '.join(f'{x:.3f}' for x in v)}", file=sys.stderr)
    print(f"checksum GB/s on one core (256 MiB, best of 3): crc32c {speed['crc32c']:.2f}, "
          f"zlib crc32 {speed['crc32']:.2f}", file=sys.stderr)
    if args.json:
        print(json.dumps({"state_bytes": nbytes, "cold": cold, "load_s": times, "median_s": med,
                          "checksum_gbps": speed}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
