"""Export / import benchmark: coci checkpoint -> hf / torch / dcp, against a raw read and DCP's own tools.

    python benchmarks/export_bench.py                      # ~1 GB of model weights
    python benchmarks/export_bench.py --size-mb 200 --json # iterate small; one JSON object on stdout

A checkpoint of ``--size-mb`` MB of float32 model weights (``--tensor-mb`` each) is saved by
coci under ``mpiexec -n --save-ranks`` (data parallel: replicated weights, each rank writes
1/N), and the same weights as a native DCP directory. Each measurement then runs in its own
Python process, with a cold page cache for the files it reads (drop_caches, else
fadvise DONTNEED), and reports its wall time and its peak resident memory above its resident
memory once its imports are done (``/proc/self/status`` VmHWM - VmRSS, the peak reset through
``/proc/self/clear_refs`` where the kernel allows):

* raw_read: the coci data file read sequentially into one 8 MiB buffer (the floor);
* export_hf (``--max-shard-size``, default 256MB), export_torch, export_dcp: ``coci_hpc.interop.export``;
* dcp_to_torch_save: DCP's own converter of the native DCP directory (holds the whole model);
* raw_read_hf + import_hf: ``load_pretrained`` of the hf export into preallocated tensors;
* dcp_native_load vs dcp_reader_load: ``dcp.load`` of the same preallocated state dict from the
  native DCP directory and from the coci checkpoint through ``CociStorageReader``.

Keys (goals from issue 24): export_hf_vs_raw_read, export_peak_extra_rss_over_checkpoint
(<= 0.35 at 1 GB with 256MB shards), import_hf_vs_raw_read, dcp_reader_load_vs_dcp_native (<= 1.2).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def drop_cache(paths: list[Path]) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for p in paths:
        for f in ([p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------ setup
def weights(size_mb: int, tensor_mb: int) -> dict:
    import torch

    n = max(1, size_mb // tensor_mb)
    rows = tensor_mb * (1 << 20) // 4 // 1024
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(n)}


def save_worker(args: argparse.Namespace) -> None:
    from coci_hpc.checkpoint import CheckpointManager

    mgr = CheckpointManager(args.dir, keep=1, rng=False)
    mgr.save(1, {"model": weights(args.size_mb, args.tensor_mb)})
    mgr.close()


def setup(work: Path, args: argparse.Namespace) -> dict:
    coci = work / "coci"
    cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(args.save_ranks), sys.executable,
           "-m", "mpi4py", __file__, "--save-worker", "--dir", str(coci), "--size-mb", str(args.size_mb),
           "--tensor-mb", str(args.tensor_mb)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    import torch.distributed.checkpoint as dcp

    dcp.save(weights(args.size_mb, args.tensor_mb), checkpoint_id=str(work / "dcp_native"), no_dist=True)
    data = next(coci.glob("step_*")) / "data.h5"
    return {"coci": str(coci), "data": str(data), "dcp_native": str(work / "dcp_native"),
            "bytes": sum(t.numel() * 4 for t in weights(args.size_mb, args.tensor_mb).values())}


# ------------------------------------------------------------------------------ measurements
def measure(name: str, paths: dict, work: Path, args: argparse.Namespace) -> dict:
    """Run one measurement in this (fresh) process; imports first, then the baseline RSS."""
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from coci_hpc.interop.dcp_reader import CociStorageReader
    from coci_hpc.interop.export import export
    from coci_hpc.interop.pretrained import load_pretrained

    target = None
    if name in ("import_hf", "dcp_native_load", "dcp_reader_load"):
        target = {k: torch.zeros_like(v) for k, v in weights(args.size_mb, args.tensor_mb).items()}
    reads = {"raw_read": [Path(paths["data"])], "raw_read_hf": [work / "hf"], "import_hf": [work / "hf"],
             "dcp_to_torch_save": [Path(paths["dcp_native"])], "dcp_native_load": [Path(paths["dcp_native"])]}
    cache = drop_cache(reads.get(name, [Path(paths["data"])]))
    peak_reset = reset_peak()
    base = status_kb("VmRSS")
    out = work / f"out_{name}"
    t0 = time.perf_counter()
    if name in ("raw_read", "raw_read_hf"):
        buf = np.empty(8 << 20, dtype=np.uint8)
        files = [Path(paths["data"])] if name == "raw_read" else sorted((work / "hf").glob("*.safetensors"))
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(memoryview(buf)):
                    pass
    elif name.startswith("export_"):
        export(paths["coci"], out, to=name.split("_", 1)[1], max_shard_size=args.max_shard_size)
    elif name == "dcp_to_torch_save":
        dcp_to_torch_save(paths["dcp_native"], out)
    elif name == "import_hf":
        load_pretrained(work / "hf", target)
    elif name == "dcp_native_load":
        dcp.load(target, checkpoint_id=paths["dcp_native"], no_dist=True)
    elif name == "dcp_reader_load":
        dcp.load(target, storage_reader=CociStorageReader(paths["coci"]), no_dist=True)
    else:
        raise SystemExit(f"unknown measurement {name}")
    seconds = time.perf_counter() - t0
    peak = status_kb("VmHWM")
    return {"seconds": seconds, "peak_extra_bytes": max(0, peak - base) * 1024, "cache": cache,
            "peak_reset": peak_reset}


ORDER = ["raw_read", "export_hf", "export_torch", "export_dcp", "dcp_to_torch_save", "raw_read_hf",
         "import_hf", "dcp_native_load", "dcp_reader_load"]


def run_one(name: str, paths: dict, work: Path, args: argparse.Namespace) -> dict:
    out = work / f"out_{name}"
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    cmd = [sys.executable, __file__, "--measure", name, "--paths", json.dumps(paths), "--work", str(work),
           "--size-mb", str(args.size_mb), "--tensor-mb", str(args.tensor_mb),
           "--max-shard-size", args.max_shard_size]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"{name} failed:\n{p.stdout}\n{p.stderr}")
    if name == "export_hf":   # the import measurement reads this export
        if (work / "hf").exists():
            shutil.rmtree(work / "hf")
        out.rename(work / "hf")
    elif out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    return json.loads(p.stdout.strip().splitlines()[-1])


def table(doc: dict) -> str:
    r = doc["runs"]
    size = doc["checkpoint_bytes"]
    lines = [f"checkpoint {size / 1e9:.2f} GB of fp32 weights, saved by {doc['save_ranks']} rank(s); "
             f"hf shards {doc['max_shard_size']}; page cache: {doc['page_cache']}",
             f"{'measurement':<20} {'seconds':>8} {'GB/s':>6} {'peak extra RSS':>15} {'/ ckpt':>7}"]
    for name in [n for n in ORDER if n in r]:
        m = r[name]
        lines.append(f"{name:<20} {m['seconds']:>8.2f} {size / 1e9 / m['seconds']:>6.2f} "
                     f"{m['peak_extra_bytes'] / 2**20:>11.0f} MiB {m['peak_extra_bytes'] / size:>7.2f}")
    lines.append("ratios: " + ", ".join(f"{k} {v}" for k, v in doc.items() if isinstance(v, float)))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="model weights in MB (float32)")
    ap.add_argument("--tensor-mb", type=int, default=32, help="size of each weight tensor")
    ap.add_argument("--max-shard-size", default="256MB")
    ap.add_argument("--save-ranks", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    ap.add_argument("--only", default=None, help="comma-separated measurements (default: all); the "
                    "ratios need their baselines, e.g. --only dcp_native_load,dcp_reader_load")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--paths", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.save_worker:
        save_worker(args)
        return 0
    if args.measure:
        print(json.dumps(measure(args.measure, json.loads(args.paths), Path(args.work), args)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="coci-export-bench-", dir=args.dir))
    t_start = time.perf_counter()
    try:
        paths = setup(work, args)
        wanted = ORDER if not args.only else [n for n in ORDER if n in args.only.split(",")]
        runs = {name: run_one(name, paths, work, args) for name in wanted}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = paths["bytes"]

    def ratio(a: str, b: str) -> float | None:
        if a not in runs or b not in runs:
            return None
        return round(runs[a]["seconds"] / runs[b]["seconds"], 3)

    def rss(a: str) -> float | None:
        return round(runs[a]["peak_extra_bytes"] / size, 3) if a in runs else None

    doc = {
        "export_hf_vs_raw_read": ratio("export_hf", "raw_read"),
        "export_peak_extra_rss_over_checkpoint": rss("export_hf"),
        "import_hf_vs_raw_read": ratio("import_hf", "raw_read_hf"),
        "dcp_reader_load_vs_dcp_native": ratio("dcp_reader_load", "dcp_native_load"),
        "export_torch_vs_raw_read": ratio("export_torch", "raw_read"),
        "export_dcp_vs_raw_read": ratio("export_dcp", "raw_read"),
        "dcp_to_torch_save_vs_raw_read": ratio("dcp_to_torch_save", "raw_read"),
        "export_torch_peak_extra_rss_over_checkpoint": rss("export_torch"),
        "import_hf_peak_extra_rss_over_checkpoint": rss("import_hf"),
        "dcp_to_torch_save_peak_extra_rss_over_checkpoint": rss("dcp_to_torch_save"),
        "checkpoint_bytes": size, "save_ranks": args.save_ranks, "max_shard_size": args.max_shard_size,
        "page_cache": next(iter(runs.values()))["cache"], "peak_reset": next(iter(runs.values()))["peak_reset"],
        "elapsed_s": round(time.perf_counter() - t_start, 1), "runs": runs,
    }
    if args.json:
        print(table(doc), file=sys.stderr)
        print(json.dumps(doc))
    else:
        print(table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
