"""Export / import benchmark: coci checkpoint -> hf / torch / dcp, against a raw read and DCP's own tools.

    python benchmarks/export_bench.py                      # ~1 GB of model weights
    python benchmarks/export_bench.py --size-mb 200 --json # iterate small; one JSON object on stdout
    python benchmarks/export_bench.py --layout fsdp2       # the checkpoint saved by an FSDP2 model
    python benchmarks/export_bench.py --layout ddp,fsdp2   # both, one after the other

A checkpoint of ``--size-mb`` MB of float32 model weights (``--tensor-mb`` each) is saved by
coci under ``mpiexec -n --save-ranks``, in one or both ``--layout``s:

* ddp: data parallel, replicated weights (each rank writes 1/N); the same weights saved as a
  native DCP directory by one process (``dcp.save(no_dist=True)``);
* fsdp2: the same weights in a model wrapped with ``fully_shard`` on a CPU mesh (gloo), every
  weight a DTensor sharded on dim 0 (each rank writes its rows); the same state saved as a
  native DCP directory by the same ranks (``dcp.save(model.state_dict())``).

Method (:mod:`benchmarks.method`): one warm-up round of every measurement, kept apart as the cold
figure (``seconds_cold``), then ``--repeats`` (>= 7) timed rounds in rotating order; ``seconds`` is
their median, with ``seconds_min`` / ``seconds_max`` beside it. Each measurement runs in its own
Python process, with a cold page cache for the files it reads (those files evicted: fsync +
fadvise DONTNEED, :func:`benchmarks.method.evict`; a global drop_caches before 2026-11-29), and
reports its wall time and its peak resident memory above its resident memory once its imports
are done (``/proc/self/status`` VmHWM - VmRSS, the peak reset through
``/proc/self/clear_refs`` where the kernel allows). Since 2026-12-03 each measurement's eviction
is followed by a settle of the VM and a scratch file's page cache freed
(:func:`benchmarks.method.ready_cold_read`, 1.25 x the checkpoint's bytes; ``warm_s`` in the JSON),
as in the DDP and sharded benchmarks: on this VM a read filled its page cache twice as fast
from memory freed moments before it, and which reader got it depended on what ran before;
``--no-warm`` for the eviction alone:

* raw_read: the coci data file read sequentially into one 8 MiB buffer (the floor);
* raw_copy (since 2026-12-03): the same file copied into a new one, read and written as the hf
  export does it (:func:`raw_copy`: pipelined, ``O_DIRECT``, fsync): the floor of any export on
  this disk (``copy_floor_vs_raw_read``, ``export_hf_vs_copy_floor``);
* export_hf (``--max-shard-size``, default 256MB), export_torch, export_dcp: ``coci_hpc.interop.export``;
* dcp_to_torch_save: DCP's own converter of the native DCP directory (holds the whole model);
* raw_read_hf + import_hf: ``load_pretrained`` of the hf export into preallocated tensors;
* dcp_native_load vs dcp_reader_load: ``dcp.load`` of the same preallocated state dict from the
  native DCP directory and from the coci checkpoint through ``CociStorageReader``.

With fsdp2, import_hf, dcp_native_load and dcp_reader_load load into the FSDP2 model itself, on
``--save-ranks`` ranks under mpiexec (each rank reads its rows): the slowest rank's time between
barriers, the largest rank's peak extra RSS. The raw reads and the exports stay one process.
The JSON has the ddp keys at the top level (unchanged) and each fsdp2 key in the object
``"fsdp2"`` (with the layout's own ``runs``).

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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from benchmarks.method import MIN_ROUNDS, ready_cold_read, rotate, summary  # noqa: E402


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
def shapes(size_mb: int, tensor_mb: int) -> list[tuple[int, int]]:
    n = max(1, size_mb // tensor_mb)
    rows = tensor_mb * (1 << 20) // 4 // 1024
    return [(rows, 1024)] * n


def weights(size_mb: int, tensor_mb: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(*shape, generator=g)
            for i, shape in enumerate(shapes(size_mb, tensor_mb))}


def fsdp2_model(size_mb: int, tensor_mb: int, fill: bool) -> Any:
    """The benchmark's weights as ``layers.<i>.weight`` of bias-free Linears, each its own FSDP2
    unit on a CPU mesh over the world (gloo must be up). ``fill``: the values of ``weights()``
    (generated one tensor at a time, so a rank holds one full model at most), else zeros."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    sh = shapes(size_mb, tensor_mb)
    with torch.device("meta"):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList(torch.nn.Linear(c, r, bias=False) for r, c in sh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer, shape in zip(model.layers, sh):
            if fill:   # the same stream as weights(): same values, same order
                layer.weight.copy_(torch.randn(*shape, generator=g))
            else:
                layer.weight.zero_()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def save_worker(args: argparse.Namespace) -> None:
    from coci_hpc.checkpoint import CheckpointManager

    if args.layout == "ddp":
        mgr = CheckpointManager(args.dir, keep=1, rng=False)
        mgr.save(1, {"model": weights(args.size_mb, args.tensor_mb)})
        mgr.close()
        return
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from coci_hpc.runtime.distributed import init_distributed

    torch.set_num_threads(1)
    init_distributed("gloo")
    model = fsdp2_model(args.size_mb, args.tensor_mb, fill=True)
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())
    mgr = CheckpointManager(args.dir, keep=1, rng=False)
    mgr.save(1, {"model": model})
    mgr.close()
    dcp.save(model.state_dict(), checkpoint_id=args.dcp_dir)
    dist.destroy_process_group()


def setup(work: Path, args: argparse.Namespace, layout: str) -> dict:
    coci, dcp_native = work / "coci", work / "dcp_native"
    cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(args.save_ranks),
           sys.executable, "-m", "mpi4py", __file__, "--save-worker", "--layout", layout, "--dir", str(coci),
           "--dcp-dir", str(dcp_native), "--size-mb", str(args.size_mb), "--tensor-mb", str(args.tensor_mb)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"save ({layout}) failed:\n{p.stdout}\n{p.stderr}")
    if layout == "ddp":
        import torch.distributed.checkpoint as dcp

        dcp.save(weights(args.size_mb, args.tensor_mb), checkpoint_id=str(dcp_native), no_dist=True)
    data = next(coci.glob("step_*")) / "data.h5"
    return {"coci": str(coci), "data": str(data), "dcp_native": str(dcp_native),
            "bytes": sum(r * c * 4 for r, c in shapes(args.size_mb, args.tensor_mb))}


# ------------------------------------------------------------------------------ measurements
def raw_copy(src: Path, dst: Path, window: int = 64 << 20) -> None:
    """The floor of an export: the coci data file's bytes copied into a new file as the hf export
    writes its shards (two reused page-aligned buffers, a helper thread reading the next window
    while this one writes the last with ``O_DIRECT``, then ``fsync``), without format or checksum.
    An export must read every byte and write it again; on a disk that does not read and write at
    full speed at once this costs more than the raw read alone, which is the export goal's
    baseline."""
    from concurrent.futures import ThreadPoolExecutor

    from coci_hpc.checkpoint.rawio import aligned_empty, open_direct, pread_into, pwrite_pages

    size = src.stat().st_size
    bufs = (aligned_empty(window), aligned_empty(window))
    rfd = os.open(src, os.O_RDONLY)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    dfd = open_direct(dst)

    def read(i: int) -> Any:
        view = bufs[i % 2][:min(window, size - i * window)]
        pread_into(rfd, view, i * window)
        return view

    try:
        with ThreadPoolExecutor(1) as reader:
            n = -(-size // window)
            pending = reader.submit(read, 0) if n else None
            for i in range(n):
                assert pending is not None
                view = pending.result()
                pending = reader.submit(read, i + 1) if i + 1 < n else None
                dfd = pwrite_pages(fd, dfd, view, i * window)
        os.fsync(fd)
    finally:
        os.close(rfd)
        os.close(fd)
        if dfd is not None:
            os.close(dfd)


def measure(name: str, paths: dict, work: Path, args: argparse.Namespace) -> dict | None:
    """Run one measurement in this (fresh) process; imports first, then the baseline RSS."""
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.tensor import DTensor

    from coci_hpc.interop.dcp_reader import CociStorageReader
    from coci_hpc.interop.export import export
    from coci_hpc.interop.pretrained import load_pretrained, target_tensors

    sharded = args.layout == "fsdp2" and name in SHARDED_LOADS
    target: Any = None
    if sharded:   # one of --save-ranks ranks under mpiexec: the FSDP2 model is the target
        import torch.distributed as dist

        from coci_hpc.runtime.distributed import init_distributed

        torch.set_num_threads(1)
        init_distributed("gloo")
        model = fsdp2_model(args.size_mb, args.tensor_mb, fill=False)
        target = model if name == "import_hf" else model.state_dict()
    elif name in SHARDED_LOADS:
        target = {f"layers.{i}.weight": torch.zeros(*shape) for i, shape in enumerate(shapes(args.size_mb, args.tensor_mb))}
    reads = {"raw_read": [Path(paths["data"])], "raw_read_hf": [work / "hf"], "import_hf": [work / "hf"],
             "dcp_to_torch_save": [Path(paths["dcp_native"])], "dcp_native_load": [Path(paths["dcp_native"])]}
    # since 2026-12-03 (as checkpoint_bench, sharded_bench): the files evicted, the VM settled
    # and a scratch file's page cache freed, so that every measurement fills its page cache from
    # the same freshly freed memory (--no-warm: the eviction alone, as before)
    cold = {"settle": args.warm, "warm": args.warm, "scratch": work, "nbytes": int(1.25 * paths["bytes"])}
    warmed = 0.0
    if sharded:
        cache, _, warmed = (ready_cold_read(reads.get(name, [Path(paths["data"])]), **cold)
                            if dist.get_rank() == 0 else ("", 0.0, 0.0))
        dist.barrier()
    else:
        cache, _, warmed = ready_cold_read(reads.get(name, [Path(paths["data"])]), **cold)
    peak_reset = reset_peak()
    base = status_kb("VmRSS")
    out = work / f"out_{name}"
    if sharded:
        dist.barrier()
    t0 = time.perf_counter()
    if name in ("raw_read", "raw_read_hf"):
        buf = np.empty(8 << 20, dtype=np.uint8)
        files = [Path(paths["data"])] if name == "raw_read" else sorted((work / "hf").glob("*.safetensors"))
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(memoryview(buf)):
                    pass
    elif name == "raw_copy":
        raw_copy(Path(paths["data"]), out)
    elif name.startswith("export_"):
        export(paths["coci"], out, to=name.split("_", 1)[1], max_shard_size=args.max_shard_size)
    elif name == "dcp_to_torch_save":
        dcp_to_torch_save(paths["dcp_native"], out)
    elif name == "import_hf":
        load_pretrained(work / "hf", target)
    elif name == "dcp_native_load":
        dcp.load(target, checkpoint_id=paths["dcp_native"], no_dist=not sharded)
    elif name == "dcp_reader_load":
        dcp.load(target, storage_reader=CociStorageReader(paths["coci"]), no_dist=not sharded)
    else:
        raise SystemExit(f"unknown measurement {name}")
    seconds = time.perf_counter() - t0
    peak = status_kb("VmHWM")
    if target is not None:   # after the clock: a load that filled nothing is no measurement
        local = [t.to_local() if isinstance(t, DTensor) else t for t in target_tensors(target).values()]
        if not local or any(not bool(t.any()) for t in local):
            raise SystemExit(f"{name}: a target tensor is still all zeros after the load")
    out = {"seconds": seconds, "peak_extra_bytes": max(0, peak - base) * 1024, "cache": cache,
           "peak_reset": peak_reset, "warm_s": round(warmed, 3)}
    if sharded:   # the slowest rank's time, the largest rank's peak (each is one of the ranks)
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, out)
        rank = dist.get_rank()
        dist.destroy_process_group()
        out = {"seconds": max(r["seconds"] for r in ranks),
               "peak_extra_bytes": max(r["peak_extra_bytes"] for r in ranks), "cache": ranks[0]["cache"],
               "peak_reset": all(r["peak_reset"] for r in ranks), "warm_s": ranks[0]["warm_s"], "ranks": len(ranks),
               "rank_seconds": [round(r["seconds"], 3) for r in ranks]}
        if rank != 0:
            return None
    return out


LAYOUTS = ("ddp", "fsdp2")
# measurements that load into preallocated targets: with fsdp2 into the FSDP2 model, on its ranks
SHARDED_LOADS = ("import_hf", "dcp_native_load", "dcp_reader_load")
ORDER = ["raw_read", "raw_copy", "export_hf", "export_torch", "export_dcp", "dcp_to_torch_save", "raw_read_hf",
         "import_hf", "dcp_native_load", "dcp_reader_load"]


def run_one(name: str, paths: dict, work: Path, args: argparse.Namespace, layout: str) -> dict:
    out = work / f"out_{name}"
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    cmd = [sys.executable, __file__, "--measure", name, "--paths", json.dumps(paths), "--work", str(work),
           "--size-mb", str(args.size_mb), "--tensor-mb", str(args.tensor_mb),
           "--max-shard-size", args.max_shard_size, "--layout", layout] + ([] if args.warm else ["--no-warm"])
    if layout == "fsdp2" and name in SHARDED_LOADS:
        cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n",
               str(args.save_ranks), cmd[0], "-m", "mpi4py", *cmd[1:]]
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
    lines = [f"[{doc['layout']}] checkpoint {size / 1e9:.2f} GB of fp32 weights, saved by {doc['save_ranks']} rank(s); "
             f"hf shards {doc['max_shard_size']}; page cache: {doc['page_cache']}; seconds: median of "
             f"{doc['repeats']} rounds after a warm-up [min-max] (cold = the warm-up round)",
             f"{'measurement':<20} {'seconds':>8} {'min-max':>12} {'cold':>6} {'GB/s':>6} {'peak extra RSS':>15} "
             f"{'/ ckpt':>7}"]
    for name in [n for n in ORDER if n in r]:
        m = r[name]
        lines.append(f"{name:<20} {m['seconds']:>8.2f} {m.get('seconds_min', m['seconds']):>5.2f}-"
                     f"{m.get('seconds_max', m['seconds']):<6.2f} {m.get('seconds_cold', m['seconds']):>6.2f} "
                     f"{size / 1e9 / m['seconds']:>6.2f} "
                     f"{m['peak_extra_bytes'] / 2**20:>11.0f} MiB {m['peak_extra_bytes'] / size:>7.2f}")
    lines.append("ratios: " + ", ".join(f"{k} {v}" for k, v in doc.items() if isinstance(v, float)))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="model weights in MB (float32)")
    ap.add_argument("--tensor-mb", type=int, default=32, help="size of each weight tensor")
    ap.add_argument("--max-shard-size", default="256MB")
    ap.add_argument("--repeats", type=int, default=MIN_ROUNDS,
                    help=f"timed rounds after the warm-up round (a ratio is their median; >= {MIN_ROUNDS})")
    ap.add_argument("--save-ranks", type=int, default=2)
    ap.add_argument("--layout", default="ddp", help="ddp, fsdp2 or ddp,fsdp2: the model layout that saves "
                    "the checkpoint (fsdp2: the loads also run on --save-ranks ranks into the FSDP2 model)")
    ap.add_argument("--dcp-dir", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    ap.add_argument("--only", default=None, help="comma-separated measurements (default: all); the "
                    "ratios need their baselines, e.g. --only dcp_native_load,dcp_reader_load")
    ap.add_argument("--no-warm", dest="warm", action="store_false",
                    help="before each measurement evict its files only (the method before 2026-12-03): no "
                         "settle, no scratch file's freed page cache")
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
        res = measure(args.measure, json.loads(args.paths), Path(args.work), args)
        if res is not None:   # under mpiexec, rank 0 alone reports
            print(json.dumps(res))
        return 0

    layouts = args.layout.split(",")
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        ap.error(f"--layout: unknown layout(s) {bad}; choose from {', '.join(LAYOUTS)} (comma-separated)")
    t_start = time.perf_counter()
    docs = {layout: bench_layout(layout, args) for layout in layouts}
    doc: dict[str, Any] = dict(docs["ddp"]) if "ddp" in docs else {}
    doc.update({layout: d for layout, d in docs.items() if layout != "ddp"})
    doc.update({"layouts": layouts, "elapsed_s": round(time.perf_counter() - t_start, 1)})
    text = "\n\n".join(table(d) for d in docs.values())
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(doc))
    else:
        print(text)
    return 0


def bench_layout(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"coci-export-bench-{layout}-", dir=args.dir))
    t_start = time.perf_counter()
    try:
        paths = setup(work, args, layout)
        wanted = ORDER if not args.only else [n for n in ORDER if n in args.only.split(",")]
        # round 0 in ORDER (export_hf before the hf reads: they read its export), kept apart as
        # the cold figure; then --repeats timed rounds, the order rotating (benchmarks.method)
        rounds = [{name: run_one(name, paths, work, args, layout) for name in order}
                  for order in [wanted] + [rotate(wanted, k + 1) for k in range(args.repeats)]]
        runs = {}
        for name in wanted:
            timed = [r[name] for r in rounds[1:]] or [rounds[0][name]]
            secs = [r["seconds"] for r in timed]
            runs[name] = {**timed[0],
                          **summary({"seconds": secs, "peak_extra_bytes": [r["peak_extra_bytes"] for r in timed]},
                                    {"seconds": rounds[0][name]["seconds"]}),
                          "samples": [round(x, 4) for x in secs]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = paths["bytes"]

    def ratio(a: str, b: str) -> float | None:
        if a not in runs or b not in runs:
            return None
        return round(runs[a]["seconds"] / runs[b]["seconds"], 3)

    def rss(a: str) -> float | None:
        return round(runs[a]["peak_extra_bytes"] / size, 3) if a in runs else None

    return {
        "export_hf_vs_raw_read": ratio("export_hf", "raw_read"),
        # the floor of any export on this disk (read + write of the same bytes, pipelined), and
        # the export against it (since 2026-12-03, X15)
        "copy_floor_vs_raw_read": ratio("raw_copy", "raw_read"),
        "export_hf_vs_copy_floor": ratio("export_hf", "raw_copy"),
        "export_peak_extra_rss_over_checkpoint": rss("export_hf"),
        "import_hf_vs_raw_read": ratio("import_hf", "raw_read_hf"),
        "dcp_reader_load_vs_dcp_native": ratio("dcp_reader_load", "dcp_native_load"),
        "export_torch_vs_raw_read": ratio("export_torch", "raw_read"),
        "export_dcp_vs_raw_read": ratio("export_dcp", "raw_read"),
        "dcp_to_torch_save_vs_raw_read": ratio("dcp_to_torch_save", "raw_read"),
        "export_torch_peak_extra_rss_over_checkpoint": rss("export_torch"),
        "import_hf_peak_extra_rss_over_checkpoint": rss("import_hf"),
        "dcp_to_torch_save_peak_extra_rss_over_checkpoint": rss("dcp_to_torch_save"),
        "checkpoint_bytes": size, "warm": args.warm, "layout": layout, "save_ranks": args.save_ranks, "repeats": args.repeats,
        "max_shard_size": args.max_shard_size,
        "page_cache": next(iter(runs.values()))["cache"], "peak_reset": next(iter(runs.values()))["peak_reset"],
        "elapsed_s": round(time.perf_counter() - t_start, 1), "runs": runs,
    }


if __name__ == "__main__":
    raise SystemExit(main())
