"""How a save's planning and file metadata grow with the number of ranks (issue 15).

For 1, 2, 4, ... ranks (``mpiexec --oversubscribe`` on this machine) and 100 / 2000 leaves per
rank (90 % replicated, 10 % per-rank; tiny tensors, so 32 ranks fit on 2 cores), it measures
per save, on every rank:

* planning (the leaf descriptions a save builds, :func:`coci_hpc.checkpoint.layout.describe`,
  and :func:`coci_hpc.checkpoint.coordinator.agree`) of the FIRST save (rank 0 gathers, plans,
  scatters) and of a CACHED save (state unchanged: one allreduce): wall time (max over ranks,
  median of ``--reps``, of 10 x that (at least 31) for the cheap cached path) and bytes each rank receives (the
  pickled size of what every collective hands it, counted by a wrapping communicator, max over
  ranks). Side by side with the cached plan, in the same rounds: a bare 8-byte allreduce of the
  same ranks (what oversubscribed ranks on 2 cores cost by themselves; the plan net of it is
  reported too) and the rank-local work alone (the CPU a cached plan costs one rank);
* side by side, the BASELINE the issue measured: the pre-#15 planning (allgather every rank's
  leaf list, every rank builds the whole layout);
* HDF5 objects (groups + datasets, counted by h5py in the file) of a file created with the
  writers' dataset creation code from the layout rank 0 planned, and from the pre-#15 per-rank
  layout (one dataset per rank and per-rank leaf) side by side; for the 100-leaf state also in
  the file of a real save (``hdf5_objects_real_save``);
* file-system metadata operations of a real first and cached save (100-leaf state) on each rank, counted with
  ``strace -c`` attached to the rank for exactly that save (directory listings, stats, opens,
  creates, renames, removes; the step catalog of issue 15 part A was not on main when this was
  written, so this counter is strace, not catalog.py's), with ``keep=2`` and with 8 committed
  checkpoints kept; and the bytes each rank receives over each of those whole saves (rank 0
  gathers every rank's CRCs and, only where it changed, its per-rank skeleton).

Each series is fitted as ``y = a * N**b`` (least squares in log-log over N >= 2) and projected to
4096 and 16384 ranks. Prints a table and, with ``--json``, one JSON object.

    python benchmarks/scale_bench.py --json            # default: 1..32 ranks, ~5-10 min here
    python benchmarks/scale_bench.py --ranks 1,2,4 --leaves 100 --json   # quick
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROJECT_TO = (4096, 16384)
GOAL_CACHED_BYTES = 64 * 1024
GOAL_EXPONENT = 0.1
GOAL_PLAN_S_AT_8 = 0.010
META_CALLS = {
    "listings": ("getdents64", "getdents"),
    "stats": ("newfstatat", "statx", "stat", "lstat", "fstatat64", "access", "faccessat", "faccessat2",
              "readlink", "readlinkat"),
    "opens": ("openat", "open", "creat"),
    "creates": ("mkdir", "mkdirat"),
    "renames": ("rename", "renameat", "renameat2"),
    "removes": ("unlink", "unlinkat", "rmdir"),
}


# ------------------------------------------------------------------------------ worker side
def _counting_comm():  # noqa: ANN202 - a class made after mpi4py is imported
    from coci_hpc.comm import Comm

    class CountingComm(Comm):
        """Counts the bytes this rank receives in each collective (pickled size of its result)."""

        def __init__(self, mpi_comm: Any) -> None:
            super().__init__(mpi_comm)
            self.received = 0

        def _got(self, obj: Any) -> Any:
            self.received += len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            return obj

        def bcast(self, obj, root=0):  # type: ignore[no-untyped-def]
            out = super().bcast(obj, root)
            return out if self.rank == root else self._got(out)

        def allgather(self, obj):  # type: ignore[no-untyped-def]
            out = super().allgather(obj)
            self._got([o for r, o in enumerate(out) if r != self.rank])
            return out

        def gather(self, obj, root=0):  # type: ignore[no-untyped-def]
            out = super().gather(obj, root)
            if out is not None:
                self._got([o for r, o in enumerate(out) if r != self.rank])
            return out

        def scatter(self, objs, root=0):  # type: ignore[no-untyped-def]
            out = super().scatter(objs, root)
            return out if self.rank == root else self._got(out)

        def allreduce_max(self, value):  # type: ignore[no-untyped-def]
            self.received += 8 if self.size > 1 else 0
            return super().allreduce_max(value)

        def allreduce_min(self, value):  # type: ignore[no-untyped-def]
            self.received += 8 if self.size > 1 else 0
            return super().allreduce_min(value)

    return CountingComm


def _descs(rank: int, leaves: int) -> list[Any]:
    from coci_hpc.checkpoint.layout import LeafDesc

    per_rank = max(1, leaves // 10)
    out = [LeafDesc(f"replicated/model/p{i:05d}", "torch.float32", (16,), "replicated", 64)
           for i in range(leaves - per_rank)]
    out += [LeafDesc(f"per_rank/opt/s{i:05d}", "torch.float32", (8,), "per_rank", 32) for i in range(per_rank)]
    return out


def _state(leaves: int, rank: int) -> dict[str, Any]:
    import torch

    from coci_hpc.checkpoint import PerRank

    per_rank = max(1, leaves // 10)
    return {"model": {f"p{i:05d}": torch.full((16,), float(i)) for i in range(leaves - per_rank)},
            "opt": PerRank({f"s{i:05d}": torch.full((8,), float(rank)) for i in range(per_rank)})}


def _timed(comm: Any, fn: Any) -> tuple[float, int, int]:
    """(max seconds over ranks, bytes rank 0 received, max bytes any other rank received)."""
    comm.barrier()
    comm.received = 0
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    got = comm.received
    other = 0 if comm.rank == 0 else got
    return comm.allreduce_max(dt), int(comm.bcast(got)), int(comm.allreduce_max(float(other)))


def _leaves(rank: int, leaves: int) -> list[Any]:
    """Leaves as a real save hands them to planning (no data: planning never looks at bytes)."""
    from coci_hpc.checkpoint.treecode import Leaf

    return [Leaf(d.name, d.dtype, tuple(d.shape), None, d.kind, d.nbytes) for d in _descs(rank, leaves)]


def _plan_figures(comm: Any, leaves: int, reps: int) -> dict[str, Any]:
    from coci_hpc.checkpoint.coordinator import LayoutCache, agree
    from coci_hpc.checkpoint.layout import describe, leaf_rows, make_layout

    # Two separately built lists of the same leaves, used in turn: like two real saves, the
    # descriptions compared are equal strings and tuples, never the same objects.
    states = (_leaves(comm.rank, leaves), _leaves(comm.rank, leaves))
    turn = [0]

    def next_leaves() -> list[Any]:
        turn[0] += 1
        return states[turn[0] % 2]

    align = 4096

    # agree() is handed the leaves, as SaveTransaction.plan hands them: describing them is part of it.
    def first() -> None:
        agree(comm, next_leaves(), align, LayoutCache(), last_manifest=lambda: None)

    cache = LayoutCache()
    agree(comm, next_leaves(), align, cache, last_manifest=lambda: None)

    def cached() -> None:  # what a save of an unchanged state pays for its layout (prepare's part)
        agree(comm, next_leaves(), align, cache, last_manifest=lambda: None)
        assert cache.last["source"] == "cached"

    def local() -> None:  # the same rank-local work without the allreduce: the CPU cost per rank
        assert cache.reusable((align, comm.size, leaf_rows(next_leaves())))

    def bare() -> None:  # the cached path's one collective alone: what 8 ranks on 2 cores cost
        comm.allreduce_max(0.0)

    def baseline() -> None:  # the planning before issue 15: allgather, everyone plans everything
        make_layout(comm.allgather(describe(next_leaves())), align=align)

    out: dict[str, Any] = {}
    runs: dict[str, list[tuple[float, int, int]]] = {}
    for _ in range(reps):
        for name, fn in (("first", first), ("baseline", baseline)):
            runs.setdefault(name, []).append(_timed(comm, fn))
    for _ in range(max(31, 10 * reps)):  # cheap: more repetitions (a median robust to load spikes), interleaved side by side
        for name, fn in (("cached", cached), ("bare_allreduce", bare), ("cached_local", local)):
            runs.setdefault(name, []).append(_timed(comm, fn))
    for name, rs in runs.items():
        out[f"{name}_s"] = statistics.median(r[0] for r in rs)
        out[f"{name}_bytes_rank0"] = max(r[1] for r in rs)
        out[f"{name}_bytes_others"] = max(r[2] for r in rs)
        out[f"{name}_bytes"] = max(out[f"{name}_bytes_rank0"], out[f"{name}_bytes_others"])
    # median over rounds of (cached - bare allreduce in the same round): the plan net of what
    # the scheduler makes one 8-byte allreduce of N ranks on 2 cores cost
    out["cached_net_s"] = statistics.median(c[0] - b[0] for c, b in zip(runs["cached"], runs["bare_allreduce"]))
    if comm.rank == 0:  # HDF5 objects of the file each layout makes, created and counted for real
        assert cache.full is not None
        out["hdf5_objects"] = _objects_of(cache.full.datasets, Path(tempfile.mkdtemp(prefix="coci-h5count-")))
        out["hdf5_objects_old_layout"] = _old_layout_objects(leaves, comm.size,
                                                             Path(tempfile.mkdtemp(prefix="coci-h5count-")))
    return out


def _strace_window(out: Path):  # noqa: ANN202
    """Start strace -c on this process (all threads); returns a stop function."""
    cmd = ["strace", "-qq", "-f", "-c", "-o", str(out), "-p", str(os.getpid()),
           "-e", "trace=" + ",".join(c for calls in META_CALLS.values() for c in calls)]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        tasks = os.listdir("/proc/self/task")
        traced = 0
        for t in tasks:
            try:
                with open(f"/proc/self/task/{t}/status") as f:
                    traced += any(ln.startswith("TracerPid:") and ln.split()[1] != "0" for ln in f)
            except OSError:
                pass
        if traced == len(tasks):
            break
        time.sleep(0.02)

    def stop() -> dict[str, int]:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)
        calls: dict[str, int] = {}
        for ln in out.read_text().splitlines():
            parts = ln.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                calls[parts[-1]] = int(parts[3])
        return {k: sum(calls.get(c, 0) for c in cs) for k, cs in META_CALLS.items()}

    return stop


def _count_objects(path: Path) -> int:
    import h5py

    n = 0

    def visit(_: str) -> None:
        nonlocal n
        n += 1

    with h5py.File(path, "r") as f:
        f.visit(visit)
    return n


def _objects_of(specs: Any, tmp: Path) -> int:
    """Create a file with these datasets (the writers' own creation code) and count its objects."""
    import shutil

    import h5py

    from coci_hpc.checkpoint.h5file import create_datasets

    path = tmp / "count.h5"
    with h5py.File(path, "w") as f:
        create_datasets(f, specs)
    n = _count_objects(path)
    shutil.rmtree(tmp, ignore_errors=True)
    return n


def _old_layout_objects(leaves: int, world: int, tmp: Path) -> int:
    """Objects of a file with the pre-#15 layout: one dataset per rank and per-rank leaf."""
    from coci_hpc.checkpoint.layout import DatasetSpec

    specs = [DatasetSpec(d.name, d.name, d.dtype, d.shape, d.kind, d.nbytes)
             for d in _descs(0, leaves) if d.kind == "replicated"]
    for r in range(world):
        specs += [DatasetSpec(f"rank{r:05d}/{d.name.split('/', 1)[1]}", d.name, d.dtype, d.shape, d.kind, d.nbytes)
                  for d in _descs(r, leaves) if d.kind == "per_rank"]
    return _objects_of(specs, tmp)


def _save_figures(comm: Any, leaves: int, base: Path, meta: bool) -> dict[str, Any]:
    from coci_hpc.checkpoint import CheckpointManager
    from coci_hpc.checkpoint import catalog as cat
    from coci_hpc.checkpoint import manifest as mf

    state = _state(leaves, comm.rank)
    root = base / f"ck{leaves}"
    out: dict[str, Any] = {}
    for keep, extra in ((2, 0), (8, 6)):
        d = root / f"keep{keep}"
        mgr = CheckpointManager(d, comm=comm, rng=False, keep=keep)
        ops: dict[str, dict[str, int]] = {}
        for step in range(1, 3 + extra):
            watch = meta and (step == 1 or step == 2 + extra)
            what = "first" if step == 1 else "cached"
            comm.barrier()
            stop = _strace_window(base / f"st.{comm.rank}.{keep}.{step}") if watch else None
            comm.received = 0
            t0 = time.perf_counter()
            mgr.save(step, state)
            dt = time.perf_counter() - t0
            got = comm.received
            if stop is not None:
                ops[what] = stop()
            out[f"save_{what}_s_keep{keep}"] = comm.allreduce_max(dt)
            # bytes received over the whole save (planning, file creation, the commit's gather of
            # CRCs and per-rank skeletons): rank 0, and the most any other rank received
            out[f"save_{what}_bytes_rank0_keep{keep}"] = int(comm.bcast(got))
            out[f"save_{what}_bytes_others_keep{keep}"] = int(comm.allreduce_max(0.0 if comm.rank == 0 else float(got)))
        assert mgr._layouts.last["source"] == "cached"
        if keep == 2:
            comm.barrier()
            if comm.rank == 0:  # the real save's file
                out["hdf5_objects_real_save"] = _count_objects(cat.step_dir(d, 2 + extra) / mf.DATA_FILE)
        if meta:
            all_ops = comm.gather(ops)
            if comm.rank == 0:
                assert all_ops is not None
                for what in ("first", "cached"):
                    per_rank = [sum(o[what].values()) for o in all_ops]
                    out[f"meta_ops_{what}_keep{keep}"] = {
                        "rank0": all_ops[0][what], "rank0_total": per_rank[0],
                        "other_rank_max": max(per_rank[1:], default=0), "all_ranks": sum(per_rank)}
        mgr.close()
    return out


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    comm = _counting_comm()(MPI.COMM_WORLD)
    base = Path(comm.bcast(tempfile.mkdtemp(prefix="coci-scale-", dir=args.tmp) if comm.rank == 0 else None))
    result: dict[str, Any] = {"ranks": comm.size}
    try:
        for leaves in args.leaves:
            fig = _plan_figures(comm, leaves, args.reps)
            if leaves == min(args.leaves):  # real saves (metadata operations): the small state only
                fig.update(_save_figures(comm, leaves, base, meta=True))
            result[str(leaves)] = fig
    finally:
        comm.barrier()
        if comm.rank == 0:
            import shutil

            shutil.rmtree(base, ignore_errors=True)
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps(result))


# ------------------------------------------------------------------------------ driver side
def fit(ns: list[int], ys: list[float]) -> tuple[float, float] | None:
    """(a, b) of y = a * N**b over N >= 2 with y > 0 (log-log least squares)."""
    pts = [(math.log(n), math.log(y)) for n, y in zip(ns, ys) if n >= 2 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else 0.0
    return math.exp(my - b * mx), b


def _series(runs: list[dict[str, Any]], leaves: int, key: str) -> tuple[list[int], list[float]]:
    ns = [r["ranks"] for r in runs if str(leaves) in r and key in r[str(leaves)]]
    return ns, [float(r[str(leaves)][key]) for r in runs if str(leaves) in r and key in r[str(leaves)]]


def summarize(runs: list[dict[str, Any]], leaves_list: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": runs, "fits": {}, "projections": {}}
    keys = ("first_bytes", "first_bytes_rank0", "first_bytes_others", "cached_bytes", "baseline_bytes", "first_s", "cached_s",
            "baseline_s", "bare_allreduce_s", "cached_local_s",
            "hdf5_objects", "hdf5_objects_old_layout")
    for leaves in leaves_list:
        for key in keys:
            ns, ys = _series(runs, leaves, key)
            f = fit(ns, ys)
            if f is None:
                continue
            a, b = f
            name = f"{key}@{leaves}"
            out["fits"][name] = {"a": a, "exponent": b}
            out["projections"][name] = {str(n): a * n ** b for n in PROJECT_TO}
    cached = [r[str(l)]["cached_bytes"] for r in runs for l in leaves_list if str(l) in r]
    out["cached_plan_bytes_per_rank_max"] = max(cached) if cached else None
    exps = [out["fits"][f"cached_bytes@{l}"]["exponent"] for l in leaves_list if f"cached_bytes@{l}" in out["fits"]]
    out["plan_bytes_growth_exponent"] = max(exps) if exps else None
    def at8(key: str) -> float | None:
        vals = [r[str(l)][key] for r in runs if r["ranks"] == 8 for l in leaves_list if key in r.get(str(l), {})]
        return max(vals) if vals else None

    out["cached_plan_s_at_8"] = at8("cached_s")  # the raw figure: what the goal is judged on
    # side by side in the same run: one bare 8-byte allreduce of 8 ranks, the plan net of it,
    # and the rank-local work alone (the CPU a cached plan costs a rank)
    out["bare_allreduce_s_at_8"] = at8("bare_allreduce_s")
    out["cached_plan_net_s_at_8"] = at8("cached_net_s")
    out["cached_plan_local_s_at_8"] = at8("cached_local_s")
    out["first_plan_bytes_per_rank"] = {
        str(l): {str(r["ranks"]): {"rank0": r[str(l)]["first_bytes_rank0"], "others": r[str(l)]["first_bytes_others"]}
                 for r in runs if str(l) in r} for l in leaves_list}
    out["save_bytes_per_rank"] = {  # a whole real save (100-leaf state, keep=2), first and cached
        str(l): {str(r["ranks"]): {what: {"rank0": r[str(l)][f"save_{what}_bytes_rank0_keep2"],
                                         "others": r[str(l)][f"save_{what}_bytes_others_keep2"]}
                                   for what in ("first", "cached")}
                 for r in runs if "save_cached_bytes_rank0_keep2" in r.get(str(l), {})}
        for l in leaves_list}
    out["save_bytes_per_rank"] = {l: v for l, v in out["save_bytes_per_rank"].items() if v}
    out["baseline_plan_bytes_per_rank"] = {str(l): {str(r["ranks"]): r[str(l)]["baseline_bytes"] for r in runs
                                                     if str(l) in r} for l in leaves_list}
    meta = {}
    for r in runs:
        for l in leaves_list:
            fig = r.get(str(l), {})
            for k, v in fig.items():
                if k.startswith("meta_ops_"):
                    meta.setdefault(k, {})[str(r["ranks"])] = v
    out["metadata_ops_per_save"] = meta
    out["goals"] = {
        "cached_plan_bytes_per_rank_max<=64KiB": out["cached_plan_bytes_per_rank_max"] is not None
        and out["cached_plan_bytes_per_rank_max"] <= GOAL_CACHED_BYTES,
        "plan_bytes_growth_exponent<=0.1": out["plan_bytes_growth_exponent"] is not None
        and out["plan_bytes_growth_exponent"] <= GOAL_EXPONENT,
        "cached_plan_s_at_8<=10ms": out["cached_plan_s_at_8"] is not None
        and out["cached_plan_s_at_8"] <= GOAL_PLAN_S_AT_8,
    }
    return out


def _fmt_bytes(x: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(x) < 1024 or unit == "TB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return str(x)


def table(s: dict[str, Any], leaves_list: list[int]) -> str:
    lines = []
    for l in leaves_list:
        lines.append(f"\n{l} leaves per rank: planning per save (max over ranks) and file objects")
        lines.append(f"{'ranks':>5} {'first B r0/other':>19} {'cached B/rank':>13} {'baseline B/rank':>15} "
                     f"{'first ms':>9} {'cached ms':>9} {'allreduce ms':>12} {'local ms':>8} {'baseline ms':>11} "
                     f"{'h5 objects':>10} {'old layout':>10}")
        for r in s["runs"]:
            f = r.get(str(l))
            if not f:
                continue
            first = f"{_fmt_bytes(f['first_bytes_rank0'])}/{_fmt_bytes(f['first_bytes_others'])}"
            lines.append(f"{r['ranks']:>5} {first:>19} {_fmt_bytes(f['cached_bytes']):>13} "
                         f"{_fmt_bytes(f['baseline_bytes']):>15} {f['first_s'] * 1e3:>9.2f} "
                         f"{f['cached_s'] * 1e3:>9.2f} {f.get('bare_allreduce_s', 0) * 1e3:>12.2f} "
                         f"{f.get('cached_local_s', 0) * 1e3:>8.2f} {f['baseline_s'] * 1e3:>11.2f} "
                         f"{f.get('hdf5_objects', '-'):>10} {f.get('hdf5_objects_old_layout', '-'):>10}")
        for key in ("first_bytes_rank0", "first_bytes_others", "cached_bytes", "baseline_bytes", "hdf5_objects",
                    "hdf5_objects_old_layout"):
            name = f"{key}@{l}"
            if name in s["fits"]:
                p = s["projections"][name]
                fmt = _fmt_bytes if key.endswith("bytes") else (lambda v: f"{v:.0f}")
                lines.append(f"  {key:<24} ~ N^{s['fits'][name]['exponent']:.2f}   "
                             + "   ".join(f"N={n}: {fmt(p[str(n)])}" for n in PROJECT_TO))
    for l, per_n in s.get("save_bytes_per_rank", {}).items():
        lines.append(f"\nbytes received over a whole real save ({l} leaves, keep=2), rank 0 / most of any other rank")
        for what in ("first", "cached"):
            cells = "  ".join(f"N={n}: {_fmt_bytes(v[what]['rank0'])}/{_fmt_bytes(v[what]['others'])}"
                              for n, v in sorted(per_n.items(), key=lambda kv: int(kv[0])))
            lines.append(f"  {what:<7} {cells}")
    if s["metadata_ops_per_save"]:
        lines.append("\nfile-system metadata operations per save (strace -c on each rank; rank 0 / any other rank / all)")
        for k, per_n in sorted(s["metadata_ops_per_save"].items()):
            cells = "  ".join(f"N={n}: {v['rank0_total']}/{v['other_rank_max']}/{v['all_ranks']}"
                              for n, v in sorted(per_n.items(), key=lambda kv: int(kv[0])))
            lines.append(f"  {k:<22} {cells}")
    lines.append(f"\ncached_plan_bytes_per_rank_max {s['cached_plan_bytes_per_rank_max']}  "
                 f"plan_bytes_growth_exponent {s['plan_bytes_growth_exponent']}  "
                 f"cached_plan_s_at_8 {s['cached_plan_s_at_8']}  (bare 8-byte allreduce at 8 ranks "
                 f"{s['bare_allreduce_s_at_8']}, net of it {s['cached_plan_net_s_at_8']}, rank-local work "
                 f"{s['cached_plan_local_s_at_8']})")
    lines.append("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in s["goals"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2,4,8,16,32")
    ap.add_argument("--leaves", default="100,2000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object after the table")
    ap.add_argument("--tmp", default=None, help="directory for the checkpoints (default: the system's)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.leaves = [int(x) for x in str(args.leaves).split(",")]
    if args.worker:
        worker(args)
        return 0
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "OPAL_", "PRTE_", "HYDRA_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    runs = []
    for n in [int(x) for x in args.ranks.split(",")]:
        with tempfile.NamedTemporaryFile(suffix=".json") as tf:
            cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(n), sys.executable,
                   __file__, "--worker", "--out", tf.name, "--leaves", ",".join(map(str, args.leaves)),
                   "--reps", str(args.reps)] + (["--tmp", args.tmp] if args.tmp else [])
            t0 = time.perf_counter()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{n} ranks failed ({p.returncode})")
            runs.append(json.loads(Path(tf.name).read_text()))
            print(f"[scale_bench] {n} ranks: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    s = summarize(runs, args.leaves)
    print(table(s, args.leaves))
    if args.json:
        print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
