"""Checkpoint benchmark: coci_hpc vs raw I/O, torch.save and torch.distributed.checkpoint (DCP).

    python benchmarks/checkpoint_bench.py                 # 1 and 2 ranks, ~1.2 GB state
    python benchmarks/checkpoint_bench.py --json          # one JSON object on stdout
    python benchmarks/checkpoint_bench.py --size-mb 200   # iterate small

The state is an MLP of ``size_mb / 12`` MB of float32 parameters plus Adam's two moments
(~``size_mb`` MB in all). The script runs itself under ``mpiexec -n 1`` and ``-n 2`` (``--ranks``)
and measures, in each world, interleaved over one warm-up round and ``--repeats`` (>= 7) timed rounds
(:mod:`benchmarks.method`: medians of the timed rounds, with ``*_min``, ``*_max`` and the warm-up
round's ``*_cold`` beside each in ``by_ranks``):

* raw write+fsync: every rank pwrites its 1/N of the same bytes into one file, then fsync
  (measured twice per round, first and right before coci's save; the faster one counts);
* torch.save+fsync of model+optimizer state dicts on rank 0 (the usual data-parallel practice);
* DCP ``save`` (fsync on) and ``async_save`` (thread), all ranks;
* coci ``save`` (sync) and ``save_async`` inside a training loop, through one ``CheckpointManager``
  for the whole run (as a training job has: its first save, in the warm-up round, agrees on the
  layout and checks the ranks' replicated copies are equal; later saves reuse the layout);
* restores with a cold page cache: raw read of the same bytes, coci load, torch.load, DCP load
  (every rank loads the whole replicated state, as data parallelism needs). Cold: the files that
  restore reads are evicted (fsync + fadvise DONTNEED, :func:`benchmarks.method.evict`), nothing
  else; before 2026-11-29 a global ``drop_caches``, which also evicted the job's libraries and
  coci's spare data file (the next save's), as no running job has them evicted. Since 2026-12-01
  each cold read also waits, after its eviction, until this VM has stopped handing free memory
  back to its host (:func:`benchmarks.method.settle_vm`; ``*_settle_s``), and records what it
  handed back during the read (``*_vm_mib``): before, the coci load, right after coci's save,
  paid for memory freed seconds before it and the raw read, right after its own eviction, did not.
  Since 2026-12-03 each cold read also begins with the same freshly freed memory
  (:func:`benchmarks.method.warm_free_memory`: a scratch file of 1.25 x the state's bytes written
  through the page cache and deleted, after the settle; ``*_warm_s``; ``--no-warm`` for the
  method before): the page cache a read fills came, for the raw read, from the pages its own
  file's eviction had just freed, and for coci's load, after a save written ``O_DIRECT`` that
  frees nothing, from memory handed back to the host long before, which on this VM filled at
  about half the speed (2026-12-03, 2 ranks, 7 rounds: coci's load 1.016 s median without,
  0.667 s with, the raw read 0.553 s; a plain ``pread`` of coci's own step file right after its
  save 1.5-3.0 s). Since run C36 (2026-12-03) the scratch file is deleted right after one of the
  VM's report passes, or with none pending (:func:`benchmarks.method.wait_report_gap`): in C33-C35
  a pass that fell inside the read handed back the pages the deletion had just freed for it.

Times are the slowest rank's, between barriers. Ratios (goals from issue 3):
persist_efficiency = raw write / save (>= 0.95); stall_ratio = training-loop blocked time of an
async save / torch.save time (<= 0.05); restore_ratio = restore / raw read (<= 1.2);
interference = training steps/s while a persist runs / steps/s without (>= 0.9), the steps/s
over the persist alone (:func:`benchmarks.method.rate_until`: the steps ended by the persist's
end plus the running step's part); ``interference_to_commit``, the measure until 2026-12-01,
counts the steps up to the poll that commits (one or more steps after the persist ended).
Since 2026-12-02 the JSON also has what the persist cost: ``coci_persist_lost`` (seconds of
training lost over it: its length x (1 - steps/s over it / steps/s without)), its CPU seconds
(``coci_persist_cpu`` and its parts ``coci_persist_{copy,write,crc}_cpu``, thread CPU time,
each the slowest rank's) and ``interference_if_cpu_only`` = 1 - that CPU / the persist's length:
the interference if training, each rank on its own busy core, lost the persist's CPU and
nothing else.
restore_floor = (raw read + copy after check) / raw read: the least an all-or-nothing load that
keeps the old state until every byte is checked can take, since it must copy every checked byte
into the live tensors after the last check (``copy_after_check``: that copy, timed warm from the
page cache into the live tensors, every rank at once).
Top-level JSON keys are coci's worst value over the rank counts; ``by_ranks`` has everything.
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

from benchmarks.method import (  # noqa: E402
    MIN_ROUNDS,
    mapped_copy,
    phase_breakdown,
    rate_until,
    ready_cold_read,
    slowest_rank,
    spread_table,
    summary,
    vm_reported_mib,
)


# ------------------------------------------------------------------------------ helpers
def build(size_mb: int, threads: int, comm=None):
    """MLP + Adam of ~size_mb MB; train_step() is one data-parallel step (gradient allreduce
    over ``comm`` when it has several ranks, like DDP, which also keeps the ranks in step)."""
    import torch

    torch.set_num_threads(threads)
    n_params = size_mb * (1 << 20) // 12
    layers = 4
    width = int((n_params / layers) ** 0.5)
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
    model = torch.nn.Sequential(*mods[:-2])
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(16, width)

    def train_step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        if comm is not None and comm.size > 1:
            from mpi4py import MPI

            for p in model.parameters():
                comm.mpi_comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                p.grad /= comm.size
        opt.step()

    train_step()  # creates the Adam moments
    return model, opt, train_step


def tensors_of(model, opt) -> list:
    out = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        out += [st["exp_avg"], st["exp_avg_sq"]]
    return out


class Timer:
    """Slowest-rank wall time of a block, between barriers."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def __call__(self, fn):
        self.comm.barrier()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        self.comm.barrier()
        return self.comm.allreduce_max(dt), out


def raw_write(comm, path: Path, tensors) -> None:
    """Every rank pwrites its 1/N of the concatenated bytes at their stream offsets, then fsync."""
    from coci_hpc.checkpoint.rawio import pwrite_all

    total = sum(t.numel() * t.element_size() for t in tensors)
    lo, hi = total * comm.rank // comm.size, total * (comm.rank + 1) // comm.size
    if comm.rank == 0:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
    comm.barrier()
    fd = os.open(path, os.O_WRONLY)
    try:
        off = 0
        for t in tensors:
            b = t.reshape(-1).view(__import__("torch").uint8).numpy()
            a, z = max(lo, off), min(hi, off + b.nbytes)
            if a < z:
                pwrite_all(fd, b[a - off:z - off], a)
            off += b.nbytes
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, tensors) -> None:
    from coci_hpc.checkpoint.rawio import pread_into

    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        for t in tensors:
            b = t.reshape(-1).view(__import__("torch").uint8).numpy()
            pread_into(fd, b, off)
            off += b.nbytes
    finally:
        os.close(fd)


def copy_after_check(timer: Timer, path: Path, tensors) -> float:
    """Slowest rank's time to copy the state's bytes from the page cache into the live tensors:
    the one copy a load pays after its last check (:func:`benchmarks.method.mapped_copy`; the file
    holds the tensors' own bytes, raw_write, so nothing changes)."""
    import torch

    views = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]
    return mapped_copy(timer.comm, path, views, lambda fn: timer(fn)[0])


def fsync_tree(path: Path) -> None:
    for f in ([path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from coci_hpc.checkpoint import CheckpointManager
    from coci_hpc.checkpoint.catalog import spare_path
    from coci_hpc.comm import Comm

    comm = Comm.world()
    W, rank = comm.size, comm.rank
    threads = max(1, (os.cpu_count() or 2) // W)
    model, opt, train_step = build(args.size_mb, threads, comm)
    tensors = tensors_of(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    base = Path(comm.bcast(tempfile.mkdtemp(prefix="coci-bench-", dir=args.dir) if rank == 0 else None))
    port = comm.bcast(29500 + os.getpid() % 2000 if rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W)
    timer = Timer(comm)
    state = {"model": model, "optimizer": opt}
    res: dict[str, list[float]] = {}
    cache_method = ""

    cold: dict[str, float] = {}
    phases: list[dict[str, float]] = []   # per round (the warm-up first): the coci save's phase times
    load_phases: list[dict[str, float]] = []   # the same for the coci load (each phase's slowest rank)
    warm_round = True   # round 0 warms up; its times are kept apart as the cold figures

    def rec(key: str, value: float) -> None:
        if warm_round:
            cold[key] = value
        else:
            res.setdefault(key, []).append(value)

    def cold_read(key: str, paths: list[Path], fn, keep: list[Path] | None = None) -> str:
        """Evict ``paths`` (rank 0), let the VM finish handing memory back (``settle_vm``), then
        time ``fn`` as ``key``; ``key_vm_mib``: MiB the VM handed back during it, ``key_settle_s``:
        the wait before it. Returns the eviction's method."""
        method, waited, warmed = "", 0.0, 0.0  # warmed: warm_free_memory's seconds (untimed)
        if rank == 0:
            method, waited, warmed = ready_cold_read(paths, keep or [], scratch=base, nbytes=int(1.25 * nbytes),
                                                     warm=args.warm)
        comm.barrier()
        m0 = vm_reported_mib()
        rec(key, timer(fn)[0])
        m1 = vm_reported_mib()
        if m0 is not None and m1 is not None:
            rec(f"{key}_vm_mib", m1 - m0)
            rec(f"{key}_settle_s", comm.allreduce_max(waited))
            rec(f"{key}_warm_s", comm.allreduce_max(warmed))
        return method

    def clean(p: Path) -> None:
        comm.barrier()
        if rank == 0:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        comm.barrier()

    for _ in range(2):  # warm up
        train_step()

    # One manager for the run, as a training job has: its first save (the warm-up round's, kept
    # as the cold figure) agrees on the layout and checks that the ranks' replicated copies are
    # equal; the later saves reuse the agreed layout (the retired step goes to retention, keep=1).
    cdir = base / "coci"
    mgr = CheckpointManager(cdir, comm=comm, keep=1, rng=True)
    for rep in range(args.repeats + 1):
        warm_round = rep == 0
        # raw write + read
        raw = base / "raw.bin"
        rec("raw_write", timer(lambda: raw_write(comm, raw, tensors))[0])
        cache_method = cold_read("raw_read", [raw], lambda: raw_read(raw, tensors))
        rec("copy_after_check", copy_after_check(timer, raw, tensors))
        clean(raw)

        # torch.save + fsync on rank 0; torch.load on every rank
        tp = base / "torch.pt"

        def tsave() -> None:
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tp)
                fsync_tree(tp)
        rec("torch_save", timer(tsave)[0])
        cold_read("torch_load", [tp], lambda: torch.load(tp, weights_only=True))
        clean(tp)

        # DCP save, load, async_save
        dp = base / f"dcp{rep}"
        sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        rec("dcp_save", timer(lambda: dcp.save(sd, checkpoint_id=str(dp)))[0])
        cold_read("dcp_load", [dp], lambda: dcp.load({"model": model.state_dict(),
                                                     "optimizer": opt.state_dict()}, checkpoint_id=str(dp)))
        clean(dp)
        dpa = base / f"dcpa{rep}"
        comm.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                             checkpoint_id=str(dpa))
        blocked = time.perf_counter() - t0
        steps, t1 = 0, time.perf_counter()
        dcp_done: list[float] = []
        fut.add_done_callback(lambda _: dcp_done.append(time.perf_counter()))
        ends = []
        while True:
            train_step()
            steps += 1
            ends.append(time.perf_counter() - t1)
            if comm.allreduce_min(1.0 if fut.done() else 0.0) >= 1.0:
                break
        window = time.perf_counter() - t1
        fut.result()
        # steps/s over DCP's persist alone (from the call's return to its future's completion)
        rec("dcp_persist_rate", comm.allreduce_min(rate_until(ends, (dcp_done or [t1 + window])[0] - t1)))
        rec("dcp_async_blocked", comm.allreduce_max(blocked))
        rec("dcp_async_rate", steps / comm.allreduce_max(window))
        rec("dcp_async_total", comm.allreduce_max(blocked + window))
        clean(dpa)

        # raw write again, right before coci's save: the baseline is the faster of the two
        rec("raw_write_b", timer(lambda: raw_write(comm, raw, tensors))[0])
        clean(raw)

        # coci sync save + load
        rec("coci_save", timer(lambda: mgr.save(1 + 10 * rep, state))[0])
        # where this save spent its time: each phase's slowest rank (issue 33)
        ranks_stats = comm.allgather(dict(mgr.stats))
        phases.append({k: round(max(st.get(k, 0.0) for st in ranks_stats), 4) for k in ranks_stats[0]})
        cold_read("coci_load", [cdir], lambda: mgr.load(1 + 10 * rep, state), keep=[spare_path(cdir)])
        load_phases.append(slowest_rank(comm.allgather(dict(mgr.load_stats))))

        # steps/s without checkpoint activity, measured right before the async saves
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            train_step()
        base_rate = args.steps / comm.allreduce_max(time.perf_counter() - t0)
        rec("base_rate", base_rate)

        # coci async save inside a training loop (twice: the second reuses host buffers)
        for k in range(2):
            comm.barrier()
            t0 = time.perf_counter()
            mgr.save_async(2 + 10 * rep + k, state)
            start_blocked = time.perf_counter() - t0
            steps, t1, poll_s = 0, time.perf_counter(), 0.0
            ends = []
            while True:
                train_step()   # its optimizer.step() waits for the snapshot copy (pre-hook)
                steps += 1
                ends.append(time.perf_counter() - t1)
                tp0 = time.perf_counter()
                done = mgr.poll()
                poll_s += time.perf_counter() - tp0
                if done:
                    break
            window = time.perf_counter() - t1
            st = mgr.async_stats
            blocked = start_blocked + st.get("snapshot_wait_s", 0.0) + poll_s
            if k == 1:
                rec("coci_async_start", comm.allreduce_max(start_blocked))
                rec("coci_async_snapwait", comm.allreduce_max(st.get("snapshot_wait_s", 0.0)))
                rec("coci_async_poll", comm.allreduce_max(poll_s))
                rec("coci_async_manifest", comm.allreduce_max(st.get("manifest_s", 0.0)))
                rec("coci_async_blocked", comm.allreduce_max(blocked))
                rec("coci_async_rate", steps / comm.allreduce_max(window))
                # steps/s over the persist alone: it ended persist_s after the call began (t0)
                tp = comm.allreduce_max(st.get("persist_s", 0.0) - (t1 - t0))
                rate = comm.allreduce_min(rate_until(ends, tp))
                rec("coci_persist_rate", rate)
                rec("coci_async_persist", comm.allreduce_max(st.get("persist_s", 0.0)))
                # what the persist cost the training: seconds of steps lost over it, and the
                # CPU the persist used (each part's and the sum's slowest rank; issue 33)
                rec("coci_persist_lost", tp * (1.0 - rate / base_rate))
                rec("coci_persist_window", tp)
                cpu = {k: st.get(f"persist_{k}_cpu_s", 0.0) for k in ("copy", "write", "crc")}
                for k, v in cpu.items():
                    rec(f"coci_persist_{k}_cpu", comm.allreduce_max(v))
                rec("coci_persist_cpu", comm.allreduce_max(sum(cpu.values())))

    mgr.close()
    dist.destroy_process_group()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    res["raw_write"] = [min(a, b) for a, b in zip(res["raw_write"], res.pop("raw_write_b"))]
    cold["raw_write"] = min(cold["raw_write"], cold.pop("raw_write_b"))
    med = summary(res, cold)
    med.update({"bytes": nbytes, "ranks": W, "cache": cache_method, "warm": args.warm,
                "threads_per_rank": threads, "samples": res, "coci_save_phases": phases,
                "coci_load_phases": load_phases})
    return med


def ratios(m: dict) -> dict:
    def r(a: float, b: float) -> float:
        return round(a / b, 3) if b else float("nan")

    return {
        "coci": {"persist_efficiency": r(m["raw_write"], m["coci_save"]),
                 "stall_ratio": r(m["coci_async_blocked"], m["torch_save"]),
                 "restore_ratio": r(m["coci_load"], m["raw_read"]),
                 # the least an all-or-nothing load can take: the raw read, then one copy
                 "restore_floor": r(m["raw_read"] + m["copy_after_check"], m["raw_read"]),
                 # steps/s while the persist runs / without (until 2026-12-01: to the commit)
                 "interference": r(m["coci_persist_rate"], m["base_rate"]),
                 "interference_to_commit": r(m["coci_async_rate"], m["base_rate"]),
                 # the interference if training lost the persist's CPU time (a rank's, each rank
                 # on its own busy core) and nothing else: 1 - CPU / the persist's length
                 "interference_if_cpu_only": round(1.0 - m["coci_persist_cpu"] / m["coci_persist_window"], 3)
                 if m.get("coci_persist_window") else None},
        "torch_save": {"persist_efficiency": r(m["raw_write"], m["torch_save"]),
                       "stall_ratio": 1.0,
                       "restore_ratio": r(m["torch_load"], m["raw_read"]),
                       "interference": None},
        "dcp": {"persist_efficiency": r(m["raw_write"], m["dcp_save"]),
                "stall_ratio": r(m["dcp_async_blocked"], m["torch_save"]),
                "restore_ratio": r(m["dcp_load"], m["raw_read"]),
                "interference": r(m["dcp_persist_rate"], m["base_rate"]),
                "interference_to_commit": r(m["dcp_async_rate"], m["base_rate"])},
    }


def table(results: dict[int, dict]) -> str:
    rows = [("raw write+fsync", "raw_write"), ("torch.save+fsync (rank 0)", "torch_save"),
            ("DCP save", "dcp_save"), ("DCP async_save: blocked", "dcp_async_blocked"),
            ("coci save (sync)", "coci_save"), ("coci save_async: blocked", "coci_async_blocked"),
            ("  of which save_async call", "coci_async_start"),
            ("  of which optimizer waits", "coci_async_snapwait"),
            ("  of which poll/commit", "coci_async_poll"),
            ("    of which manifest (rank 0)", "coci_async_manifest"),
            ("coci save_async: persist", "coci_async_persist"),
            ("  training time lost over it", "coci_persist_lost"),
            ("  its CPU (copy+write+crc)", "coci_persist_cpu"),
            ("    of which snapshot copies", "coci_persist_copy_cpu"),
            ("    of which writes", "coci_persist_write_cpu"),
            ("    of which checksums", "coci_persist_crc_cpu"),
            ("raw read (cold)", "raw_read"), ("torch.load (cold)", "torch_load"),
            ("DCP load (cold)", "dcp_load"), ("coci load (cold)", "coci_load"),
            ("copy after check (warm)", "copy_after_check")]
    if all("coci_load_vm_mib" in results[w] for w in results):
        rows += [("VM handed back: raw read MiB", "raw_read_vm_mib"),
                 ("VM handed back: coci load MiB", "coci_load_vm_mib"),
                 ("settle before coci load s", "coci_load_settle_s")]
    if all("coci_load_warm_s" in results[w] for w in results):
        rows += [("freed page cache before coci load s", "coci_load_warm_s")]
    ws = sorted(results)
    out = []
    gb = results[ws[0]]["bytes"] / 1e9
    out.append(f"state: {gb:.2f} GB (MLP + Adam), seconds = median, slowest rank")
    out.append(f"{'':<28}" + "".join(f"{f'{w} rank(s)':>14}" for w in ws))
    for label, key in rows:
        out.append(f"{label:<28}" + "".join(f"{results[w][key]:>14.3f}" for w in ws))
    out.append(f"{'spread: coci save min-max':<28}" + "".join(
        f"{results[w]['coci_save_min']:>7.2f}-{results[w]['coci_save_max']:<6.2f}" for w in ws))
    out.append(f"{'spread: raw write min-max':<28}" + "".join(
        f"{results[w]['raw_write_min']:>7.2f}-{results[w]['raw_write_max']:<6.2f}" for w in ws))
    out.append(f"{'cold: coci save / raw write':<28}" + "".join(
        f"{results[w].get('coci_save_cold', float('nan')):>7.2f}/{results[w].get('raw_write_cold', float('nan')):<6.2f}"
        for w in ws))
    out.append(f"{'train steps/s (no ckpt)':<28}" + "".join(f"{results[w]['base_rate']:>14.2f}" for w in ws))
    out.append("")
    out.append(f"{'ratio':<34}" + "".join(f"{f'{w} rank(s)':>12}" for w in ws) + "   goal")
    goals = {"persist_efficiency": ">= 0.95", "stall_ratio": "<= 0.05", "restore_ratio": "<= 1.2",
             "interference": ">= 0.9"}
    for tool in ("coci", "torch_save", "dcp"):
        for key, goal in goals.items():
            vals = [ratios(results[w])[tool][key] for w in ws]
            cells = "".join(f"{('n/a' if v is None else f'{v:.3f}'):>12}" for v in vals)
            out.append(f"{tool + ' ' + key:<34}{cells}   {goal if tool == 'coci' else ''}")
        cells = "".join(f"{ratios(results[w])[tool].get('interference_to_commit') or float('nan'):>12.3f}"
                        for w in ws)
        out.append(f"{tool + ' interference_to_commit':<34}{cells}")
        if tool == "coci":
            cells = "".join(f"{ratios(results[w])['coci']['restore_floor']:>12.3f}" for w in ws)
            out.append(f"{'coci restore_floor (raw + copy)':<34}{cells}")
            vals = [ratios(results[w])["coci"]["interference_if_cpu_only"] for w in ws]
            cells = "".join(f"{float('nan') if v is None else v:>12.3f}" for v in vals)
            out.append(f"{'coci interference_if_cpu_only':<34}{cells}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1200, help="state size (params + Adam moments)")
    ap.add_argument("--ranks", default="1,2", help="world sizes to run, comma separated")
    ap.add_argument("--repeats", type=int, default=MIN_ROUNDS,
                    help=f"timed rounds after the warm-up round (a ratio is their median; >= {MIN_ROUNDS})")
    ap.add_argument("--steps", type=int, default=4, help="training steps for each baseline rate")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--bind-to", default=None, choices=["core", "none"],
                    help="mpiexec's binding of each rank (default: Open MPI's own, a core per rank for "
                         "1-2 ranks); 'none' lets each rank use every core, as --cpus-per-task does")
    ap.add_argument("--no-warm", dest="warm", action="store_false",
                    help="begin each cold read without first freeing fresh page cache (the method "
                         "before 2026-12-03; see benchmarks.method.warm_free_memory)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        out = worker(args)
        from coci_hpc.comm import Comm

        if Comm.world().rank == 0:
            Path(args.worker).write_text(json.dumps(out))
        return 0

    results: dict[int, dict] = {}
    t_start = time.perf_counter()
    for w in [int(x) for x in args.ranks.split(",")]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
            out_path = tf.name
        bind = ["--bind-to", args.bind_to] if args.bind_to else []
        cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", *bind, "-n", str(w), sys.executable,
               "-m", "mpi4py", __file__, "--worker", out_path, "--size-mb", str(args.size_mb),
               "--repeats", str(args.repeats), "--steps", str(args.steps)]
        if args.dir:
            cmd += ["--dir", args.dir]
        if not args.warm:
            cmd += ["--no-warm"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stdout, p.stderr, file=sys.stderr)
            return 1
        results[w] = json.loads(Path(out_path).read_text())
        os.unlink(out_path)
    elapsed = time.perf_counter() - t_start

    per = {str(w): {"ratios": ratios(m), "seconds": {k: v for k, v in m.items() if k != "samples"}}
           for w, m in results.items()}
    worst = {}
    for key, better in (("persist_efficiency", max), ("stall_ratio", min), ("restore_ratio", min),
                        ("interference", max)):
        vals = [ratios(m)["coci"][key] for m in results.values()]
        worst[key] = min(vals) if better is max else max(vals)
    floor = max(ratios(m)["coci"]["restore_floor"] for m in results.values())
    doc = {**worst, "restore_floor": floor,
           "torch_save": {k: [ratios(m)["torch_save"][k] for m in results.values()] for k in worst},
           "dcp": {k: [ratios(m)["dcp"][k] for m in results.values()] for k in worst},
           "ranks": sorted(results), "state_bytes": results[min(results)]["bytes"],
           "page_cache": results[min(results)]["cache"], "elapsed_s": round(elapsed, 1),
           "by_ranks": per}
    # next to the goal keys: median, min, max and cold (warm-up round) of each writer and reader
    doc["spread"] = {str(w): spread_table(m, ("raw_write", "coci_save", "dcp_save", "torch_save",
                                              "coci_async_persist", "raw_read", "coci_load", "dcp_load",
                                              "torch_load"))
                     for w, m in results.items()}
    for w, m in results.items():
        # the per-phase breakdown of the slowest and the fastest timed coci save
        times, ph = m["samples"]["coci_save"], m.get("coci_save_phases", [])
        if len(ph) == len(times) + 1:
            doc["by_ranks"][str(w)]["coci_save_phases_slowest"] = {"save_s": max(times),
                                                                   **ph[1 + times.index(max(times))]}
            doc["by_ranks"][str(w)]["coci_save_phases_fastest"] = {"save_s": min(times),
                                                                   **ph[1 + times.index(min(times))]}
        # the same for the load (issue 33: a slow load names its phase)
        doc["by_ranks"][str(w)].update(phase_breakdown("coci_load_phases", m["samples"]["coci_load"],
                                                       m.get("coci_load_phases", []), "load_s_measured"))
    if args.json:
        print(table(results), file=sys.stderr)
        print(json.dumps(doc))
    else:
        print(table(results))
        print(f"\ncold cache via {doc['page_cache']}; total {elapsed:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
