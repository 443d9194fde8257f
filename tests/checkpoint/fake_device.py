"""FAKE device boundary: what a CUDA device changes, emulated on the CPU (a test fake, issue 32).

On a CPU mesh ``DTensor.from_local`` shares the local tensor's memory, ``.to()`` / ``.cpu()`` give
the tensor itself, a ``non_blocking`` copy is complete when it returns and no buffer is pinned. On a
GPU each of these is a copy made at that moment, or a wait, so a buffer handed to torch before it
is filled (the FSDP2 load of issue 32), or reused before a copy out of it finished, is corrupt there
and correct on the CPU. :class:`DeviceBoundary` makes a CPU process behave as the GPU does:

* *device* tensors are the ones :meth:`DeviceBoundary.adopt` tagged (the model's parameters and
  buffers, the optimizer's state) and every copy a crossing below made to the device; coci's
  :func:`~coci_hpc.checkpoint.devices.on_host` says False for them, so the store takes its device
  paths (fresh host buffers on load, deferred pinned copies in the async snapshot);
* ``DTensor.from_local`` of a host tensor copies it to new device memory (from_local onto a CUDA
  mesh); ``Tensor.to(device=...)`` of a host tensor and ``Tensor.cuda()`` copy it to the device;
  ``Tensor.cpu()`` of a device tensor copies it to new host memory;
* ``copy_(src, non_blocking=True)`` poisons its destination (every byte 0xFF: NaN in floats) and
  copies only at the next :func:`~coci_hpc.checkpoint.devices.wait_copies`, reading ``src`` then;
* with :attr:`DeviceBoundary.device_budget` set, a copy to the device past that many bytes raises
  ``torch.OutOfMemoryError`` (a device with too little free memory);
* the async snapshot's pinned buffers (:func:`~coci_hpc.checkpoint.devices.pinned_empty`, here
  plain memory) are poisoned when :class:`~coci_hpc.checkpoint.twophase.HostBuffers` hands one
  out again or drops it;
* the side copy streams (:class:`~coci_hpc.checkpoint.devices.HostCopies`) are :class:`FakeStream`
  queues: a copy queued on one poisons its destination and lands (reading its source then) only
  when that stream is synchronised (``sync_stream``) or the current stream is made to wait for
  it (``current_after``: later work on the host comes after it) -- never at ``wait_copies``,
  which waits on the current stream only. A copy queued on a stream that was never ordered
  after the current stream (``order_after_current``) never lands (it would read the values
  before the step's kernels made them): its destination stays poisoned;
* page-locked buffers (``pinned_host``) are plain page-aligned memory, "registered" after
  :attr:`DeviceBoundary.register_delay_s` seconds (page-locking gigabytes is slow); a side-stream
  copy into memory that is not (or not yet) registered is counted in ``crossings["unpinned_dst"]``;
  ``release_host`` and a reused :class:`~coci_hpc.checkpoint.devices.PinnedStage` buffer poison it.
* a restore's host-to-device copies (:mod:`~coci_hpc.checkpoint.staging`, the ``upload_*``
  functions of :mod:`~coci_hpc.checkpoint.devices`) are non-blocking copies as above: each
  completes only at :func:`~coci_hpc.checkpoint.devices.wait_upload` of its event (with the
  copies queued before it, as on one stream) or at ``finish_uploads``, reading its staging buffer
  then; a staging buffer handed out again is poisoned first, and the staging chunk is
  :attr:`DeviceBoundary.staging_chunk` bytes, so every tensor is cut and the buffers are reused.

Tags are kept by storage address with a reference to the tensor, so an address is never reused
while tagged. Only for the tests' small states.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from coci_hpc.checkpoint import devices, staging, twophase

POISON = 0xFF


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def poison(t: torch.Tensor) -> None:
    """Every byte of ``t`` set to 0xFF (NaN in float tensors), through its raw bytes."""
    t = _local(t)
    if t.numel() and t.is_contiguous():
        with torch.no_grad():
            _ORIG["fill_"](t.view(-1).view(torch.uint8), POISON)


_ORIG: dict[str, Any] = {"fill_": torch.Tensor.fill_, "copy_": torch.Tensor.copy_}


class FakeStream:
    """A FAKE side stream: the copies queued on it, landing only when it is synchronised."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        # order_after_current was called on it (as on CUDA, everything queued after that waits for
        # the event; the fake cannot tell a stale order from a fresh one)
        self.ordered = False


class DeviceBoundary:
    def __init__(self) -> None:
        self._device: dict[int, torch.Tensor] = {}   # storage address -> a tensor on it (kept alive)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()
        self.crossings = {"from_local": 0, "to": 0, "cpu": 0, "non_blocking": 0, "poisoned_buffers": 0,
                          "side_stream": 0, "side_stream_waits": 0, "unordered": 0, "unpinned_dst": 0,
                          "registered": 0}
        self.streams: dict[str, FakeStream] = {}
        self.registered: list[tuple[int, int]] = []   # (address, bytes) of the page-locked buffers
        self.register_delay_s = 0.0   # how long page-locking one buffer takes here
        # bytes the crossings to the device may still allocate (None: no limit); past it a copy
        # to the device raises torch.OutOfMemoryError, as CUDA's caching allocator does
        self.device_budget: int | None = None
        self.staging_chunk = 4096   # the restore's staging buffers: small, so they are reused
        self.crossings.update({"uploads": 0, "poisoned_staging": 0})

    # -- which memory is the device's ----------------------------------------------------------
    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return _local(t).untyped_storage().data_ptr()

    def tag(self, t: torch.Tensor) -> torch.Tensor:
        if _local(t).untyped_storage().nbytes():
            self._device[self._key(t)] = t
        return t

    def is_device(self, t: torch.Tensor) -> bool:
        return _local(t).untyped_storage().nbytes() > 0 and self._key(t) in self._device

    def adopt(self, *objs: Any) -> None:
        """Tag the memory of modules' parameters and buffers, optimizers' state, tensors."""
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                for t in [*obj.parameters(), *obj.buffers()]:
                    self.tag(t.detach())
            elif isinstance(obj, torch.optim.Optimizer):
                for st in obj.state.values():
                    for v in st.values():
                        if isinstance(v, torch.Tensor) and v.numel() > 1:   # Adam's step stays on the host
                            self.tag(v.detach())
            elif isinstance(obj, torch.Tensor):
                self.tag(obj.detach())

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device_budget is not None:
            need = _local(t).untyped_storage().nbytes()
            if need > self.device_budget:
                raise torch.OutOfMemoryError(f"FAKE device out of memory: tried to allocate {need} bytes, "
                                             f"{self.device_budget} free")
            self.device_budget -= need
        with torch.no_grad() if not t.requires_grad else contextlib.nullcontext():
            out = t.clone()
        return self.tag(out)

    def is_registered(self, t: torch.Tensor) -> bool:
        a, n = t.data_ptr(), t.numel() * t.element_size()
        with self._lock:
            return any(lo <= a and a + n <= lo + size for lo, size in self.registered)

    def _land(self, stream: FakeStream) -> None:
        with self._lock:
            pending, stream.pending = stream.pending, []
        for dst, src in pending:
            _ORIG["copy_"](dst, src)                     # reads the source now, as the stream would

    # -- the patches --------------------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self) -> Iterator[DeviceBoundary]:
        boundary = self
        from_local = DTensor.from_local
        assert not any(n in torch.Tensor.__dict__ for n in ("to", "cuda", "cpu", "copy_")), "installed twice"
        to, cpu, copy_ = torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.copy_
        get, drop = twophase.HostBuffers.get, twophase.HostBuffers.drop_unused
        saved = (devices.on_host, devices.pinned_empty, devices.wait_copies)
        side = {n: getattr(devices, n) for n in ("copy_stream", "order_after_current", "copy_on", "current_after",
                                                 "sync_stream", "pinned_host", "release_host")}
        stage_get = devices.PinnedStage.get

        def fake_from_local(local_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not boundary.is_device(local_tensor):
                boundary.crossings["from_local"] += 1
                local_tensor = boundary._to_device(local_tensor)   # copied now, as onto a CUDA mesh
            return from_local(local_tensor, *args, **kwargs)

        def fake_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = to(self, *args, **kwargs)
            wants_device = "device" in kwargs or any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args)
            if wants_device and not boundary.is_device(self):
                boundary.crossings["to"] += 1
                if out is self or _local(out).untyped_storage().data_ptr() == boundary._key(self):
                    out = boundary._to_device(out)
                else:
                    boundary.tag(out)
            return out

        def fake_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return self if boundary.is_device(self) else boundary._to_device(self)

        def fake_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if boundary.is_device(self):
                boundary.crossings["cpu"] += 1
                with torch.no_grad():
                    return self.clone()                  # new host memory
            return cpu(self, *args, **kwargs)

        def fake_copy_(self: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
            if not non_blocking:
                return copy_(self, src)
            boundary.crossings["non_blocking"] += 1
            poison(self)                                 # not there until the wait
            with boundary._lock:
                boundary._pending.append((self, src))
            return self

        def fake_wait_copies(device: torch.device) -> None:
            with boundary._lock:
                pending, boundary._pending = boundary._pending, []
            for dst, src in pending:
                copy_(dst, src)                          # reads the source now, as the stream would

        def fake_copy_stream(device: torch.device) -> FakeStream:
            with boundary._lock:
                return boundary.streams.setdefault(str(device), FakeStream(device))

        def fake_order_after_current(stream: FakeStream, device: torch.device) -> None:
            stream.ordered = True

        def fake_copy_on(stream: FakeStream, dst: torch.Tensor, src: torch.Tensor, start: int = 0) -> None:
            src = src.contiguous().reshape(-1).view(torch.uint8)[start:start + dst.numel()]
            boundary.crossings["side_stream"] += 1
            if not boundary.is_registered(dst):
                boundary.crossings["unpinned_dst"] += 1
            poison(dst)                                  # not there until the stream is synchronised
            if not stream.ordered:
                boundary.crossings["unordered"] += 1     # would read the values before the step made them
                return
            with boundary._lock:
                stream.pending.append((dst, src))

        def fake_current_after(stream: FakeStream, device: torch.device) -> None:
            boundary._land(stream)                       # the host's next in-place update comes after

        def fake_sync_stream(stream: FakeStream) -> None:
            boundary.crossings["side_stream_waits"] += 1
            boundary._land(stream)

        def fake_pinned_host(nbytes: int, register: bool = True) -> Any:
            buf = side["pinned_host"](nbytes, register=False)
            if register and nbytes:
                if boundary.register_delay_s:
                    time.sleep(boundary.register_delay_s)   # page-locking is slow
                with boundary._lock:
                    boundary.registered.append((buf.ctypes.data, buf.nbytes))
                boundary.crossings["registered"] += 1
            return buf

        def fake_release_host(buf: Any, registered: bool = True) -> None:
            boundary.crossings["poisoned_buffers"] += 1
            buf.fill(POISON)                             # released: a late reader sees poison
            with boundary._lock:
                boundary.registered = [r for r in boundary.registered if r[0] != buf.ctypes.data]

        def fake_stage_get(self: devices.PinnedStage, name: str, nbytes: int) -> Any:
            old = self._bufs.get(name)
            got = stage_get(self, name, nbytes)
            if old is not None and got[0] is old[0]:     # reused: whatever it held is gone
                boundary.crossings["poisoned_buffers"] += 1
                got[0].fill(POISON)
            return got

        def fake_get(self: twophase.HostBuffers, name: str, nbytes: int, *args: Any, **kwargs: Any) -> Any:
            old = self._bufs.get(name)
            buf = get(self, name, nbytes, *args, **kwargs)
            if buf is old:                               # reused: whatever it held is gone
                boundary.crossings["poisoned_buffers"] += 1
                buf.fill(POISON)
            return buf

        def fake_drop(self: twophase.HostBuffers, names: set[str]) -> None:
            for n, b in self._bufs.items():
                if n not in names:
                    boundary.crossings["poisoned_buffers"] += 1
                    b.fill(POISON)                       # released: a late reader sees poison
            drop(self, names)

        uploads = self._uploads()
        uploads.__enter__()
        DTensor.from_local = staticmethod(fake_from_local)  # type: ignore[method-assign]
        torch.Tensor.to = fake_to  # type: ignore[method-assign]
        torch.Tensor.cuda = fake_cuda  # type: ignore[method-assign]
        torch.Tensor.cpu = fake_cpu  # type: ignore[method-assign]
        torch.Tensor.copy_ = fake_copy_  # type: ignore[method-assign]
        twophase.HostBuffers.get = fake_get  # type: ignore[method-assign]
        twophase.HostBuffers.drop_unused = fake_drop  # type: ignore[method-assign]
        devices.on_host = lambda t: not boundary.is_device(t)
        devices.pinned_empty = lambda nbytes: torch.empty(nbytes, dtype=torch.uint8)
        devices.wait_copies = fake_wait_copies
        for n, f in (("copy_stream", fake_copy_stream), ("order_after_current", fake_order_after_current),
                     ("copy_on", fake_copy_on), ("current_after", fake_current_after),
                     ("sync_stream", fake_sync_stream), ("pinned_host", fake_pinned_host),
                     ("release_host", fake_release_host)):
            setattr(devices, n, f)
        devices.PinnedStage.get = fake_stage_get  # type: ignore[method-assign]
        # the modules that imported the names
        import coci_hpc.checkpoint.treecode as treecode
        treecode.on_host = devices.on_host  # type: ignore[attr-defined]
        twophase.wait_copies = fake_wait_copies  # type: ignore[attr-defined]
        try:
            yield self
        finally:
            DTensor.from_local = staticmethod(from_local)  # type: ignore[method-assign]
            for name in ("to", "cuda", "cpu", "copy_"):
                delattr(torch.Tensor, name)   # back to torch._C.TensorBase's own
            twophase.HostBuffers.get, twophase.HostBuffers.drop_unused = get, drop  # type: ignore[method-assign]
            devices.on_host, devices.pinned_empty, devices.wait_copies = saved
            treecode.on_host = saved[0]  # type: ignore[attr-defined]
            twophase.wait_copies = saved[2]  # type: ignore[attr-defined]
            for n, f in side.items():
                setattr(devices, n, f)
            devices.PinnedStage.get = stage_get  # type: ignore[method-assign]
            uploads.__exit__(None, None, None)

    @contextlib.contextmanager
    def _uploads(self) -> Iterator[None]:
        """The restore's host-to-device staging (:mod:`coci_hpc.checkpoint.staging`) on the fake:
        a queued copy is one of the deferred non-blocking copies (``copy_`` above), its event the
        copy itself; waiting for it completes it and the copies queued before it."""
        boundary = self
        names = ("upload_stream", "upload_after_current", "upload_on", "wait_upload", "finish_uploads")
        saved = {n: getattr(devices, n) for n in names}
        take, chunk = staging.DeviceStager._take, staging.CHUNK
        handed: set[int] = set()   # ids of staging buffers handed out before

        def upload_on(stream: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
            boundary.crossings["uploads"] += 1
            dst.copy_(src, non_blocking=True)            # the fake's copy_: deferred, dst poisoned
            with boundary._lock:
                return boundary._pending[-1]

        def wait_upload(event: Any) -> None:
            with boundary._lock:
                at = next((i for i, p in enumerate(boundary._pending) if p is event), -1)
                done, boundary._pending = boundary._pending[:at + 1], boundary._pending[at + 1:]
            for dst, src in done:
                _ORIG["copy_"](dst, src)                     # reads the staging buffer now

        def finish_uploads(stream: Any, device: torch.device) -> None:
            devices.wait_copies(device)

        def fake_take(self: staging.DeviceStager, k: int) -> torch.Tensor:
            buf = take(self, k)
            if id(buf) in handed:                         # refilled: whatever it held is gone
                boundary.crossings["poisoned_staging"] += 1
                buf.fill_(POISON)
            handed.add(id(buf))
            return buf

        devices.upload_stream = lambda device: object()  # type: ignore[assignment]
        devices.upload_after_current = lambda stream, device: None
        devices.upload_on = upload_on
        devices.wait_upload = wait_upload
        devices.finish_uploads = finish_uploads
        staging.DeviceStager._take = fake_take  # type: ignore[method-assign]
        staging.CHUNK = self.staging_chunk
        try:
            yield
        finally:
            for n, f in saved.items():
                setattr(devices, n, f)
            staging.DeviceStager._take, staging.CHUNK = take, chunk  # type: ignore[method-assign]
