"""Manifest size and save / load time of a tensor-parallel Rowwise state: format 4 (one shard
entry per DTensor box) against the code of another checkout (format 3: one entry per byte run).

    python benchmarks/box_manifest_bench.py                       # this checkout only
    python benchmarks/box_manifest_bench.py --base /tmp/old-tree  # A/B, interleaved, same run
    python benchmarks/box_manifest_bench.py --json                # one JSON object on stdout

The state: ``Linear(--cols, --rows)`` under ``parallelize_module(..., RowwiseParallel())`` on a
CPU mesh of 2 ranks (gloo): its weight is ``rows x cols``, ``Shard(1)``: each rank's box is one
contiguous run per row in the global dataset. After one Adam step the weight and its two
moments are three such tensors (3 x 2 x rows runs). Each round (``mpiexec -n 2``, per
checkout, the checkouts alternating) saves ``--repeats`` steps with ``CheckpointManager.save``
and loads the last one into a fresh model and optimizer with ``CheckpointManager.load``; times
are the slowest rank's between barriers, medians. Keys: ``manifest_bytes``, ``shard_entries``,
``save_s``, ``load_s`` per checkout, and ``manifest_bytes_ratio``, ``save_ratio``,
``load_ratio`` (this checkout / base) with ``--base``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from coci_hpc import init_distributed
    from coci_hpc.checkpoint import CheckpointManager
    from coci_hpc.comm import Comm

    torch.set_num_threads(1)
    comm = Comm.world()
    init_distributed(comm=comm)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Linear(args.cols, args.rows, bias=False)
        parallelize_module(m, mesh, RowwiseParallel())
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)

    model, opt = build()
    model(torch.randn(2, args.cols // dist.get_world_size())).pow(2).mean().backward()  # Rowwise: input split on its last dim
    opt.step()
    mgr = CheckpointManager(args.dir, comm=comm, keep=2)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        comm.barrier()
        return max(comm.allgather(time.perf_counter() - t0))

    saves = [timed(lambda s=s: mgr.save(s, {"model": model, "optimizer": opt})) for s in range(1, args.repeats + 1)]
    model2, opt2 = build()
    loads = [timed(lambda: mgr.load(args.repeats, {"model": model2, "optimizer": opt2})) for _ in range(args.repeats)]
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), model2.parameters()))
    if comm.rank == 0:
        step = sorted(p for p in Path(args.dir).iterdir() if p.name.startswith("step_"))[-1]
        man = json.loads((step / "manifest.json").read_text())
        print("RESULT " + json.dumps({
            "format_version": man["format_version"], "manifest_bytes": (step / "manifest.json").stat().st_size,
            "shard_entries": len(man["shards"]), "save_s": statistics.median(saves),
            "load_s": statistics.median(loads), "saves": saves, "loads": loads, "bit_exact": same}), flush=True)
    dist.destroy_process_group()


def run(tree: Path, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="coci-boxbench-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
        env["PYTHONPATH"] = str(tree)
        cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
               str(Path(__file__).resolve()), "--worker", "--dir", tmp, "--rows", str(args.rows),
               "--cols", str(args.cols), "--repeats", str(args.repeats)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, timeout=900)
        if p.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
        return json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs per checkout")
    ap.add_argument("--base", type=Path, help="another checkout (the code before) to compare with")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    trees = {"this": HERE, **({"base": args.base.resolve()} if args.base else {})}
    got: dict[str, list[dict]] = {k: [] for k in trees}
    for i in range(args.rounds):
        for name in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
            got[name].append(run(trees[name], args))
    out: dict = {"rows": args.rows, "cols": args.cols, "ranks": 2, "repeats": args.repeats, "rounds": args.rounds}
    for name, runs in got.items():
        out[name] = {"format_version": runs[0]["format_version"], "manifest_bytes": runs[0]["manifest_bytes"],
                     "shard_entries": runs[0]["shard_entries"], "bit_exact": all(r["bit_exact"] for r in runs),
                     "save_s": statistics.median(s for r in runs for s in r["saves"]),
                     "load_s": statistics.median(s for r in runs for s in r["loads"])}
    if args.base:
        for key in ("manifest_bytes", "save_s", "load_s"):
            out[f"{key.removesuffix('_s')}_ratio"] = out["this"][key] / out["base"][key]
    table = [f"{'checkout':<8} {'format':>6} {'manifest bytes':>15} {'shards':>7} {'save s':>8} {'load s':>8}"]
    for name in trees:
        r = out[name]
        table.append(f"{name:<8} {r['format_version']:>6} {r['manifest_bytes']:>15} {r['shard_entries']:>7} "
                     f"{r['save_s']:>8.3f} {r['load_s']:>8.3f}")
    print("\n".join(table), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
