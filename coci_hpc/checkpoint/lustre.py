"""Lustre tuning: detect Lustre, stripe new checkpoint directories, align datasets, MPI-IO hints.

Decisions are pure functions of (filesystem type, stripe settings, world size); the I/O
(``statfs``, running ``lfs``) sits in two small functions. Lustre cannot run on the development
machine, so tests force the filesystem type with ``COCI_FORCE_FSTYPE=lustre`` (TEST-ONLY: it makes
coci believe the directory is on Lustre) and put a fake ``lfs`` script first on ``PATH``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

LUSTRE_SUPER_MAGIC = 0x0BD00BD0
FORCE_ENV = "COCI_FORCE_FSTYPE"   # test-only override: "lustre" or "other"

DEFAULT_ALIGN = 4096              # page alignment on ordinary filesystems
DEFAULT_ALIGN_THRESHOLD = 64 << 10


class _Statfs(ctypes.Structure):
    # struct statfs on Linux x86_64/aarch64: f_type is the first field (a long).
    _fields_ = [("f_type", ctypes.c_long), ("f_bsize", ctypes.c_long), ("_rest", ctypes.c_byte * 200)]


def fs_magic(path: str | os.PathLike) -> int | None:
    """The statfs ``f_type`` of ``path`` (None when statfs is unavailable)."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)
    buf = _Statfs()
    if libc.statfs(os.fsencode(str(path)), ctypes.byref(buf)) != 0:
        return None
    return buf.f_type & 0xFFFFFFFF


def is_lustre(path: str | os.PathLike) -> bool:
    forced = os.environ.get(FORCE_ENV)
    if forced:
        return forced.lower() == "lustre"
    return fs_magic(path) == LUSTRE_SUPER_MAGIC


@dataclass(frozen=True)
class LustrePolicy:
    """Stripe settings for new checkpoint directories (count -1 = all OSTs)."""

    stripe_count: int = -1
    stripe_size: int = 4 << 20


@dataclass(frozen=True)
class IOTuning:
    """What the writer does on this filesystem; the same on every rank."""

    lustre: bool
    align: int
    align_threshold: int
    setstripe: list[str] | None           # argv to run on the new directory, or None
    mpi_hints: dict[str, str] = field(default_factory=dict)
    dir_mode: int = 0o700                 # new directories; files get it minus x (see perms)


def decide(lustre: bool, policy: LustrePolicy, world_size: int, lfs_path: str | None) -> IOTuning:
    """Pure: the tuning for a checkpoint directory given the filesystem and world size."""
    if not lustre:
        return IOTuning(False, DEFAULT_ALIGN, DEFAULT_ALIGN_THRESHOLD, None,
                        {"romio_cb_write": "automatic"})
    hints = {
        "striping_unit": str(policy.stripe_size),
        "romio_cb_write": "enable",         # collective buffering: aggregators write whole stripes
        "romio_ds_write": "disable",        # no data sieving read-modify-write on Lustre
        "cb_buffer_size": str(policy.stripe_size),
    }
    if policy.stripe_count > 0:
        hints["striping_factor"] = str(policy.stripe_count)
        hints["cb_nodes"] = str(min(world_size, policy.stripe_count))
    argv = None
    if lfs_path:
        argv = [lfs_path, "setstripe", "-c", str(policy.stripe_count), "-S", str(policy.stripe_size)]
    return IOTuning(True, policy.stripe_size, policy.stripe_size, argv, hints)


def tuning_for(directory: str | os.PathLike, policy: LustrePolicy, world_size: int,
               access: str = "private") -> IOTuning:
    """Detect the filesystem of ``directory`` (or its nearest existing parent) and decide;
    ``access`` picks the modes of what is created (:mod:`~coci_hpc.checkpoint.perms`)."""
    from dataclasses import replace

    from coci_hpc.checkpoint.perms import dir_mode

    probe = Path(directory)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return replace(decide(is_lustre(probe), policy, world_size, shutil.which("lfs")),
                   dir_mode=dir_mode(access))


def apply_setstripe(tuning: IOTuning, directory: str | os.PathLike) -> bool:
    """Run ``lfs setstripe`` on a new, empty directory; files created in it inherit the layout.

    Returns True when it ran. A failing ``lfs`` is reported in the raised error with its output.
    """
    if not tuning.setstripe:
        return False
    from coci_hpc.errors import CheckpointError

    proc = subprocess.run([*tuning.setstripe, str(directory)], capture_output=True, text=True, timeout=60,
                          check=False)
    if proc.returncode != 0:
        raise CheckpointError(f"`{' '.join(tuning.setstripe)} {directory}` failed: "
                              f"{(proc.stderr or proc.stdout).strip()}",
                              hint="check the Lustre stripe settings (LustrePolicy) or your quota")
    return True


def mpi_info(hints: dict[str, str]):
    """An ``MPI.Info`` holding ``hints`` (caller frees it), or MPI.INFO_NULL when empty."""
    from mpi4py import MPI

    if not hints:
        return MPI.INFO_NULL
    info = MPI.Info.Create()
    for k, v in hints.items():
        info.Set(k, v)
    return info
