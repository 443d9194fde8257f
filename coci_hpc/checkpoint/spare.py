"""A retired step's data file, kept so that the next save writes over its blocks (issue 33).

On a local filesystem (ext4, xfs) most of a save's time went into a *new* file: its blocks are
allocated and its extents journalled when the page cache writes them back, and the retired
step's file is freed beside it. Writing the same bytes over blocks a file already has needs
neither. Measured on this machine's ext4 (2 processes x 512 MB into one file, ``pwrite`` then
``fsync``, 7 rounds after a warm-up, ad hoc script, 29 Nov): a new file per round 1.09 s median
[0.51-2.86], a new file preallocated with ``posix_fallocate`` 0.61 [0.49-1.00], each process
rewriting a file of its own after ``O_TRUNC`` (the benchmarks' raw floor) 0.71 [0.59-0.88], the
retired round's file written over 0.38 [0.33-0.55].

So retention does not delete a retired step's data file: :func:`put` moves it to the
catalog's spare name (``ROOT/.spare-data.h5``, one), and the next save's file creation (rank 0,
:func:`reuse`) makes the HDF5 file as always (a small file: metadata, then holes where the
datasets will lie), then turns the spare into *that file*: the fresh file's written regions are
copied into it, its holes outside the datasets punched, its length and mode set, and the spare
renamed over the fresh file. Only the datasets' bytes then differ from a fresh file, and the
save's write phase writes every one of them (the layout covers each dataset; a test compares a
recycled step's file with a fresh one byte for byte).

Atomicity is the store's own: a spare is never a checkpoint (retention unlinked its step's
manifest before moving it), and the step it goes into commits only with its manifest, after the
write. A crash midway leaves an uncommitted step (removed as any other) or a spare less. Any
error here falls back to the fresh file. Not on Lustre (``IOTuning.lustre``): a file's striping
is fixed when it is created, and a recycled file would keep the layout of the step it came from.
A full disk frees the spares first (:func:`clear`).
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from coci_hpc.checkpoint import rawio

_COPY = 1 << 20


def put(data_file: Path, dest: Path) -> bool:
    """Keep ``data_file`` (of a step retention retired) as the spare ``dest`` (the catalog's
    name; one stat, one rename: no listing); False: a spare is there already (the last save did
    not use it) or the file is not, and the caller deletes it with its step."""
    try:
        if os.path.lexists(dest):
            return False
        os.rename(data_file, dest)
        return True
    except OSError:
        return False


def take(spare: Path, into: Path) -> bool:
    """Move the spare to ``into`` (same filesystem); False when there is none. Two takers: one
    rename wins, the other finds it gone."""
    try:
        os.rename(spare, into)
        return True
    except OSError:
        return False


def clear(spare: Path) -> list[str]:
    """Delete the spare (a full disk); returns what went."""
    try:
        os.unlink(spare)
    except OSError:
        return []
    return [spare.name]


def _regions(fd: int, size: int) -> Iterator[tuple[int, int, bool]]:
    """(start, stop, has_data) runs of the file, from SEEK_DATA / SEEK_HOLE."""
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:        # ENXIO: only a hole is left
            data = size
        if data > pos:
            yield pos, data, False
        if data >= size:
            return
        hole = os.lseek(fd, data, os.SEEK_HOLE)
        yield data, hole, True
        pos = hole


def _minus(a: int, b: int, extents: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """[a, b) less the (sorted, disjoint) [start, stop) extents."""
    for s, e in extents:
        if e <= a or s >= b:
            continue
        if s > a:
            yield a, s
        a = max(a, e)
    if a < b:
        yield a, b


def _punch(fd: int, start: int, stop: int) -> None:
    rawio.fallocate(fd, rawio.FALLOC_PUNCH_HOLE | rawio.FALLOC_KEEP_SIZE, start, stop - start)


def carry(fresh: Path, spare: Path, extents: Sequence[tuple[int, int]]) -> None:
    """Make ``spare`` the file ``fresh`` is, except inside ``extents`` ((offset, nbytes) of the
    datasets, which the write phase fills): ``fresh``'s written bytes copied, its holes punched,
    its length and mode."""
    ext = sorted((o, o + n) for o, n in extents if n > 0)
    st = os.stat(fresh)
    src = os.open(fresh, os.O_RDONLY)
    dst = os.open(spare, os.O_WRONLY)
    try:
        os.ftruncate(dst, st.st_size)
        for a, b, has_data in _regions(src, st.st_size):
            if has_data:
                for at in range(a, b, _COPY):
                    chunk = os.pread(src, min(_COPY, b - at), at)
                    if os.pwrite(dst, chunk, at) != len(chunk):
                        raise OSError(f"short write into the spare at {at}")
            else:
                for s, e in _minus(a, b, ext):
                    _punch(dst, s, e)
        os.fchmod(dst, st.st_mode & 0o7777)
    finally:
        os.close(src)
        os.close(dst)


def reuse(fresh: Path, spare: Path, datasets: Sequence[tuple[int, int]]) -> bool:
    """Rank 0, after creating the HDF5 file ``fresh`` of a step: put the ``spare`` in its place,
    made the same file (:func:`carry`). False: no spare, or it could not be used (then it is
    deleted and ``fresh`` stays)."""
    tmp = fresh.with_name(f".{fresh.name}.spare")
    if not take(spare, tmp):
        return False
    try:
        carry(fresh, tmp, datasets)
        os.rename(tmp, fresh)
        return True
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
