"""Where a tensor's bytes live, and the waits a copy across the host/device boundary needs.

The store reads a tensor's memory as host bytes only when :func:`on_host` says so, and hands host
bytes to torch (``DTensor.from_local``, ``load_state_dict``, ``copy_``) only once they are filled:
across a boundary torch copies at that moment. The three calls are one place, so the CPU tests'
device-boundary fake (``tests/checkpoint/fake_device.py``) can make CPU tensors behave as CUDA
ones (issue 32: on a CPU mesh ``from_local`` shares memory, which hid a bug every GPU load hit).
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint.rawio import aligned_empty


def on_host(t: torch.Tensor) -> bool:
    """True when ``t``'s bytes are host memory the store may read or write as numpy."""
    return t.device.type == "cpu"


# -- host-to-device copies of a restore (issue 32): the load's staging (.staging) queues each
# chunk's copy out of a page-locked buffer on a side stream and waits for it (the event) before it
# refills that buffer. The CPU tests' fake (tests/checkpoint/fake_device.py) replaces these five.
def upload_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream of ``device`` for a restore's host-to-device copies."""
    return torch.cuda.Stream(device)


def upload_after_current(stream: torch.cuda.Stream, device: torch.device) -> None:
    """``stream``'s copies wait (on the device) for the work queued so far on ``device``'s current
    stream, which may still read or write the tensors they overwrite."""
    stream.wait_stream(torch.cuda.current_stream(device))


def upload_on(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
    """Queue ``dst.copy_(src)`` (page-locked host to device) on ``stream``; return an event that
    completes with the copy. ``src`` must not be written until :func:`wait_upload` of that event."""
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def wait_upload(event: torch.cuda.Event) -> None:
    """Block the host until the copy of :func:`upload_on` that returned ``event`` is done."""
    event.synchronize()


def finish_uploads(stream: torch.cuda.Stream, device: torch.device) -> None:
    """Block the host until every copy queued on ``stream`` is done, and order ``device``'s current
    stream after them (a kernel queued later reads the copied values)."""
    stream.synchronize()
    torch.cuda.current_stream(device).wait_stream(stream)


def pinned_empty(nbytes: int) -> torch.Tensor | None:
    """Page-locked host bytes for device-to-host copies; None without CUDA (plain memory serves)."""
    if not torch.cuda.is_available():
        return None
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def wait_copies(device: torch.device) -> None:
    """Block until the copies issued (``non_blocking=True``) on ``device``'s current stream are done."""
    torch.cuda.current_stream(device).synchronize()


# -- device-to-host copies on a side stream (issue 32's fast paths) ------------------------------------
# Every CUDA stream, event and page-locking call of the snapshot, the memory tier and the partner copy
# is one of the functions below, so the CPU tests' fake (tests/checkpoint/fake_device.py) replaces them
# all: a copy issued here is complete only after :meth:`HostCopies.wait` (or, for later work on the
# current stream, :meth:`HostCopies.fence`), never at the call.

_copy_streams: dict[torch.device, Any] = {}


def copy_stream(device: torch.device) -> Any:
    """The side stream of ``device`` that device-to-host copies go on (one per device, kept)."""
    s = _copy_streams.get(device)
    if s is None:
        s = _copy_streams[device] = torch.cuda.Stream(device)
    return s


def order_after_current(stream: Any, device: torch.device) -> None:
    """``stream``'s later work waits for everything queued so far on ``device``'s current stream
    (the step's kernels that made the values): an event recorded there, waited for on ``stream``."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    stream.wait_event(event)


def copy_on(stream: Any, dst: torch.Tensor, src: torch.Tensor, start: int = 0) -> None:
    """Queue the copy of bytes [start, start + dst.numel()) of ``src`` (a device tensor, as if
    contiguous) into ``dst`` (page-locked host bytes) on ``stream``; the host does not wait."""
    with torch.cuda.stream(stream):
        # A non-contiguous source is made contiguous here, on the side stream after its wait (on
        # the caller's stream the side stream would not wait for it); its temporary belongs to
        # this stream, so the caching allocator reuses it only after the copy.
        flat = src.contiguous().reshape(-1).view(torch.uint8)[start:start + dst.numel()]
        dst.copy_(flat, non_blocking=True)
    # The source is the caller's (the state's): its memory is not handed to another kernel of its
    # stream before this stream read it, should the state drop it meanwhile.
    src.record_stream(stream)


def current_after(stream: Any, device: torch.device) -> None:
    """Work queued on ``device``'s current stream from now on waits (on the device, not the host)
    for what ``stream`` has queued so far."""
    event = torch.cuda.Event()
    event.record(stream)
    torch.cuda.current_stream(device).wait_event(event)


def sync_stream(stream: Any) -> None:
    """Block the host until every copy queued on ``stream`` is done."""
    stream.synchronize()


def host_register(buf: np.ndarray) -> None:
    """Page-lock ``buf`` (page-aligned host memory) for the device: copies into it from then on run
    at full speed and asynchronously. Slow (it touches and locks every page): call it off the
    training thread where that matters. No-op without CUDA."""
    if buf.nbytes == 0 or not torch.cuda.is_available():
        return
    err = torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, buf.nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.nbytes} bytes failed: CUDA error {int(err)}")


class HostCopies:
    """The device-to-host copies of one snapshot, on each source device's side copy stream.

    :meth:`order` (or the first :meth:`copy` for a device) must run in the thread whose current
    stream made the values, before the copies are queued: the side stream then waits (on the device)
    for that work. :meth:`copy` queues; :meth:`wait` blocks once for all of them, and no destination
    may be read, sent or reused before it returned. :meth:`fence` lets later work on the current
    streams (an in-place update of the source) start only after the copies, without a host wait.
    Host-only sources never come here (their bytes are copied by numpy)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self.issued = 0

    def order(self, device: torch.device) -> None:
        if device not in self._streams:
            stream = copy_stream(device)
            order_after_current(stream, device)
            self._streams[device] = stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, start: int = 0) -> None:
        """Queue bytes [start, start + dst.numel()) of ``src`` (as if contiguous) into ``dst``."""
        self.order(src.device)
        copy_on(self._streams[src.device], dst, src, start)
        self.issued += 1

    def fence(self) -> None:
        for device, stream in self._streams.items():
            current_after(stream, device)

    def wait(self) -> None:
        for stream in self._streams.values():
            sync_stream(stream)


_registered: dict[int, weakref.finalize] = {}   # address -> its unregistration (runs once)


def _unregister(addr: int) -> None:
    _registered.pop(addr, None)
    torch.cuda.cudart().cudaHostUnregister(addr)


def pinned_host(nbytes: int, register: bool = True) -> np.ndarray:
    """Page-aligned host bytes (plain memory when ``register`` is False or without CUDA),
    page-locked with :func:`host_register`. Sized exactly (torch's pinned allocator rounds each
    request up to a power of two). Unregistered by :func:`release_host`, or when the array is
    collected, before its memory is unmapped (never twice: a failed unregistration would leave an
    error for torch's next check to report)."""
    buf = aligned_empty(nbytes)
    if register and buf.nbytes and torch.cuda.is_available():
        host_register(buf)
        fin = weakref.finalize(buf, _unregister, buf.ctypes.data)
        fin.atexit = False          # at exit the CUDA context may be gone; the process unmaps it all
        _registered[buf.ctypes.data] = fin
    return buf


def release_host(buf: np.ndarray, registered: bool = True) -> None:
    """Give back a :func:`pinned_host` buffer; nothing may still copy into or read out of it."""
    fin = _registered.get(buf.ctypes.data) if registered and buf.nbytes else None
    if fin is not None:
        fin()


class PinnedStage:
    """Page-locked host buffers kept by name and reused: the destinations of device-to-host
    copies made again and again (the partner copy's device tensors in ``PerRank`` values). A
    buffer is rewritten by the next copy into the same name: read it only between that copy's
    wait and the next one."""

    def __init__(self) -> None:
        self._bufs: dict[str, tuple[np.ndarray, torch.Tensor]] = {}

    def get(self, name: str, nbytes: int) -> tuple[np.ndarray, torch.Tensor]:
        """The buffer for ``name`` (numpy and torch views of the same bytes), reallocated only when
        its size changed."""
        got = self._bufs.get(name)
        if got is None or got[0].nbytes != nbytes:
            if got is not None:
                release_host(got[0])
            buf = pinned_host(nbytes)
            got = self._bufs[name] = (buf, torch.from_numpy(buf))
        return got

    def drop_unused(self, names: set[str]) -> None:
        for n in [n for n in self._bufs if n not in names]:
            release_host(self._bufs.pop(n)[0])
