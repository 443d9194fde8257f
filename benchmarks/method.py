"""The measuring method the disk benchmarks share (issue 33): one that survives a noisy machine.

Every writer (and reader) runs one untimed-for-the-median warm-up round first, whose time is kept
on its own as the *cold* figure (fresh files, fresh buffers, first imports); then at least
:data:`MIN_ROUNDS` rounds in which every writer and its baseline (the raw-disk floor) run side by
side, their order rotating. A ratio is the ratio of two medians of the same rounds; the JSON also
carries each writer's min and max, so the spread shows next to the figure.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

MIN_ROUNDS = 7  # rounds after the warm-up that a ratio is the median of

# A VM whose kernel hands free memory back to its host (virtio-balloon free page reporting,
# as this Firecracker machine: page_reporting.page_reporting_order on its command line) counts
# the KiB handed back here. The next first touch of those pages faults in the host: on
# 2026-11-29, a raw 512 MB-per-rank write right after DCP's save (which handed back 480-684 MiB
# during it) took 1.33 s, the same write after nothing was handed back 0.53-0.58 s, its
# system time 1.0 s against 0.15 s. Whoever writes next pays: the benchmarks record it per op.
_REPORTED_KIB = "/sys/module/page_reporting/parameters/reported_kib"


def vm_reported_mib() -> float | None:
    """MiB of free memory this machine has handed back to its host so far, or None where the
    kernel does not report free pages (bare metal, most HPC nodes)."""
    try:
        with open(_REPORTED_KIB) as f:
            return int(f.read()) / 1024
    except (OSError, ValueError):
        return None


def settle_vm(quiet_s: float = 1.0, most_s: float = 10.0) -> tuple[float, float]:
    """Wait until this VM has handed no memory back to its host for ``quiet_s`` (at most
    ``most_s``); returns (seconds waited, MiB handed back meanwhile), (0, 0) where the kernel
    reports no free pages (bare metal: nothing to wait for). Not longer: with ``quiet_s`` 2.5 s
    the VM never fell quiet (most waits ran to their 12 s bound) and the cold reads took 2.8-3.6 x
    as long, the raw read too (DCP's 1.5-1.6 x) (run C17, 2026-12-01: the evicted pages were handed back meanwhile,
    and the read faulted them in from the host); with 1 s a load still saw up to 254 MiB handed
    back during it in a round (C16), recorded in ``*_vm_mib``.

    Called right before each timed cold read, after its eviction, so that every reader starts
    from the same state of the machine. Without it a read paid for memory freed 1-3 s before
    it (the kernel hands free 8 MB blocks back about 2 s after they are freed), and which read
    paid depended on its place in the round: issue 33, one process, the 1.26 GB DDP state, 9
    rounds each, a coci load right after a coci save (a save frees what it staged) took
    0.39-0.70 s, the slow ones while 384-512 MiB were handed back during them, against a raw
    read right after a raw write of 0.30-0.36 s with nothing handed back; settled, coci's
    0.41-0.54 s, nothing handed back during any of them."""
    import time

    start = vm_reported_mib()
    if start is None:
        return 0.0, 0.0
    t0 = time.perf_counter()
    last, since = start, t0
    while time.perf_counter() - t0 < most_s:
        time.sleep(0.1)
        now = vm_reported_mib() or 0.0
        if now != last:
            last, since = now, time.perf_counter()
        elif time.perf_counter() - since >= quiet_s:
            break
    return time.perf_counter() - t0, last - start


def rate_until(ends: Sequence[float], t_end: float) -> float:
    """Training steps per second over [0, ``t_end``] from the steps' end times (seconds since
    the same origin, ascending): the steps ended by ``t_end`` plus the part of the step running
    at ``t_end`` (by its own length). A persist's interference is measured over the persist
    alone, not up to the poll that commits it a step or more later (issue 33)."""
    if t_end <= 0 or not ends:
        return float("nan")
    done, prev = 0.0, 0.0
    for e in ends:
        if e <= t_end:
            done, prev = done + 1.0, e
        else:
            done += (t_end - prev) / (e - prev)
            return done / t_end
    return done / prev if prev > 0 else float("nan")  # no step ran past t_end: the steps' own rate


def _files(p: Path) -> list[Path]:
    """``p`` if a file, else every file under it. os.walk, not rglob: the reaper may remove a
    retired step's directory while it is listed, and rglob then raised FileNotFoundError out of
    its scandir (a benchmark run of 2026-11-30 ended on it); os.walk skips a directory it can no
    longer list."""
    return [p] if p.is_file() else [Path(d) / n for d, _, names in os.walk(p) for n in names]


def evict(paths: Iterable[Path], keep: Iterable[Path] = ()) -> str:
    """Evict these files (every file under a directory), but those in ``keep``, from the page
    cache: fsync, then ``posix_fadvise(DONTNEED)``. Never a global ``drop_caches``: that also
    evicts what a job would still have cached (its libraries, coci's spare data file, which its
    next save writes over) and the rest of a shared machine's. Files that vanish meanwhile
    (retention's reaper) are skipped. Returns the method's name for the JSON."""
    kept = {Path(k) for k in keep}
    for p in map(Path, paths):
        for f in _files(p):
            if f in kept or not f.is_file():
                continue
            try:
                fd = os.open(f, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def cached(path: Path) -> bool:
    """Whether any page of the file is in the page cache: ``mincore`` over a mapping of it, which
    reads nothing (a probing read that may not wait, ``RWF_NOWAIT``, starts the readahead it
    probes for, and on this VM's disk that read now and then completed in time to succeed: the
    evict test's probe failed CI on 2026-11-30, one check in about 200 here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _any_cached(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def cached_mib(paths: Iterable[Path]) -> float:
    """MiB of these files (every file under a directory) in the page cache (``mincore``, as
    :func:`cached`): what a cold read of them would not read from the disk."""
    pages = 0
    for p in map(Path, paths):
        for f in _files(p):
            try:
                fd = os.open(f, os.O_RDONLY)
            except (FileNotFoundError, IsADirectoryError):
                continue
            try:
                pages += _resident_pages(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
    return pages * mmap.PAGESIZE / 2**20


def _any_cached(fd: int, size: int) -> bool:
    return _resident_pages(fd, size) > 0


def _resident_pages(fd: int, size: int) -> int:
    if size <= 0:
        return 0
    import numpy as np

    from coci_hpc.checkpoint.rawio import _the_libc  # the store's one loader of the C library

    libc = _the_libc()
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        arr = np.frombuffer(mm, dtype=np.uint8)
        addr = arr.ctypes.data  # the mapping's address, as rawio.FileMap takes it
        del arr  # no export left when the mapping closes
        vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore failed: {os.strerror(err)}")
        return sum(b & 1 for b in bytes(vec))
    finally:
        mm.close()


def summary(samples: Mapping[str, Sequence[float]], cold: Mapping[str, float] | None = None
            ) -> dict[str, Any]:
    """``{key: median, key_min, key_max, key_cold}`` for every sampled key (cold where given)."""
    out: dict[str, Any] = {}
    for key, vals in samples.items():
        if not vals:
            continue
        out[key] = statistics.median(vals)
        out[f"{key}_min"] = min(vals)
        out[f"{key}_max"] = max(vals)
    for key, v in (cold or {}).items():
        out[f"{key}_cold"] = v
    return out


def rotate(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` started at position ``k`` (mod len): each writer takes every place in the order."""
    n = len(items)
    return list(items[k % n:]) + list(items[:k % n]) if n else []


def spread_table(figures: Mapping[str, Any], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{key: {median, min, max, cold}}`` for each of ``keys`` that :func:`summary` gave ``figures``:
    the JSON's ``spread``, beside the goal keys."""
    return {k: {"median": figures[k], "min": figures[f"{k}_min"], "max": figures[f"{k}_max"],
                "cold": figures.get(f"{k}_cold")} for k in keys if k in figures}


def spread(samples: Sequence[float]) -> str:
    """``median [min-max]`` for a table cell."""
    return f"{statistics.median(samples):.3f} [{min(samples):.2f}-{max(samples):.2f}]"


def slowest_rank(ranks: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each phase's slowest rank: ``{phase: max over ranks}`` of one round's per-rank phase times."""
    keys = sorted({k for r in ranks for k in r})
    return {k: round(max(r.get(k, 0.0) for r in ranks), 4) for k in keys}


def phase_breakdown(prefix: str, times: Sequence[float], phases: Sequence[Mapping[str, float]],
                    total: str) -> dict[str, Any]:
    """``{prefix_slowest, prefix_fastest, prefix_cold}``: the per-phase times (each phase's slowest
    rank, :func:`slowest_rank`) of the slowest and the fastest timed round and of the warm-up round,
    with the round's measured time as ``total``. ``phases`` has the warm-up round first, then one
    entry per timed round (``times``); nothing if they do not line up."""
    if not times or len(phases) != len(times) + 1:
        return {}
    worst, best = times.index(max(times)), times.index(min(times))
    return {f"{prefix}_slowest": {total: max(times), **phases[1 + worst]},
            f"{prefix}_fastest": {total: min(times), **phases[1 + best]},
            f"{prefix}_cold": dict(phases[0])}


def mapped_copy(comm: Any, path: Any, views: Sequence[Any], timed: Callable[[Callable[[], None]], float]) -> float:
    """The copy an all-or-nothing load pays after its last check, timed by ``timed`` (the
    benchmark's slowest-rank timer): ``path`` (the raw floor's file, holding ``views``' own bytes,
    read just before) is mapped and populated untimed, then copied into ``views`` (uint8 numpy
    views of the live tensors) with as many threads as coci's load copies with (the cores the
    rank may use, shared among the node's ranks on them), by the copy the load itself uses
    (``rawio.stream_copy``: streaming stores where ``coci_hpc._stream`` is built; until
    2026-11-30 ``numpy.copyto``). Nothing changes: the bytes are the same."""
    import os

    from coci_hpc.checkpoint.load import _node_ranks
    from coci_hpc.checkpoint.rawio import FileMap, copy_pool, copy_threads, stream_copy

    threads = copy_threads(_node_ranks(comm)[1])
    fd = os.open(path, os.O_RDONLY)
    fmap = FileMap.open(fd, os.fstat(fd).st_size)
    try:
        assert fmap is not None, "this kernel cannot populate a mapping (MADV_POPULATE_READ)"
        parts, off = [], 0
        for b in views:
            step = max(1, -(-b.nbytes // threads))
            parts += [(b[a:a + step], off + a) for a in range(0, b.nbytes, step)]
            off += b.nbytes
        fmap.populate(0, off)
        shares = [parts[k::threads] for k in range(threads)]

        def run(share: list[Any]) -> None:
            for d, at in share:
                stream_copy(d, fmap.view(at, d.nbytes))

        def copy() -> None:
            futures = [copy_pool().submit(run, sh) for sh in shares[1:]]
            run(shares[0])
            for f in futures:
                f.result()
        return timed(copy)
    finally:
        fmap.close()
        os.close(fd)


# The kernel hands free memory back in passes (mm/page_reporting.c): a pass runs 2 s after the
# first free it was asked about, hands back at most its budget (here ~640 MiB, reported in a
# burst of 128-MiB steps over ~0.3 s) and, if more is left, runs again 2 s later.
REPORT_PERIOD_S = 2.0


def wait_report_gap(*, burst_end_s: float = 0.15, quiet_s: float = REPORT_PERIOD_S + 0.2,
                    most_s: float = 8.0) -> float:
    """Wait until no free-page report can come for nearly :data:`REPORT_PERIOD_S`: until a
    report pass has just ended (the counter moved, then stood still ``burst_end_s``) or none
    was pending (it stood still ``quiet_s``, longer than the period); at most ``most_s``.
    Returns the seconds waited (0 where the kernel reports no free pages).

    :func:`settle_vm` stops after 1 s without a report, but a pass comes every 2 s while
    more is left to hand back (an evicted 1.26 GB file takes two): the next pass then fell on
    whatever ran next. Through :func:`warm_free_memory`, when the scratch write was quick, that
    was the cold read itself, and the pass handed back the page cache the scratch file had just
    freed for it (issue 33, DDP 1.26 GB on 2 ranks, runs C33-C35 of 2026-12-03: coci's loads
    after a scratch write of 0.4-1.5 s took 0.71-1.15 s, 640 MiB handed back during the median
    one; after writes of 3.1-3.2 s, every round, 0.58-0.70 s against a raw read of 0.51 s)."""
    if vm_reported_mib() is None:
        return 0.0
    import time

    t0 = time.perf_counter()
    last, moved_at = vm_reported_mib(), None
    while (now := time.perf_counter()) - t0 < most_s:
        v = vm_reported_mib()
        if v != last:
            last, moved_at = v, now
        elif moved_at is not None and now - moved_at >= burst_end_s:
            break  # a pass just ended: the next is a period away
        elif moved_at is None and now - t0 >= quiet_s:
            break  # none pending
        time.sleep(0.01)
    return time.perf_counter() - t0


def warm_free_memory(directory: Path, nbytes: int, *, sync: bool = True) -> float:
    """Write ``nbytes`` into a scratch file in ``directory`` through the page cache, then drop it
    (``sync``: fsync, evict and delete; else delete at once, its dirty pages discarded); returns
    the seconds it took (0 where the kernel reports no free pages: bare metal).

    On a VM that hands free memory back to its host (:func:`vm_reported_mib`) a cold read
    filled its page cache fast from pages a file's eviction had freed moments before, and at
    about half the speed otherwise. Which it got depended on the writer, not the reader: a file
    written through the page cache (the raw floor, torch.save, DCP) freed its own pages when it
    was evicted before its read; coci's, written ``O_DIRECT``, had nothing to free. Called
    before each cold read (after its eviction and :func:`settle_vm`) so that every reader
    starts with the same freshly freed memory, as the raw floor always did. The scratch file is
    dropped right after a report pass, or with none pending (:func:`wait_report_gap`), so that
    no pass hands its pages back during the read; the seconds returned include that wait."""
    if vm_reported_mib() is None or nbytes <= 0:
        return 0.0
    import time

    t0 = time.perf_counter()
    path = Path(directory) / f".warm-{os.getpid()}"
    chunk = bytes(8 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            for off in range(0, nbytes, len(chunk)):
                os.pwrite(fd, chunk[:min(len(chunk), nbytes - off)], off)
        finally:
            os.close(fd)
        # freed right after a report pass (or with none pending), so that no pass hands the freed
        # pages back before the read that follows has filled them (wait_report_gap)
        wait_report_gap()
        if sync:
            evict([path])
    finally:
        path.unlink(missing_ok=True)   # a failed write (a full disk) leaves no scratch file behind
    return time.perf_counter() - t0


def ready_cold_read(paths: Iterable[Path], keep: Iterable[Path] = (), *, scratch: Path, nbytes: int,
                    settle: bool = True, warm: bool = True) -> tuple[str, float, float]:
    """Rank 0's part before a timed cold read, shared by the benchmarks: evict ``paths`` (but
    ``keep``, :func:`evict`), then (``settle``) wait for the VM to stop handing memory back
    (:func:`settle_vm`), then (``warm``) free ``nbytes`` of fresh page cache through a scratch
    file in ``scratch`` (:func:`warm_free_memory`). Returns (the eviction's method, seconds
    settled, seconds warming)."""
    method = evict(paths, keep=keep)
    waited = settle_vm()[0] if settle else 0.0
    warmed = warm_free_memory(scratch, nbytes, sync=False) if warm else 0.0
    return method, waited, warmed
