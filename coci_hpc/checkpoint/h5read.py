"""Reading a checkpoint file: byte ranges of its datasets into the caller's buffers, every byte
checked against the CRC of the shards that cover it before the caller may use it.

The file is opened through :mod:`.h5check` (nothing in it trusted), the shards looked up in
:mod:`.shards`; the bytes come by ``pread`` or from the file's mapping, and the CRCs run in the
load's helper thread and the copies in the copy pool (:mod:`.rawio`).
"""
from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coci_hpc.checkpoint.h5check import H5_ERRORS, checked_offset, only_named_datasets, open_untrusted
from coci_hpc.checkpoint.integrity import checksum
from coci_hpc.checkpoint.rawio import FileMap, aligned_empty, copy_pool, load_helper, pread_into, stream_copy
from coci_hpc.checkpoint.shards import ShardIndex, ShardKey
from coci_hpc.errors import CheckpointCorrupt

_READ_CHUNK = 8 << 20  # bytes per read (or per CRC call over the mapping) while checking

_MIN_COPY_SHARE = 32 << 20  # a copy thread gets at least this many bytes (else: fewer threads)
_MAP_CHUNK = 64 << 20  # bytes per populate call: a failure names its range promptly
_SMALL_RUN = 64 << 10  # a box whose runs average less is mapped by its extent, not run by run
PASS1_MAPPED = True  # check over the file's mapping (False: stream; see DatasetReader.verify)


class _stream_buffers:
    """Two reused buffers of at least ``size`` bytes for the streamed check, kept for the next
    load (a first touch of fresh memory is slow here: ~0.4 GB/s); a load that finds them in
    use (another thread loading) gets its own."""

    _kept: list[np.ndarray] = []
    _lock = threading.Lock()

    def __init__(self, size: int) -> None:
        self.size = size
        self.owned = False

    def __enter__(self) -> list[np.ndarray]:
        if self.size <= 0:
            return []
        cls = type(self)
        self.owned = cls._lock.acquire(blocking=False)
        if not self.owned:
            return [aligned_empty(self.size) for _ in range(2)]
        if not cls._kept or cls._kept[0].nbytes < self.size:
            cls._kept = [aligned_empty(self.size) for _ in range(2)]
        return cls._kept

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            type(self)._lock.release()


class ScratchCopies:
    """Scratch destinations (bytes, file offset) that :meth:`DatasetReader.verify` fills while it
    checks: buffers made for this load that nothing of the state sees until every check passed
    (a fresh optimizer's moment targets, fresh buffers for objects loaded by copy). Their bytes
    are copied in the load's helper thread right after their CRC, while the next chunk comes
    from the disk, instead of in a copy after the last check (issue 33). A failed check leaves
    them half filled, and they are dropped with the load.

    Only the verifying thread's helper writes them, one chunk after another, and then
    :meth:`DatasetReader.prefetch` (the shards other ranks of the node check), so the counts need
    no lock; :meth:`full` is read after both returned."""

    def __init__(self, pieces: Sequence[tuple[np.ndarray, int]]) -> None:
        self._pieces = sorted(((at, d.reshape(-1).view(np.uint8)) for d, at in pieces if d.nbytes),
                              key=lambda p: p[0])
        self._starts = [at for at, _ in self._pieces]
        self._got = [0] * len(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    def copy(self, part: np.ndarray, at: int) -> None:
        """Copy ``part`` (the file's bytes [at, at+len)) into every piece it overlaps."""
        end = at + part.nbytes
        i = max(0, bisect.bisect_right(self._starts, at) - 1)
        while i < len(self._pieces) and self._pieces[i][0] < end:
            p0, dest = self._pieces[i]
            a, b = max(p0, at), min(p0 + dest.nbytes, end)
            if a < b:
                stream_copy(dest[a - p0:b - p0], part[a - at:b - at])
                self._got[i] += b - a
            i += 1

    def full(self, dest: np.ndarray, at: int) -> bool:
        """Whether the piece (``dest``, ``at``) was filled whole (by the shards this rank checked)."""
        i = bisect.bisect_left(self._starts, at)
        while i < len(self._pieces) and self._starts[i] == at:
            d = self._pieces[i][1]
            if d.ctypes.data == dest.ctypes.data and d.nbytes == dest.nbytes:
                return self._got[i] == d.nbytes
            i += 1
        return False


class DatasetReader:
    """Reads byte ranges of datasets of one checkpoint file into caller-provided buffers.

    With ``manifest`` (the parsed manifest of the checkpoint), the file must hold exactly the
    datasets it names, and every :meth:`read` checks the checksums of the shards it covers.
    """

    def __init__(self, path: str | os.PathLike, manifest: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self._file = open_untrusted(self.path)
        self._fd, self._size = self._file.fd, self._file.size
        # Loads check every dataset before reading any (so a failed load changes nothing), then
        # read: one HDF5 lookup per dataset, not two (each costs ~0.3 ms).
        self._offsets: dict[tuple[Any, ...], int] = {}
        self._algorithm: str | None = None
        self._shards = ShardIndex()
        self._verified: set[ShardKey] = set()
        self._map: FileMap | None | bool = False  # False: not tried yet (see _mapped)
        if manifest is not None:
            try:
                only_named_datasets(self.path, self._file.dataset_names(), manifest)
                self._shards = ShardIndex(manifest, self.path.name)
            except BaseException:
                self._file.close()
                raise
            self._algorithm = manifest["checksum"]

    def close(self) -> None:
        if isinstance(self._map, FileMap):
            self._map.close(wait=False)  # nothing reads through it any more
        self._map = None
        self._file.close()

    def _mapped(self) -> FileMap | None:
        """The file's read-only mapping (made once, kept until :meth:`close`), or None."""
        if self._map is False:
            self._map = FileMap.open(self._fd, self._size)
        assert self._map is not True
        return self._map

    def __enter__(self) -> DatasetReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def offset(self, meta: Mapping[str, Any]) -> int:
        """Byte offset of a dataset after checking it against its manifest entry."""
        key = (meta["dataset"], tuple(meta["shape"]), meta["dtype"], meta["nbytes"])
        off = self._offsets.get(key)
        if off is None:
            try:
                off = self._offsets[key] = checked_offset(self._file, self.path, meta)
            except H5_ERRORS as exc:
                raise CheckpointCorrupt(f"{self.path}: dataset {meta['dataset']!r}: HDF5 metadata is "
                                        f"damaged: {exc}", hint="the shard file is damaged; load an "
                                        "older step") from exc
        return off

    def read(self, meta: Mapping[str, Any], dest: np.ndarray, start: int = 0) -> None:
        """Fill ``dest`` (any contiguous array) with bytes [start, start+dest.nbytes) of a dataset.

        With a manifest, the bytes are checked against the CRC of every shard they overlap before
        this returns; a mismatch raises CheckpointCorrupt naming the shard (``dest`` then holds
        the bad bytes: callers load into scratch buffers or discard the state).
        """
        if dest.nbytes == 0:
            return
        if start < 0 or start + dest.nbytes > int(meta["nbytes"]):
            raise CheckpointCorrupt(f"{self.path}: read past the end of {meta['dataset']!r}",
                                    hint="manifest and request disagree")
        off = self.offset(meta)
        got = memoryview(dest.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy types its buffer protocol for Python >= 3.12 only
        whole = [] if self._algorithm is None else self._whole_shards(meta, start, start + len(got))
        try:
            if whole:
                self._read_checking(dest.reshape(-1).view(np.uint8), off + start, start, whole)
            else:
                pread_into(self._fd, dest, off + start)
        except (OSError, EOFError) as exc:
            raise CheckpointCorrupt(f"{self.path}: reading {meta['dataset']!r} failed: {exc}",
                                    hint="the shard file is damaged or truncated; load an older step") from exc
        for sh, crc in whole:
            self._check(meta, sh, crc[0])
        if self._algorithm is not None:
            self._verify(meta, got, start, off)  # shards the read covers only in part

    def _whole_shards(self, meta: Mapping[str, Any], start: int, stop: int) -> list[tuple[Any, list[int]]]:
        """Unverified shards lying wholly inside [start, stop), each with a running CRC."""
        out = []
        for key in self._shards.keys_in(meta["dataset"], start, stop):
            sh = self._shards.by_key[key]
            if "box" not in sh and start <= sh["start"] and sh["stop"] <= stop and key not in self._verified:
                out.append((sh, [0]))
        return out  # box shards (several runs) are checked by _verify

    def _read_checking(self, flat: np.ndarray, file_off: int, start: int,
                       whole: list[tuple[Any, list[int]]]) -> None:
        """Read ``flat`` in chunks; the CRCs of chunk k run in a helper thread while chunk k+1 is
        read (both release the GIL). On the 2-core dev machine this did not measurably beat
        checking after the read (benchmarks/verify_cost_bench.py); it cannot be slower by more
        than one chunk's CRC, and leaves room where reads wait on a parallel filesystem."""
        algorithm = self._algorithm
        assert algorithm is not None
        got = memoryview(flat)  # type: ignore[arg-type]  # numpy types its buffer protocol for Python >= 3.12 only

        def feed(c0: int, c1: int) -> None:
            for sh, crc in whole:  # one worker thread: each shard's chunks arrive in order
                a, b = max(sh["start"] - start, c0), min(sh["stop"] - start, c1)
                if a < b:
                    crc[0] = checksum(got[a:b], algorithm, crc[0])

        pending = None
        try:
            for c0 in range(0, len(got), _READ_CHUNK):
                c1 = min(len(got), c0 + _READ_CHUNK)
                pread_into(self._fd, flat[c0:c1], file_off + c0)
                if pending is not None:
                    pending.result()
                pending = load_helper().submit(feed, c0, c1)
        finally:
            if pending is not None:
                pending.result()

    def _check(self, meta: Mapping[str, Any], sh: Mapping[str, Any], crc: int) -> None:
        if crc != sh["crc"]:
            what = f"box at {sh['box'][0]} of shape {sh['box'][1]} (bytes [{sh['start']}, {sh['stop']}))" \
                if "box" in sh else f"bytes [{sh['start']}, {sh['stop']})"
            raise CheckpointCorrupt(
                f"{self.path}: shard {meta['dataset']!r} {what} written "
                f"by rank {sh['rank']} fails its checksum ({self._algorithm} {crc:08x}, manifest "
                f"{sh['crc']:08x})", hint="the data file is damaged; load an older step "
                                          "(load_latest falls back by itself)")
        self._verified.add((meta["dataset"], sh["start"]))

    def _verify(self, meta: Mapping[str, Any], got: memoryview, start: int, off: int) -> None:
        assert self._algorithm is not None
        stop = start + len(got)
        for key in self._shards.keys_in(meta["dataset"], start, stop):
            if key in self._verified:
                continue
            sh, runs = self._shards.by_key[key], self._shards.runs[key]
            if start <= sh["start"] and sh["stop"] <= stop:  # the bytes read hold all of its runs
                parts: list[Any] = [got[a - start:a - start + n] for a, n in runs]
            else:  # the read covers part of the shard: its CRC needs all of it
                data = np.empty(sum(n for _, n in runs), dtype=np.uint8)
                at = 0
                try:
                    for a, n in runs:
                        pread_into(self._fd, data[at:at + n], off + a)
                        at += n
                except (OSError, EOFError) as exc:
                    raise CheckpointCorrupt(f"{self.path}: reading {meta['dataset']!r} failed: {exc}",
                                            hint="the shard file is damaged; load an older step") from exc
                parts = [data]
            crc = 0
            for part in parts:
                crc = checksum(part, self._algorithm, crc)
            self._check(meta, sh, crc)

    def shards_of(self, ranges: Sequence[tuple[Mapping[str, Any], int, int]]) -> set[ShardKey]:
        """Keys (dataset, first byte) of the shards overlapping byte ranges ``(meta, start, stop)``."""
        return self._shards.keys_of(ranges)

    def shard_extent(self, key: ShardKey) -> tuple[int, int]:
        """(first byte in the file, bytes to its last) of the shard ``key`` (see :meth:`shards_of`);
        a box shard's runs lie in that extent with other boxes' runs between them."""
        dataset, first = key
        return self.offset(self._shards.metas[dataset]) + first, self._shards.span(key)

    def trust(self, keys: set[ShardKey]) -> None:
        """Count shards another rank of this node checked (the same page cache) as checked."""
        self._verified |= keys

    def verify(self, keys: set[ShardKey], start: float = 0.0, into: ScratchCopies | None = None) -> None:
        """Check the shards named by ``keys`` (see :meth:`shards_of`), each whole, against their
        checksums; raise CheckpointCorrupt naming the first bad one. ``into``: scratch buffers
        filled with the bytes as they are checked (:class:`ScratchCopies`).

        The shards are read in file order, begun at fraction ``start`` of their bytes and wrapped
        around (:func:`_rotated`): the load gives each rank of a node another ``start``, so that
        ranks reading interleaved halves of a sharded file do not read side by side (issue 33,
        2 processes, the halves of a 1 GB file interleaved in 32 MB blocks, after eviction, 9
        rounds in turns: 0.635 s median begun at 0 / 0.5 against 0.69 s both at 0; the
        benchmark's 1 GB FSDP2 load, in-process A/B, two runs of 9 rounds: 0.698 / 0.685 s
        against 0.752 / 0.711 s). Since the load deals each rank of a node one contiguous run
        of the file (``load._my_checks``), it begins every stream at 0 (``load.SPREAD_READS``).

        The CRC of one chunk runs in the load's helper thread while the next is read in (the
        populate call of the mapping, whose faults the kernel reads around: 8 MB here, the
        device's ``read_ahead_kb``). No hint is given: announcing the whole extent first
        (``WILLNEED``, until 2026-11-29) and marking the mapping sequential were both slower
        (issue 33: two processes reading the interleaved halves of one 1 GB file, 7 rotating
        rounds each, loaded machine: populate 0.64 / 0.70 / 0.82 s medians, with WILLNEED
        first 0.78 / 0.86 / 0.98, sequential 0.91; the load itself, in-process A/B on 2 ranks:
        DDP 1 GB 0.502 against 0.565 s, FSDP2 1 GB 1.03 / 1.22 against 1.28 / 1.24 s).
        The CRCs run straight over the file's mapping
        (:class:`~coci_hpc.checkpoint.rawio.FileMap`): no byte is copied and no fresh memory
        is touched (on this machine a first touch of fresh memory costs about as much as the
        cold read itself). :meth:`copy_verified` then copies the checked bytes, still mapped,
        straight into their final buffers: one memcpy in all.

        Without a mapping, or with ``PASS1_MAPPED`` off, the bytes are read with plain
        sequential ``pread`` calls into two small reused buffers instead (a copy more, but the
        kernel's own readahead then reads the file as a raw read does), and, where the file
        can be mapped, mapped afterwards for the copies. Under CPU contention here (A/B runs
        in one process, load average 6-29) checking over the mapping was the faster of the
        two; the switch stays for A/B runs on other machines.
        """
        algorithm = self._algorithm
        if algorithm is None:
            raise CheckpointCorrupt(f"{self.path}: no manifest to check against",
                                    hint="open the reader with the checkpoint's manifest")
        jobs = []
        for dataset, first in keys - self._verified:
            meta = self._shards.metas[dataset]
            sh = self._shards.by_key[(dataset, first)]
            jobs.append((meta, sh, self.offset(meta) + first))
        jobs.sort(key=lambda j: j[2])
        jobs = _rotated(jobs, start, self._shards.nbytes)
        fmap = self._mapped() if PASS1_MAPPED else None
        size = min(_READ_CHUNK, max((self._shards.nbytes(sh) for _, sh, _ in jobs), default=0))
        with _stream_buffers(0 if fmap is not None else size) as bufs:
            self._check_jobs(jobs, fmap, bufs, size, into if into else None)
        if fmap is None:
            # Map what was read (in the page cache now, so this only builds page tables): a
            # read error or a file cut short must surface here, before any byte goes into the
            # state, not halfway through the copies.
            self._map_in([(meta, at, sh["stop"] - sh["start"]) for meta, sh, at in jobs])

    def _map_in(self, ranges: Sequence[tuple[Mapping[str, Any], int, int]]) -> None:
        """Populate the mapping over (dataset entry, file offset, bytes) ranges (see
        :meth:`FileMap.populate`); CheckpointCorrupt naming the dataset if one cannot be read."""
        fmap = self._mapped()
        if fmap is None:
            return
        for meta, at, n in ranges:
            try:
                for c0 in range(0, n, _MAP_CHUNK):
                    fmap.populate(at + c0, min(_MAP_CHUNK, n - c0))
            except OSError as exc:
                raise CheckpointCorrupt(f"{self.path}: reading {meta['dataset']!r} failed: {exc}",
                                        hint="the shard file is damaged or truncated; load an older "
                                             "step") from exc

    def _check_jobs(self, jobs: list[tuple[Mapping[str, Any], Mapping[str, Any], int]],
                    fmap: FileMap | None, bufs: list[np.ndarray], size: int,
                    into: ScratchCopies | None = None) -> None:
        algorithm = self._algorithm
        assert algorithm is not None
        crcs = [0] * len(jobs)

        def feed(j: int, parts: list[np.ndarray], placed: list[tuple[np.ndarray, int]]) -> None:
            # the helper thread: chunks arrive in order
            crc = crcs[j]
            for part in parts:
                crc = checksum(part, algorithm, crc)
            crcs[j] = crc
            if into is not None:
                for part, at in placed:
                    into.copy(part, at)  # still in the cache from the CRC

        pending = None
        k = 0
        try:
            for j, (meta, sh, at) in enumerate(jobs):
                base = at - sh["start"]  # the dataset's first byte in the file
                runs = self._shards.runs[(meta["dataset"], sh["start"])]
                if fmap is not None and len(runs) > 1 and self._shards.nbytes(sh) < len(runs) * _SMALL_RUN:
                    # short runs (a column-sharded box: one per row) share their pages with the
                    # other boxes' runs: map the box's extent in a few calls, not one per run
                    self._map_in([(meta, at, self._shards.span((meta["dataset"], sh["start"])))])
                for batch in _batches(runs, size):
                    try:
                        placed: list[tuple[np.ndarray, int]] = []  # (bytes, their file offset)
                        if fmap is not None:
                            parts = [fmap.view(base + a, n) for a, n in batch]
                            placed = list(zip(parts, (base + a for a, _ in batch))) if into is not None else []
                        else:
                            buf, pos = bufs[k % 2], 0  # the other buffer is being checked
                            for a, n in batch:
                                pread_into(self._fd, buf[pos:pos + n], base + a)
                                if into is not None:
                                    placed.append((buf[pos:pos + n], base + a))
                                pos += n
                            parts = [buf[:pos]]
                    except (OSError, EOFError) as exc:
                        raise CheckpointCorrupt(f"{self.path}: reading {meta['dataset']!r} failed: {exc}",
                                                hint="the shard file is damaged or truncated; load an "
                                                     "older step") from exc
                    k += 1
                    if pending is not None:
                        pending.result()
                    pending = load_helper().submit(feed, j, parts, placed)
                    del parts, placed
        finally:
            if pending is not None:
                pending.result()
            pending = None
        for (meta, sh, _), crc in zip(jobs, crcs):
            self._check(meta, sh, crc)

    def will_need(self, ranges: Sequence[tuple[Mapping[str, Any], int, int]]) -> None:
        """Ask the kernel to start reading byte ranges ``(meta, start, stop)`` of datasets now
        (``POSIX_FADV_WILLNEED``, returns at once): reads issued one tensor after another then
        find them in the page cache, instead of the disk idling between them."""
        for meta, start, stop in ranges:
            if stop > start:
                os.posix_fadvise(self._fd, self.offset(meta) + start, stop - start, os.POSIX_FADV_WILLNEED)

    def prefetch(self, keys: set[ShardKey], into: ScratchCopies | None = None) -> None:
        """Read in and map the shards named by ``keys`` without checking them: the shards another
        rank of this node checks, which this rank copies afterwards. Done while that rank may
        still be reading them (the page cache is shared, nothing is read twice), so that the
        copy after the agreement is a plain memcpy. ``into``: scratch destinations (nothing of
        the state) filled from them now, not after the agreement; a failed check elsewhere
        drops them with the load."""
        ranges = [(self._shards.metas[key[0]], at, n) for (at, n), key in sorted((self.shard_extent(k), k) for k in keys)]
        fmap = self._mapped()
        if fmap is None:
            for _, at, n in ranges:
                os.posix_fadvise(self._fd, at, n, os.POSIX_FADV_WILLNEED)
            return
        self._map_in(ranges)
        if into is not None and len(into):
            for _, at, n in ranges:
                into.copy(fmap.view(at, n), at)

    def read_verified(self, meta: Mapping[str, Any], dest: np.ndarray, start: int = 0) -> None:
        """Fill ``dest`` with bytes [start, start+dest.nbytes) of a dataset whose shards
        :meth:`verify` already checked (a plain read: the checks are not paid twice)."""
        piece = self.plan_verified(meta, dest, start)
        if piece is not None:
            self.copy_verified([piece])

    def plan_verified(self, meta: Mapping[str, Any], dest: np.ndarray, start: int = 0
                      ) -> tuple[np.ndarray, int] | None:
        """What :meth:`read_verified` would copy, as (``dest``'s bytes, file offset), for
        :meth:`copy_verified`; CheckpointCorrupt unless checked shards cover all of it."""
        if dest.nbytes == 0:
            return None
        return dest.reshape(-1).view(np.uint8), self.verified_offset(meta, start, dest.nbytes)

    def verified_offset(self, meta: Mapping[str, Any], start: int, nbytes: int) -> int:
        """The file offset of bytes [start, start+nbytes) of a dataset; CheckpointCorrupt unless
        checked shards cover all of them (what :meth:`plan_verified` checks)."""
        stop = start + nbytes
        if start < 0 or stop > int(meta["nbytes"]):
            raise CheckpointCorrupt(f"{self.path}: read past the end of {meta['dataset']!r}",
                                    hint="manifest and request disagree")
        if self._algorithm is not None:
            covered = self._shards.overlapping(meta["dataset"], start, stop)
            unchecked = [k for _, _, k in covered if k not in self._verified]
            if unchecked or not self._shards.covered(covered, start, stop):
                raise CheckpointCorrupt(f"{self.path}: bytes [{start}, {stop}) of {meta['dataset']!r} "
                                        f"are not all covered by checked shards",
                                        hint="the manifest was edited or damaged; load an older step")
        return self.offset(meta) + start

    def copy_verified(self, pieces: Sequence[tuple[np.ndarray, int]], threads: int = 1) -> None:
        """Copy planned pieces (:meth:`plan_verified`), the bytes split evenly over ``threads``
        threads (the calling one and the copy pool's): the copy is bound by memory bandwidth,
        which one core does not use up. From the file's mapping (one memcpy) or by pread."""
        fmap = self._mapped()
        total = sum(d.nbytes for d, _ in pieces)
        threads = max(1, min(threads, total // _MIN_COPY_SHARE))
        shares: list[list[tuple[np.ndarray, int]]] = [[] for _ in range(threads)]
        k = done = 0
        for dest, at in pieces:
            off, n = 0, dest.nbytes
            while off < n:
                take = min(n - off, total * (k + 1) // threads - done)
                if take <= 0:
                    k += 1
                    continue
                shares[k].append((dest[off:off + take], at + off))
                off += take
                done += take

        def run(share: list[tuple[np.ndarray, int]]) -> None:
            for d, at in share:
                if fmap is None:
                    pread_into(self._fd, d, at)
                else:
                    stream_copy(d, fmap.view(at, d.nbytes))  # the state's bytes: not read before the next step

        futures = [copy_pool().submit(run, sh) for sh in shares[1:]]
        errors: list[BaseException] = []
        try:
            run(shares[0])
        except (OSError, EOFError) as exc:
            errors.append(exc)
        finally:
            for f in futures:
                try:
                    f.result()
                except (OSError, EOFError) as exc:
                    errors.append(exc)
        if errors:
            raise CheckpointCorrupt(f"{self.path}: reading checked bytes again failed: {errors[0]}",
                                    hint="the shard file is damaged or truncated; load an older "
                                         "step") from errors[0]

    def read_bytes(self, meta: Mapping[str, Any], start: int, stop: int) -> np.ndarray:
        self.offset(meta)  # the dataset lies inside the file: no allocation from a crafted size
        if not 0 <= start <= stop <= int(meta["nbytes"]):
            raise CheckpointCorrupt(f"{self.path}: bytes [{start}, {stop}) are outside {meta['dataset']!r}",
                                    hint="manifest and request disagree")
        buf = np.empty(stop - start, dtype=np.uint8)
        self.read(meta, buf, start)
        return buf


def _rotated(jobs: list[Any], start: float, nbytes: Any) -> list[Any]:
    """``jobs`` (in file order) begun at the job holding fraction ``start`` of their bytes and
    wrapped around: one sequential stream still, with one jump."""
    if not jobs or start <= 0.0:
        return jobs
    total = sum(nbytes(sh) for _, sh, _ in jobs)
    at, goal = 0, start * total
    for i, (_, sh, _) in enumerate(jobs):
        if at >= goal:
            return jobs[i:] + jobs[:i]
        at += nbytes(sh)
    return jobs


def _batches(runs: Sequence[tuple[int, int]], size: int) -> list[list[tuple[int, int]]]:
    """Runs (first byte, bytes) cut into pieces of at most ``size`` bytes and grouped, in order,
    into batches of at most ``size`` bytes: one hand-off to the checking thread per batch, not
    per run (a column-sharded box has one run per row)."""
    out: list[list[tuple[int, int]]] = []
    batch: list[tuple[int, int]] = []
    filled = 0
    for a, n in runs:
        for c0 in range(0, n, size):
            m = min(size, n - c0)
            if filled + m > size and batch:
                out.append(batch)
                batch, filled = [], 0
            batch.append((a + c0, m))
            filled += m
    if batch:
        out.append(batch)
    return out
