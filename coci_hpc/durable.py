"""Durable writes: the one rule for every file coci_hpc replaces atomically.

The rule (:func:`write_atomic`): the bytes go to a hidden temporary name in the same directory
(``.NAME.tmp.PID.RANDOM``, created with ``O_EXCL | O_NOFOLLOW``), the file is fsynced, renamed
over ``NAME``, and then the directory is fsynced. So a reader sees the old file or the whole new
one, never a part; a crash leaves at most a temporary file that no reader takes for ``NAME``; and
once the call returns, the new file and its name survive a power loss. :func:`rename_durable`
is the same last two steps for a finished file or directory built under a temporary name (an
export).

Appends to the event log (:mod:`coci_hpc.runtime.events`) are not atomic replacements: each record
is one ``O_APPEND`` write followed by ``fsync`` of the file, and a torn last line is skipped by the
reader; they do not go through here.

This module imports nothing of coci_hpc, so any layer (checkpoint, runtime, planner, slurm, cli)
can use it without an import cycle.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

TMP_MARK = ".tmp."   # in every temporary name: ".NAME.tmp.PID.RANDOM"


def temp_name(path: str | os.PathLike[str]) -> Path:
    """The temporary name :func:`write_atomic` writes ``path`` under first (hidden, unique)."""
    p = Path(path)
    return p.with_name(f".{p.name}{TMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` (a create, a rename, an unlink) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = None) -> Path:
    """Replace ``path`` with ``data``: temporary name, write all, fsync, rename, fsync directory.

    ``mode``: the file's permission bits exactly (not masked by the umask); None: ``0o666``
    minus the umask, as ``open()`` would. A failure removes the temporary file and leaves
    ``path`` as it was. Returns ``path``.
    """
    final = Path(path)
    raw = data.encode() if isinstance(data, str) else bytes(data)
    tmp = temp_name(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                 0o666 if mode is None else mode)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # O_CREAT's mode is masked by the umask; the caller decides
        view = memoryview(raw)
        while view:
            n = os.write(fd, view)
            if n <= 0:  # never rename a short file into place (a full disk can return 0)
                raise OSError(f"write of {tmp} returned {n} with {len(view)} bytes left")
            view = view[n:]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(final.parent)
    return final


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync a file written by a library that does not (safetensors, torch.save)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_durable(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Give a finished (already fsynced) file or directory its final name, durably: rename, then
    fsync the directory that holds the new name."""
    os.rename(src, dst)
    fsync_dir(Path(dst).parent)
