"""Checksums of checkpoint bytes and of the manifest itself.

* New checkpoints use CRC-32C (Castagnoli; the ``crc32c`` package uses the SSE4.2 / ARMv8 CRC
  instructions, 13-15 GB/s on one core of the development VM, and releases the GIL on large
  buffers; where the CPU has AVX-512 + VPCLMULQDQ, ``coci_hpc._stream`` computes the same
  value about twice as fast, and in the same pass as a copy: :func:`copy_checksum`; where it
  has VPCLMULQDQ with AVX2 only, the fused copy runs over 256-bit registers and a plain
  checksum stays with the library, which was the faster of the two there). Old
  checkpoints (manifest ``"checksum": "crc32"``, format 1) were written with zlib's CRC-32 and
  are still read and verified with it.
* The manifest protects its own bytes (format 2): ``manifest_crc32c`` is the CRC-32C of the
  manifest's canonical JSON without that field (sorted keys, no spaces), so a one-digit edit of
  the step, a learning rate or the sampler position is caught before anything is loaded.
  A CRC catches damage (bit rot, a torn or hand-edited file), not a deliberate forgery.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from coci_hpc.errors import CheckpointCorrupt, CheckpointError

try:  # the hardware CRC; a pure-software fallback keeps old environments able to READ.
    import crc32c as _crc32c_mod

    def _crc32c(buf: memoryview, value: int) -> int:
        return _crc32c_mod.crc32c(buf, value)

    HARDWARE_CRC32C = bool(getattr(_crc32c_mod, "hardware_based", False))
except ImportError:  # pragma: no cover - pyproject requires crc32c
    _crc32c_mod = None  # type: ignore[assignment]
    HARDWARE_CRC32C = False

    def _crc32c(buf: memoryview, value: int) -> int:
        # Not "damage": load_latest must not skip every checkpoint for a missing package.
        raise CheckpointError("CRC-32C checksums need the `crc32c` package",
                              hint="pip install crc32c (it is a dependency of coci_hpc)")

try:  # the same CRC-32C by carry-less multiplication (coci_hpc/_stream.c says why; optional)
    from coci_hpc import _stream as _fold

    # "vpclmulqdq" (AVX-512), "vpclmulqdq-avx2" (256-bit registers), or None on a CPU without it
    FOLD_CRC32C: str | None = _fold.CRC
except ImportError:  # pragma: no cover - an install without a C compiler
    _fold = None  # type: ignore[assignment]
    FOLD_CRC32C = None

CHECKSUM = "crc32c"                 # what new checkpoints use
SHARD_KEY = {"crc32c": "crc32c", "crc32": "crc32"}  # per-shard field holding the value
MANIFEST_KEY = "manifest_crc32c"    # the manifest's own checksum
_CHUNK = 256 << 20                  # bounded calls: errors and GIL hand-offs stay prompt


def _zlib_crc32(buf: memoryview, value: int) -> int:
    return zlib.crc32(buf, value)


def _fold_crc32c(buf: memoryview, value: int) -> int:
    return _fold.crc32c(buf, value)


# A plain CRC-32C by folding only over 512-bit registers (the same values:
# tests/checkpoint/test_stream_copy.py). The 256-bit fold lost to the library on its own
# (2026-12-03, AMD EPYC VM with AVX2 + VPCLMULQDQ and no AVX-512, one core, 7 rounds: 640 MB
# from memory 0.062 s against 0.054 s, 640 x 1 MB from the cache 0.062 s against 0.034 s) but
# won fused with a copy (copy + CRC 0.064 s against a streaming copy then the library 0.091 s).
PLAIN_FOLD = FOLD_CRC32C == "vpclmulqdq"
_FUNCS: dict[str, Callable[[memoryview, int], int]] = {
    "crc32c": _fold_crc32c if PLAIN_FOLD else _crc32c, "crc32": _zlib_crc32}


def checksum(buf: np.ndarray | memoryview | bytes, algorithm: str = CHECKSUM, value: int = 0) -> int:
    """CRC of ``buf`` (any contiguous buffer) with ``algorithm`` ("crc32c" or legacy "crc32")."""
    fn = _FUNCS.get(algorithm)
    if fn is None:
        raise CheckpointCorrupt(f"unknown checksum algorithm {algorithm!r}",
                                hint=f"known: {sorted(_FUNCS)}; the manifest may be damaged")
    mv = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)  # type: ignore[arg-type]  # numpy types its buffer protocol for Python >= 3.12 only
    for i in range(0, len(mv), _CHUNK):
        value = fn(mv[i:i + _CHUNK], value)
    return value & 0xFFFFFFFF


def copy_checksum(dst: np.ndarray, src: np.ndarray, algorithm: str = CHECKSUM, value: int = 0) -> int | None:
    """Copy ``src`` into ``dst`` (two C-contiguous byte buffers of one length, ``dst`` not read
    again soon) with streaming stores and return the checksum of the bytes, in one pass over
    them; None, with nothing copied, where that pass does not run here (no VPCLMULQDQ,
    another algorithm or a buffer it cannot take): the caller copies and checks apart.
    ``value``: the checksum of the bytes before these (a buffer copied in parts)."""
    if (FOLD_CRC32C is None or algorithm != "crc32c" or dst.nbytes != src.nbytes
            or not (dst.flags.c_contiguous and src.flags.c_contiguous)):
        return None
    d = dst.reshape(-1).view(np.uint8)
    s = src.reshape(-1).view(np.uint8)
    for i in range(0, d.nbytes, _CHUNK):     # bounded calls, as checksum's
        value = _fold.copy_crc32c(d[i:i + _CHUNK], s[i:i + _CHUNK], value)
    return value


def canonical_json(obj: Any) -> bytes:
    """The bytes the manifest checksum covers: sorted keys, no spaces (floats round-trip exactly)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` carrying its own CRC-32C."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_KEY}
    return {**body, MANIFEST_KEY: checksum(canonical_json(body), "crc32c")}


def seal_problem(manifest: Mapping[str, Any]) -> str | None:
    """Why the manifest's own checksum does not hold (None: it holds)."""
    want = manifest.get(MANIFEST_KEY)
    if isinstance(want, bool) or not isinstance(want, int):
        return f"its own checksum ({MANIFEST_KEY}) is missing"
    body = {k: v for k, v in manifest.items() if k != MANIFEST_KEY}
    got = checksum(canonical_json(body), "crc32c")
    if got != want:
        return f"its own checksum does not match (crc32c {got:08x}, recorded {want:08x}): it was edited or damaged"
    return None


# CRC-32C of a concatenation from the CRCs of its parts (zlib's crc32_combine, for the
# Castagnoli polynomial): crc(A + B) = (x^(8 len B) * crc(A) mod P) ^ crc(B). A DTensor box is
# written as many contiguous runs, each checksummed while it is written; the manifest records
# one CRC per box (format 4), combined from them without touching the bytes again.
_POLY_REFLECTED = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32C polynomial (reflected bit order, as zlib's multmodp)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY_REFLECTED if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) mod P, k = 0, 1, ... (x^1 is 1 << 30 in reflected order)


def _x8nmodp(nbytes: int) -> int:
    """x^(8 nbytes) mod P."""
    p, k, n = 1 << 31, 3, nbytes  # 1 << 31: x^0
    while n:
        while len(_X2N) <= k:
            _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))
        if n & 1:
            p = _multmodp(_X2N[k], p)
        n >>= 1
        k += 1
    return p


_TABLE_AFTER = 16  # combines with one run length before its 4 x 256 table pays for itself


class Combiner:
    """Folds CRC-32C values of consecutive byte runs into the CRC-32C of their concatenation.

    Folding onto nothing (the first run: ``crc1`` 0) is the run's own CRC, no arithmetic: an
    FSDP box is one run, and every shard of a save starts so. Other runs cost one
    multiplication modulo P with the shift for their length (``x^(8 len)``, kept per length);
    from the :data:`_TABLE_AFTER`-th run of one length on (a ``Shard(1)`` box: one run per row,
    all of one length) the shift is tabulated (4 x 256 entries, ~1000 multiplications), and each
    run costs four lookups. Tables and shifts are kept for the process: a manager's next save
    has the same run lengths. (Before 2026-11-29 every fold built a table for every length,
    single runs too: 8 ms of rank 0's commit of a 1 GB FSDP2 state, issue 33.)
    """

    _shifts: dict[int, int] = {}
    _tables: dict[int, tuple[list[int], ...]] = {}
    _uses: dict[int, int] = {}
    _KEEP = 4096  # lengths kept; more (a state of many shapes) starts the caches over

    def _table(self, nbytes: int) -> tuple[list[int], ...] | None:
        cls = type(self)
        t = cls._tables.get(nbytes)
        if t is None:
            uses = cls._uses[nbytes] = cls._uses.get(nbytes, 0) + 1
            if uses < _TABLE_AFTER:
                return None
            op = self._shift(nbytes)
            t = cls._tables[nbytes] = tuple([_multmodp(op, v << (8 * k)) for v in range(256)] for k in range(4))
        return t

    def _shift(self, nbytes: int) -> int:
        cls = type(self)
        op = cls._shifts.get(nbytes)
        if op is None:
            if len(cls._shifts) >= cls._KEEP:
                cls._shifts.clear()
                cls._tables.clear()
                cls._uses.clear()
            op = cls._shifts[nbytes] = _x8nmodp(nbytes)
        return op

    def combine(self, crc1: int, crc2: int, len2: int) -> int:
        """CRC-32C of A + B from crc1 = CRC-32C(A), crc2 = CRC-32C(B) and len2 = len(B)."""
        if len2 == 0:
            return crc1
        if crc1 == 0:  # x^(8 len2) * 0 mod P is 0: no shift to compute
            return crc2
        t = self._table(len2)
        if t is None:
            return _multmodp(self._shift(len2), crc1) ^ crc2
        t0, t1, t2, t3 = t
        return t0[crc1 & 0xFF] ^ t1[(crc1 >> 8) & 0xFF] ^ t2[(crc1 >> 16) & 0xFF] ^ t3[crc1 >> 24] ^ crc2

    def fold(self, parts: Sequence[tuple[int, int]]) -> int:
        """CRC-32C of the concatenation of parts given as (CRC-32C, bytes), in order."""
        crc = 0  # the CRC of no bytes
        for c, n in parts:
            crc = self.combine(crc, c, n)
        return crc
