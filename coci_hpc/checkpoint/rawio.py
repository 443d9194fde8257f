"""Moving tensor bytes between memory and the contiguous HDF5 datasets of a checkpoint file.

Datasets are created contiguous, allocated early and never filled, so each has a fixed byte
offset in its file (``H5Dget_offset``). Data then moves with the cheapest call there is:
``os.pwrite``/``os.preadv`` (no MPI, no HDF5, GIL released) or one MPI-IO ``Write_at_all`` per
round (collective, carrying the MPI-IO hints). Checksums (hardware CRC-32C, which releases the
GIL) are computed in a helper thread while the writes run, so they cost no wall time on a spare
core. Every write checks its byte count: Open MPI's ``Write_at_all`` reports a full disk as
success with a short count, and a checkpoint with missing bytes must never commit.
"""
from __future__ import annotations

import bisect
import contextlib
import errno
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from coci_hpc.checkpoint.integrity import CHECKSUM, FOLD_CRC32C, checksum, copy_checksum
from coci_hpc.errors import CheckpointError

_CHUNK = 256 << 20  # bytes per write call: bounded so progress and errors surface promptly
# A guarded MPI-IO call (write_mpiio(guard=)) gets the peer deadline plus its bytes at this rate:
# a slow filesystem must not pass for a dead peer (20 MB/s: 13 s more for a 256 MiB round).
GUARD_BYTES_PER_S = 20e6


@dataclass(frozen=True)
class WriteItem:
    """``buf`` (a 1-D uint8 view) goes to ``offset`` of the file; ``crc``: its CRC-32C where the
    copy that filled it computed it on the way (:func:`~coci_hpc.checkpoint.integrity.copy_checksum`),
    else None and the writer's checksum thread computes it."""

    offset: int
    buf: np.ndarray
    crc: int | None = None


def _crcs(items: Sequence[WriteItem]) -> tuple[list[int], float]:
    """The items' CRC-32Cs (those their copies did not compute) and the CPU seconds they took in
    this (the checksum) thread."""
    c0 = time.thread_time()
    return [it.crc if it.crc is not None else checksum(it.buf, CHECKSUM) for it in items], time.thread_time() - c0


_pool: ThreadPoolExecutor | None = None


def lower_thread_priority(nice: int = 10) -> None:
    """Make the calling thread nicer than the training threads (Linux: per-thread nice).

    Background persist and checksum threads then only use CPU the training loop leaves idle;
    with nothing else running (a synchronous save) nice changes nothing.
    """
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except (AttributeError, OSError):
        pass


def background() -> ThreadPoolExecutor:
    """The one helper thread for checksums of writes, at a lower priority."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="coci-crc", initializer=lower_thread_priority)
    return _pool


_load_pool: ThreadPoolExecutor | None = None


def load_helper() -> ThreadPoolExecutor:
    """The one helper thread of a load, at normal priority: a load blocks the training loop,
    so its checksums and copies must not yield to other work as a background persist does."""
    global _load_pool
    if _load_pool is None:
        _load_pool = ThreadPoolExecutor(1, thread_name_prefix="coci-load")
    return _load_pool


_copy_pool: ThreadPoolExecutor | None = None
MAX_COPY_THREADS = 8


def copy_pool() -> ThreadPoolExecutor:
    """Threads for the copies of a load beside the calling thread (see :func:`copy_threads`)."""
    global _copy_pool
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(MAX_COPY_THREADS - 1, thread_name_prefix="coci-copy")
    return _copy_pool


def copy_threads(sharing: int = 1) -> int:
    """Threads one rank may copy with: the cores it may run on, divided among the ``sharing``
    ranks of its node that may run on the same cores. A rank bound to one core (Open MPI binds
    each of 1 or 2 ranks to a core by default) copies in one thread: a second one on the same
    core would only add switches."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_COPY_THREADS, cores // max(1, sharing)))


_stream: Any  # coci_hpc._stream, or None
try:  # built from coci_hpc/_stream.c where the install had a C compiler (optional)
    from coci_hpc import _stream as _built

    _stream = _built
except ImportError:  # pragma: no cover - an install without a compiler
    _stream = None

STREAM_MIN = 1 << 20  # bytes from which stream_copy streams (smaller copies stay in the cache)
STREAM_STORES = _stream.STORES if _stream is not None else None  # "avx2", "sse2", "memcpy" or None


def stream_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``numpy.copyto(dst, src)`` for a copy whose destination is not read again soon (the bytes
    a load installs into the state): from :data:`STREAM_MIN` bytes, two C-contiguous arrays of
    one dtype and shape are copied with non-temporal stores (``coci_hpc._stream``; why, and the
    measurement, in its source), anything else by ``numpy.copyto``. Releases the GIL either way."""
    if (_stream is not None and dst.nbytes >= STREAM_MIN and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.flags.c_contiguous and src.flags.c_contiguous):
        _stream.copy(dst, src)
    else:
        np.copyto(dst, src)


_times = threading.local()


def last_write_times() -> dict[str, float]:
    """``{"write_s", "sync_s"}`` of the last :func:`write_posix` / :func:`write_mpiio` of the
    calling thread: the save's phase times name the slow part (issue 33); and the CPU seconds
    it used, ``write_cpu_s`` in the calling thread and ``crc_cpu_s`` in the checksum thread
    (what a background persist takes from training on busy cores)."""
    return dict(getattr(_times, "last", {}))


def pwrite_all(fd: int, buf: np.ndarray, offset: int) -> None:
    """Write all of ``buf`` at ``offset``: a short write is retried, one that writes nothing fails."""
    mv = memoryview(buf).cast("B")  # type: ignore[arg-type]  # numpy types its buffer protocol for Python >= 3.12 only
    done = 0
    while done < len(mv):
        n = os.pwrite(fd, mv[done:done + _CHUNK], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset + done}, "
                          f"{len(mv) - done} bytes left (disk full?)")
        done += n


DIRECT_ALIGN = 4096


HUGE_PAGE = 2 << 20


def aligned_empty(nbytes: int, huge: bool = False) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous mmap), usable for O_DIRECT writes.

    ``huge``: from :data:`HUGE_PAGE` bytes, private memory aligned to 2 MiB and advised for
    transparent huge pages (where the kernel has them), and not inherited by forked processes. An
    ``O_DIRECT`` write pins every page of its buffer, and with 2-MiB pages that costs a tenth of
    the CPU (640 MB written from a reused buffer, one core of the development VM: 0.002 s against
    0.019-0.032 s): the CPU an asynchronous persist takes from training on busy cores (issue 33).
    Not inherited (``MADV_DONTFORK``): a data loader's worker forked while the buffer exists would
    otherwise make every later copy into it pay a copy-on-write fault per page."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    import mmap

    if not huge or nbytes < HUGE_PAGE:
        return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mm, dtype=np.uint8)
    at = -whole.ctypes.data % HUGE_PAGE
    for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        with contextlib.suppress(AttributeError, OSError, ValueError):   # a kernel without it
            mm.madvise(getattr(mmap, advice), at, size)
    return whole[at:at + nbytes]


def open_direct(path: str | os.PathLike) -> int | None:
    """A second, ``O_DIRECT`` write descriptor of an existing file; None where refused."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None  # filesystem without O_DIRECT (tmpfs, some FUSE)


_DIRECT_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def pwrite_pages(fd: int, dfd: int | None, buf: np.ndarray, offset: int) -> int | None:
    """Write ``buf`` at ``offset``: its whole pages through ``dfd`` (an ``O_DIRECT`` descriptor
    of the same file, :func:`open_direct`) where buffer and offset are page-aligned, the rest
    through ``fd``. Returns the direct descriptor to go on with: None once the filesystem
    refused a direct write after all (EINVAL or EOPNOTSUPP: it opened ``O_DIRECT`` but cannot do
    it for this write; ``dfd`` is then closed and these bytes go through ``fd``). Any other error (a full
    disk, an I/O error) is raised: writing the same bytes buffered would only fail later."""
    n = buf.nbytes
    whole = 0
    if dfd is not None and n and offset % DIRECT_ALIGN == 0 and buf.ctypes.data % DIRECT_ALIGN == 0:
        whole = n - n % DIRECT_ALIGN
        if whole:
            try:
                pwrite_all(dfd, buf[:whole], offset)
            except OSError as exc:
                if exc.errno not in _DIRECT_REFUSED:
                    raise
                os.close(dfd)
                dfd, whole = None, 0
    if n > whole:
        pwrite_all(fd, buf[whole:], offset + whole)
    return dfd


def write_posix(path: str | os.PathLike, items: Sequence[WriteItem], *, fsync: bool = True,
                direct: bool = False) -> list[int]:
    """Write items with pwrite (no MPI); return their CRC-32Cs. Independent per rank.

    ``direct``: write whole pages with O_DIRECT (no page-cache copy and no writeback work:
    about a quarter of the CPU time of buffered writes, which matters when training runs beside
    the writer, and no fresh page cache to take per save). Page-aligned items (the async save's
    snapshot buffers) go straight from their memory; an item of :data:`STAGE_MIN` bytes or more
    that is not page-aligned (a live tensor: the sync save) is staged through this process's two
    reused aligned buffers (:func:`_write_staged`). The partial pages at either end of each
    write, and small items, go through the page cache. Falls back to buffered writes where
    O_DIRECT is refused.
    """
    fd = os.open(path, os.O_WRONLY)
    dfd = open_direct(path) if direct else None
    staged = [it for it in items if dfd is not None and _stage_it(it)]
    ids = {id(it) for it in staged}
    fused = bool(staged) and FUSED_COPY_CRC
    # the checksum thread takes what no copy computes on the way
    fut = background().submit(_crcs, [it for it in items if not (fused and id(it) in ids)])
    t0, c0 = time.perf_counter(), time.thread_time()
    t1 = t0
    got: dict[int, int] = {}
    try:
        for it in items:
            if id(it) not in ids:
                dfd = pwrite_pages(fd, dfd, it.buf, it.offset)
        if staged:
            dfd, got = _write_staged(fd, dfd, staged, fused)
        t1 = time.perf_counter()
        if fsync:
            os.fsync(fd)
    finally:
        _times.last = {"write_s": t1 - t0, "sync_s": time.perf_counter() - t1,
                       "write_cpu_s": time.thread_time() - c0}
        os.close(fd)
        if dfd is not None:
            os.close(dfd)
    rest, _times.last["crc_cpu_s"] = fut.result()
    it_rest = iter(rest)
    return [got[id(it)] if id(it) in got else next(it_rest) for it in items]


# The sync save's staging (issue 33). Its items are the live tensors' bytes, not page-aligned,
# so without staging they go through the page cache: 1.26 GB of fresh page cache per save of
# the DDP benchmark, and on the development VM (which hands freed memory back to its host within
# seconds) taking that memory cost more than writing the bytes. Staged through two reused 64-MiB
# buffers and written O_DIRECT, 2 ranks x 630 MB into one file: 0.50-0.74 s per save against
# 0.74-1.25 s buffered (pwrite + fsync, alternating rounds, same run). The copy into one buffer
# overlaps the write from the other; where the CPU has the folded CRC-32C the copy computes the
# checksum on the way, so the bytes are read once.
STAGE_MIN = 1 << 20          # smaller items go through the page cache from their own memory
STAGE_CHUNK = 64 << 20       # bytes per staged write; two such buffers per process, kept
FUSED_COPY_CRC = FOLD_CRC32C is not None and CHECKSUM == "crc32c"
_stage_lock = threading.Lock()   # one staged write at a time per process: the buffers are shared
_stage_bufs: list[np.ndarray] = []
_stage_pool: ThreadPoolExecutor | None = None


def _stage_it(it: WriteItem) -> bool:
    """Whether ``it`` is staged: large, and not already page-aligned in memory and in the file."""
    return it.buf.nbytes >= STAGE_MIN and not (it.offset % DIRECT_ALIGN == 0
                                               and it.buf.ctypes.data % DIRECT_ALIGN == 0)


def _stage_buffers(largest: int) -> list[np.ndarray]:
    """The two staging buffers, each of ``min(largest, STAGE_CHUNK)`` bytes and a page more (a
    write starts at the file offset's place in its page), allocated once and grown when a
    larger save needs it. Kept: a buffer freed and allocated again would take fresh memory."""
    global _stage_pool
    need = min(largest, STAGE_CHUNK) + DIRECT_ALIGN
    if not _stage_bufs or _stage_bufs[0].nbytes < need:
        _stage_bufs[:] = [aligned_empty(need, huge=True) for _ in range(2)]
    if _stage_pool is None:
        _stage_pool = ThreadPoolExecutor(1, thread_name_prefix="coci-stage")
    return _stage_bufs


def release_staging() -> None:
    """Free the staging buffers (a manager's ``close``); the next staged write allocates them
    again. Waits for a staged write in flight."""
    with _stage_lock:
        _stage_bufs.clear()


def _write_span(fd: int, dfd: int | None, buf: np.ndarray, offset: int) -> int | None:
    """Write ``buf`` (placed at ``offset % DIRECT_ALIGN`` of an aligned buffer) at ``offset``:
    the partial first page through ``fd``, the rest by :func:`pwrite_pages`."""
    head = min(-offset % DIRECT_ALIGN, buf.nbytes)
    if head:
        pwrite_all(fd, buf[:head], offset)
    return pwrite_pages(fd, dfd, buf[head:], offset + head)


def _write_staged(fd: int, dfd: int | None, items: Sequence[WriteItem], fused: bool
                  ) -> tuple[int | None, dict[int, int]]:
    """Write ``items`` through the staging buffers, in :data:`STAGE_CHUNK` parts: the part k is
    copied into buffer k % 2 while the part k - 1 is written from the other in a helper thread.
    Returns the direct descriptor to go on with and, when ``fused``, each item's CRC-32C (keyed
    by ``id``). Waits for the write in flight before it returns or raises: the descriptors and
    the buffers must outlive it."""
    crcs: dict[int, int] = {}
    with _stage_lock:
        bufs = _stage_buffers(max(it.buf.nbytes for it in items))
        pool = _stage_pool
        assert pool is not None
        pending: Any = None
        k = 0
        try:
            for it in items:
                value = 0
                for i in range(0, it.buf.nbytes, STAGE_CHUNK):
                    part = it.buf[i:i + STAGE_CHUNK]
                    off = it.offset + i
                    at = off % DIRECT_ALIGN
                    dst = bufs[k % 2][at:at + part.nbytes]
                    k += 1
                    crc = copy_checksum(dst, part, CHECKSUM, value) if fused else None
                    if crc is None:
                        stream_copy(dst, part)
                        if fused:   # the fold declined this part (it takes every staged one here)
                            crc = checksum(part, CHECKSUM, value)  # pragma: no cover
                    if crc is not None:
                        value = crc
                    if pending is not None:
                        dfd, pending = pending.result(), None
                    pending = pool.submit(_write_span, fd, dfd, dst, off)
                if fused:
                    crcs[id(it)] = value
            if pending is not None:
                dfd, pending = pending.result(), None
        finally:
            if pending is not None:   # an error in the copy: let the write in flight finish first
                with contextlib.suppress(BaseException):
                    pending.result()
    return dfd, crcs


def write_mpiio(mpi_comm: Any, path: str | os.PathLike, items: Sequence[WriteItem], info: Any = None,
                *, fsync: bool = True, guard: Any = None) -> list[int]:
    """Collective MPI-IO writes (one ``Write_at_all`` per round); every rank of ``mpi_comm`` calls it.

    Rounds = the largest number of chunks on any rank; a rank with fewer writes an empty
    buffer in the remaining rounds (legal in MPI-IO, unlike zero-size HDF5 selections).

    ``guard``: a :class:`~coci_hpc.comm.Comm` whose peer deadline bounds each collective call
    (they cannot be polled; :meth:`~coci_hpc.comm.Comm.guard`), with time for the bytes on top at
    ``GUARD_BYTES_PER_S``, so a slow disk is not taken for a dead peer.
    """
    from mpi4py import MPI

    def guarded(what: str, nbytes: int = 0) -> Any:
        if guard is None:
            return contextlib.nullcontext()
        return guard.guard(what, allow_s=nbytes / GUARD_BYTES_PER_S)

    fut = background().submit(_crcs, items)
    chunks: list[tuple[int, memoryview]] = []
    for it in items:
        mv = memoryview(it.buf).cast("B")  # type: ignore[arg-type]  # numpy types its buffer protocol for Python >= 3.12 only
        for i in range(0, len(mv), _CHUNK):
            chunks.append((it.offset + i, mv[i:i + _CHUNK]))
    total = sum(len(mv) for _, mv in chunks)
    t0 = time.perf_counter()
    t1 = t0
    c0 = time.thread_time()
    with guarded("the MPI-IO write's agreement on rounds"):
        rounds = mpi_comm.allreduce(len(chunks), op=MPI.MAX)
    with guarded("MPI_File_open (collective)"):
        fh = MPI.File.Open(mpi_comm, str(path), MPI.MODE_WRONLY, info if info is not None else MPI.INFO_NULL)
    short: str | None = None
    try:
        empty = np.empty(0, dtype=np.uint8)
        status = MPI.Status()
        for i in range(rounds):
            # A rank that saw a short write keeps joining the collective rounds (with nothing to
            # write) so the others do not hang; the error is raised after the last round.
            if i < len(chunks) and short is None:
                off, mv = chunks[i]
                try:
                    with guarded("MPI_File_write_at_all", len(mv)):
                        fh.Write_at_all(off, [mv, MPI.BYTE], status)
                    got = status.Get_count(MPI.BYTE)
                except MPI.Exception as exc:  # this rank only: keep joining the rounds
                    got, why = -1, f"MPI-IO write failed at offset {off} of {path}: {exc}"
                if got != len(mv):
                    short = why if got < 0 else (f"MPI-IO wrote {got} of {len(mv)} bytes at offset "
                                                 f"{off} of {path} (disk full or quota exceeded?)")
            else:
                with guarded("MPI_File_write_at_all", _CHUNK):
                    fh.Write_at_all(0, [empty, MPI.BYTE])
        t1 = time.perf_counter()
        # MPI_File_sync is collective: every rank must agree whether to call it.
        with guarded("the MPI-IO write's agreement on success"):
            any_short = mpi_comm.allreduce(short is not None, op=MPI.LOR)
        if fsync and not any_short:
            with guarded("MPI_File_sync", total):
                fh.Sync()
    finally:
        with guarded("MPI_File_close"):
            fh.Close()
        _times.last = {"write_s": t1 - t0, "sync_s": time.perf_counter() - t1,
                       "write_cpu_s": time.thread_time() - c0}
    crcs, _times.last["crc_cpu_s"] = fut.result()
    if short is not None:
        raise CheckpointError(short, hint="free space (df, lfs quota) or lower keep=; nothing was "
                                          "committed and the previous checkpoint is intact")
    return crcs


def pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    if buf.nbytes >= _CHUNK:
        os.posix_fadvise(fd, offset, buf.nbytes, os.POSIX_FADV_SEQUENTIAL)
    mv = memoryview(buf).cast("B")  # type: ignore[arg-type]  # numpy types its buffer protocol for Python >= 3.12 only
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:done + _CHUNK]], offset + done)
        if n <= 0:
            raise EOFError(f"file ends at offset {offset + done}, {len(mv) - done} bytes short")
        done += n


_MADV_POPULATE_READ = 22  # Linux >= 5.14: map (and read in) a range; errors come back as errno
_libc: Any = None


def _the_libc() -> Any:
    """The C library (ctypes), or False where it cannot be had."""
    global _libc
    if _libc is None:
        import ctypes

        try:
            # The running process's own symbols: libc is loaded already. ctypes.util.find_library
            # would run `ldconfig -p` in a subprocess (about 70 ms, paid by the first load of
            # every restarted job), so it is only the fallback.
            lib: Any = ctypes.CDLL(None, use_errno=True)
            lib.madvise  # noqa: B018  # AttributeError where the process has no madvise
        except (OSError, AttributeError):
            import ctypes.util

            name = ctypes.util.find_library("c")
            lib = ctypes.CDLL(name, use_errno=True) if name else False
        _libc = lib
        if _libc:
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            _libc.fallocate.restype = ctypes.c_int
    return _libc


def _madvise() -> Any:
    lib = _the_libc()
    return lib.madvise if lib else None


FALLOC_KEEP_SIZE, FALLOC_PUNCH_HOLE = 0x01, 0x02


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """Linux ``fallocate(2)`` (the system call: unlike ``posix_fallocate`` it never falls back to
    writing zeros); OSError where the filesystem refuses ``mode``."""
    lib = _the_libc()
    if not lib:
        raise OSError("fallocate: no C library")
    if lib.fallocate(fd, mode, offset, length) != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"fallocate: {os.strerror(err)}")


def preallocate(fd: int, size: int) -> bool:
    """Give the file its blocks for [0, size) now (unwritten extents; the file reads as before).
    On ext4 writing into preallocated blocks skips the allocation a new file's writeback does
    (issue 33: 2 x 512 MB pwrite + fsync into a new file 1.09 s median, preallocated 0.61 s).
    False where the filesystem does not allocate ahead: nothing changed."""
    try:
        fallocate(fd, FALLOC_KEEP_SIZE, 0, size)
        return True
    except OSError:
        return False


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault in (zeroed, writable) pages of a range


def prefault(bufs: Sequence[np.ndarray]) -> None:
    """Fault in the pages of fresh, not yet touched buffers (``MADV_POPULATE_WRITE``), so that
    the first write into them later is a plain memcpy. A load calls it, in a helper thread,
    for the fresh tensors it will fill while its own thread waits for the disk: on this machine
    a first touch of fresh memory costs 0.4-1 s per GB, as much as the cold read. Only whole
    pages inside each buffer are touched (their contents are undefined until filled anyway);
    where the kernel lacks the call, nothing happens (the copy then faults them in)."""
    madvise = _madvise()
    if madvise is None:
        return
    for b in bufs:
        a0 = -(-int(b.ctypes.data) // _PAGE) * _PAGE
        a1 = (int(b.ctypes.data) + b.nbytes) // _PAGE * _PAGE
        if a1 > a0 and madvise(a0, a1 - a0, _MADV_POPULATE_WRITE) != 0:
            return


class FileMap:
    """A read-only shared mapping of a whole file, for reading checked bytes without copies.

    A load reads each byte twice: once to check its CRC, once into the state. Through a
    mapping both are plain memory reads of the page cache (no copy into a user buffer first),
    and the pages stay mapped between the two. Every range is populated with
    ``MADV_POPULATE_READ`` before it is touched, so a read error (a bad sector, an I/O error on
    a parallel file system, a file truncated under us) comes back here as an OSError, never
    as a SIGBUS in the middle of a memcpy. :meth:`open` returns None where this is not
    available (no mmap, a kernel before 5.14, an empty file): the caller preads instead.
    """

    def __init__(self, mm: Any, arr: np.ndarray) -> None:
        self._mm: Any = mm
        self._arr: np.ndarray | None = arr
        self._base = int(arr.ctypes.data)
        self._done: list[list[int]] = []  # [start, stop) ranges populated so far, merged, sorted
        self._lock = threading.Lock()  # copies populate from several threads

    @classmethod
    def open(cls, fd: int, size: int) -> FileMap | None:
        import mmap

        if size <= 0 or _madvise() is None:
            return None
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        fm = cls(mm, np.frombuffer(mm, dtype=np.uint8))
        try:
            fm.populate(0, 1)
        except OSError:  # EINVAL: the kernel has no MADV_POPULATE_READ (or the read failed)
            fm.close()
            return None
        return fm

    def populate(self, at: int, n: int) -> None:
        """Map bytes [at, at+n), reading them in if needed; OSError if they cannot be read.

        A range this mapping populated before is not walked again (about 25 ms per GB of page
        tables here): its pages stay mapped unless memory pressure reclaims them, and only a
        read error on reading such a page in again would then reach a memcpy as a SIGBUS."""
        if n <= 0 or self._covered(at, at + n):
            return
        page = _PAGE
        a0 = (self._base + at) // page * page
        a1 = -(-(self._base + at + n) // page) * page
        madvise = _madvise()
        if madvise(a0, a1 - a0, _MADV_POPULATE_READ) != 0:
            import ctypes

            err = ctypes.get_errno()
            raise OSError(err, f"reading bytes [{at}, {at + n}) of the file failed: {os.strerror(err)}")
        self._note(at, at + n)

    def _covered(self, a: int, b: int) -> bool:
        with self._lock:
            i = bisect.bisect_right(self._done, [a, float("inf")]) - 1
            return i >= 0 and self._done[i][0] <= a and b <= self._done[i][1]

    def _note(self, a: int, b: int) -> None:
        """Add [a, b) to the populated ranges, merging it with those it touches."""
        with self._lock:
            self._merge(a, b)

    def _merge(self, a: int, b: int) -> None:
        done = self._done
        i = bisect.bisect_left(done, [a, a])
        if i > 0 and done[i - 1][1] >= a:
            i -= 1
        j = i
        while j < len(done) and done[j][0] <= b:
            a, b = min(a, done[j][0]), max(b, done[j][1])
            j += 1
        done[i:j] = [[a, b]]

    def view(self, at: int, n: int) -> np.ndarray:
        """Bytes [at, at+n) as a read-only array, populated first (see :meth:`populate`)."""
        assert self._arr is not None
        self.populate(at, n)
        return self._arr[at:at + n]

    def close(self, *, wait: bool = True) -> None:
        """Unmap the file. ``wait=False`` leaves the unmapping to the load's helper thread:
        tearing down the mapping of a large file takes 10-70 ms here, and nothing waits for it
        (``mmap.close`` releases the GIL while it unmaps)."""
        self._arr = None
        mm, self._mm = self._mm, None
        if mm is None:
            return
        if wait:
            _unmap(mm)
        else:
            load_helper().submit(_unmap, mm)


def _unmap(mm: Any) -> None:
    try:
        mm.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with it
        pass


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
