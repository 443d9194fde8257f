"""This rank's RNG streams as raw bytes, fast enough to copy every step.

:func:`coci_hpc.checkpoint.rng.capture_rng` builds python objects: ``random.getstate()`` makes a
tuple of 625 ints (~17 us) that then becomes an int64 array (~10-20 us), numpy's
``get_state()`` fills its 624-word key one python assignment at a time (~35 us). The partner copy
(:mod:`.partner`) takes these states at every step, so :class:`RngBytes` reads the same words
straight from the generators' memory into a preallocated buffer (~2 us in all) and converts them
to :func:`capture_rng`'s form only when a copy is used (:meth:`RngBytes.decode`, after a failure).

Where the words live is found once and checked against the public API (``random.getstate()``,
``np.random.get_state()``), after a few draws too; anything unexpected (another Python or numpy
build, a global numpy generator that is not MT19937, a changed layout) turns the raw reads off
and the same buffer is filled through the public API instead: slower, same bytes.

Layout of the RNG section (little-endian, offsets fixed for a process):

====================  ===========================================================================
python  2512 bytes    MT index (i32), key (624 x u32), has_gauss_next (u32), gauss_next (f64)
numpy   2512 bytes    key (624 x u32), pos (i32), has_gauss (i32), pad (i32), gauss (f64)
torch   4 + n bytes   n (u32), ``torch.get_rng_state()``'s bytes
cuda    4 + sum       device count (u32), per device: n (u32) and the state's bytes
====================  ===========================================================================
"""
from __future__ import annotations

import ctypes
import random
import struct
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint.rng import capture_rng

N = 624
PY_BYTES = 4 + 4 * N + 4 + 8
NP_BYTES = 4 * N + 4 + 4 + 4 + 8
_U32 = struct.Struct("<I")
_GAUSS = struct.Struct("<Id")            # has (u32), value (f64)
_NP_AUG = struct.Struct("<iid")          # has_gauss, pad, gauss
_PROBE_GAUSS = 1.2345678901234567e-300   # a value no generator holds by chance, to find the field


def _python_layout(inst: random.Random) -> int | None:
    """Offset of the MT index (followed by the 624 words) inside CPython's random object."""
    base = next((t for t in type(inst).__mro__ if t.__module__ == "_random"), None)
    if base is None:
        return None
    raw = ctypes.string_at(id(inst), base.__basicsize__)
    internal = inst.getstate()[1]
    off = raw.find(struct.pack(f"<{N}I", *internal[:N]))
    if off < 4 or struct.unpack_from("<i", raw, off - 4)[0] != internal[N]:
        return None
    return off - 4


def _numpy_aug_offset() -> int | None:
    """Offset of (has_gauss, gauss) inside a legacy ``RandomState``: found on a probe generator."""
    probe = np.random.RandomState(1)
    st = probe.get_state(legacy=False)
    st["has_gauss"], st["gauss"] = 1, _PROBE_GAUSS
    probe.set_state(st)
    size = type(probe).__basicsize__
    raw = ctypes.string_at(id(probe), size)
    off = raw.find(struct.pack("<d", _PROBE_GAUSS))
    if off < 8 or struct.unpack_from("<i", raw, off - 8)[0] != 1:
        return None
    st["has_gauss"], st["gauss"] = 0, 0.0
    probe.set_state(st)
    has, _, gauss = _NP_AUG.unpack(ctypes.string_at(id(probe) + off - 8, 16))
    return off - 8 if (has, gauss) == (0, 0.0) else None


class RngBytes:
    """Capture this process's RNG streams into a byte buffer; decode them back when needed."""

    def __init__(self, raw: bool = True) -> None:
        getstate: Any = random.getstate
        np_get_state: Any = np.random.get_state
        self._py = getstate.__self__              # the module-level generator `random` uses
        self._np = np_get_state.__self__          # numpy's legacy global RandomState
        self._np_bg = self._np._bit_generator
        self.py_version = random.getstate()[0]
        self._torch_n = int(torch.get_rng_state().numel())
        self._cuda_n = [int(s.numel()) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
        self.nbytes = PY_BYTES + NP_BYTES + 4 + self._torch_n + 4 + sum(4 + n for n in self._cuda_n)
        self.raw = False
        if raw:
            try:
                self.raw = self._find_raw()
            except (AttributeError, TypeError, ValueError, OverflowError):
                self.raw = False

    # -- where the words are -----------------------------------------------------------------------
    def _find_raw(self) -> bool:
        if type(self._np_bg).__name__ != "MT19937":
            return False
        py_off = _python_layout(self._py)
        np_aug = _numpy_aug_offset()
        if py_off is None or np_aug is None:
            return False
        self._py_addr = id(self._py) + py_off
        self._np_addr = int(self._np_bg.ctypes.state_address)
        self._np_aug_addr = id(self._np) + np_aug
        # Checked against the public API now and after draws that move every field we read.
        saved = capture_rng()
        try:
            ok = self._agrees()
            random.random(), random.gauss(0.0, 1.0), np.random.standard_normal(), np.random.random()
            ok = ok and self._agrees()
        finally:
            from coci_hpc.checkpoint.rng import restore_rng

            restore_rng(saved)
        return ok

    def _agrees(self) -> bool:
        buf = np.zeros(self.nbytes, dtype=np.uint8)
        self.raw = True
        try:
            self.capture_into(buf)
        finally:
            self.raw = False
        got, want = self.decode(buf), capture_rng()
        return (int(got["python"]["version"]) == int(want["python"]["version"])
                and np.array_equal(got["python"]["state"], want["python"]["state"])
                and got["python"]["gauss"] == want["python"]["gauss"]
                and np.array_equal(got["numpy"]["key"], want["numpy"]["key"])
                and (got["numpy"]["pos"], got["numpy"]["has_gauss"], got["numpy"]["gauss"])
                == (want["numpy"]["pos"], want["numpy"]["has_gauss"], want["numpy"]["gauss"]))

    # -- per step ------------------------------------------------------------------------------------
    def capture_into(self, buf: Any, pos: int = 0, addr: int | None = None) -> int:
        """Write the RNG section into ``buf[pos:]`` (uint8, at least :attr:`nbytes`); returns its end.
        ``addr``: ``buf.ctypes.data`` when the caller has it (it costs ~1 us to ask)."""
        addr = (buf.ctypes.data if addr is None else addr) + pos
        gauss_next = self._py.gauss_next
        move = ctypes.memmove
        if self.raw and self._np._bit_generator is self._np_bg:
            move(addr, self._py_addr, 4 + 4 * N)
            move(addr + PY_BYTES, self._np_addr, 4 * N + 4)
            move(addr + PY_BYTES + 4 * N + 4, self._np_aug_addr, 16)
            if not self._cuda_n:             # the usual case, in as few calls as possible
                _GAUSS.pack_into(buf, pos + 4 + 4 * N, gauss_next is not None,
                                 0.0 if gauss_next is None else gauss_next)
                t = torch.get_rng_state()
                n = self._torch_n
                if t.numel() != n:
                    raise ValueError(f"torch's RNG state changed size ({t.numel()} bytes, not {n})")
                o = pos + PY_BYTES + NP_BYTES
                _U32.pack_into(buf, o, n)
                move(addr + PY_BYTES + NP_BYTES + 4, t.data_ptr(), n)
                _U32.pack_into(buf, o + 4 + n, 0)
                return o + 8 + n
        else:
            _, internal, gauss_next = self._py.getstate()
            view = buf[pos:pos + 4 + 4 * N].view(np.int32)
            view[0] = internal[N]
            view[1:].view(np.uint32)[:] = internal[:N]
            st = self._np.get_state(legacy=False)
            if st["bit_generator"] != "MT19937":
                raise ValueError(f"numpy's global generator is {st['bit_generator']}, not MT19937: its "
                                 f"state cannot be kept per rank")
            o = pos + PY_BYTES
            buf[o:o + 4 * N].view(np.uint32)[:] = st["state"]["key"]
            _NP_AUG.pack_into(buf, o + 4 * N + 4, int(st["has_gauss"]), 0, float(st["gauss"]))
            struct.pack_into("<i", buf, o + 4 * N, int(st["state"]["pos"]))
        _GAUSS.pack_into(buf, pos + 4 + 4 * N, gauss_next is not None,
                         0.0 if gauss_next is None else gauss_next)
        o = pos + PY_BYTES + NP_BYTES
        t = torch.get_rng_state()
        if t.numel() != self._torch_n:
            raise ValueError(f"torch's RNG state changed size ({t.numel()} bytes, not {self._torch_n})")
        _U32.pack_into(buf, o, self._torch_n)
        ctypes.memmove(addr + (o - pos) + 4, t.data_ptr(), self._torch_n)
        o += 4 + self._torch_n
        _U32.pack_into(buf, o, len(self._cuda_n))
        o += 4
        if self._cuda_n:
            for s, n in zip(torch.cuda.get_rng_state_all(), self._cuda_n):
                _U32.pack_into(buf, o, n)
                buf[o + 4:o + 4 + n] = s.numpy()
                o += 4 + n
        return o

    # -- when a copy is used -------------------------------------------------------------------------
    def decode(self, buf: np.ndarray | bytes | memoryview, pos: int = 0) -> dict[str, Any]:
        """The RNG section at ``buf[pos:]`` in :func:`capture_rng`'s form (what checkpoints store)."""
        return decode(buf, pos, self.py_version)


def decode(buf: np.ndarray | bytes | memoryview, pos: int = 0, py_version: int = 3) -> dict[str, Any]:
    """See :meth:`RngBytes.decode`; raises ValueError on a section that does not parse."""
    b: Any = np.frombuffer(buf, dtype=np.uint8)
    if b.size < pos + PY_BYTES + NP_BYTES + 8:
        raise ValueError("truncated RNG state")
    words = b[pos:pos + 4 + 4 * N].view(np.uint32)
    has_next, gauss_next = _GAUSS.unpack_from(b, pos + 4 + 4 * N)
    py_state = np.empty(N + 1, dtype=np.int64)
    py_state[:N] = words[1:]
    py_state[N] = int(words[:1].view(np.int32)[0])
    o = pos + PY_BYTES
    key = b[o:o + 4 * N].view(np.uint32).copy()
    (np_pos,) = struct.unpack_from("<i", b, o + 4 * N)
    has_gauss, _, gauss = _NP_AUG.unpack_from(b, o + 4 * N + 4)
    o += NP_BYTES
    (n,) = _U32.unpack_from(b, o)
    if b.size < o + 4 + n + 4:
        raise ValueError("truncated RNG state (torch)")
    t = torch.from_numpy(b[o + 4:o + 4 + n].copy())
    o += 4 + n
    (ncuda,) = _U32.unpack_from(b, o)
    o += 4
    cuda = []
    for _ in range(ncuda):
        (n,) = _U32.unpack_from(b, o)
        cuda.append(torch.from_numpy(b[o + 4:o + 4 + n].copy()))
        o += 4 + n
    out: dict[str, Any] = {
        "python": {"version": py_version, "state": py_state, "gauss": gauss_next if has_next else None},
        "numpy": {"bit_generator": "MT19937", "key": key, "pos": int(np_pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": t,
    }
    if ncuda:
        out["cuda"] = cuda
    return out
