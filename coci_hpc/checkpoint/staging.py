"""Checked host bytes into device tensors: a restore's host-to-device copies (issue 32).

A load into CUDA tensors must not make a pageable host copy of every tensor and hand it to torch
(``copy_`` or ``load_state_dict`` from pageable memory is a synchronous copy through a staging
buffer of CUDA's own, and the host copies are fresh memory the size of the state). Here the
checked bytes go, chunk by chunk, into one of two reused page-locked buffers, and each chunk's
copy to the device is queued on a side stream (``non_blocking``): while the device copies chunk k
out of one buffer, the host reads chunk k+1 into the other. Before a buffer is refilled the copy
out of it is waited for (its event); :meth:`DeviceStager.finish` waits for the last ones. Every
CUDA call is one of :mod:`.devices`' functions (the CPU tests' fake replaces them).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint import devices

CHUNK = 32 << 20  # bytes per staging buffer: large enough for full-speed copies, two per load

# (file offset, byte in the device tensor, bytes): the runs of one device tensor
DeviceRuns = list[tuple[int, int, int]]


class DeviceStager:
    """Copies byte runs of a file into device tensors through two page-locked staging buffers.

    ``read(buf, at)`` fills the host array ``buf`` with the (checked) file bytes at offset ``at``.
    """

    def __init__(self, read: Callable[[np.ndarray, int], None], chunk: int | None = None) -> None:
        self._read = read
        self._chunk = chunk or CHUNK
        self._bufs: list[torch.Tensor] = []      # made at the first copy: a load without device tensors makes none
        self._events: list[Any] = []             # per buffer: the copy out of it still in flight, or None
        self._streams: dict[torch.device, Any] = {}
        self._k = 0
        self.chunks = 0                          # copies queued (for tests and stats)

    def _stream(self, device: torch.device) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = devices.upload_stream(device)
            # the tensors copied into may still be in use by kernels queued on the current stream
            devices.upload_after_current(s, device)
        return s

    def _take(self, k: int) -> torch.Tensor:
        """Staging buffer ``k``, once the copy queued out of it before is done (only then may it
        be refilled: that copy reads it on the device's schedule, not at the call)."""
        event = self._events[k]
        if event is not None:
            devices.wait_upload(event)
            self._events[k] = None
        return self._bufs[k]

    def _make_buffers(self, nbytes: int) -> None:
        size = min(self._chunk, nbytes)
        for _ in range(2):
            buf = devices.pinned_empty(size)
            if buf is None:  # no CUDA: plain host memory (only a fake device gets here)
                buf = torch.empty(size, dtype=torch.uint8)
            self._bufs.append(buf)
            self._events.append(None)

    def put(self, dst: torch.Tensor, runs: DeviceRuns) -> None:
        """Queue the copies of ``runs`` into ``dst`` (a contiguous device tensor, written as bytes).
        Runs larger than a buffer are cut; small runs share one buffer and one copy where they
        are adjacent in ``dst``."""
        flat = dst.reshape(-1).view(torch.uint8)
        total = sum(n for _, _, n in runs)
        if total == 0:
            return
        if not self._bufs:
            self._make_buffers(max(total, 1))
        size = self._bufs[0].numel()
        stream = self._stream(dst.device)
        pending: list[tuple[int, int, int]] = []   # runs gathered into the current buffer
        filled = 0

        def send() -> None:
            nonlocal pending, filled
            if not pending:
                return
            k = self._k % 2
            buf = self._take(k)
            host = buf.numpy()
            pos = 0
            for at, _, n in pending:
                self._read(host[pos:pos + n], at)
                pos += n
            # one copy per run of adjacent destination bytes
            pos = 0
            i = 0
            while i < len(pending):
                start, first = pos, pending[i][1]
                stop = first
                while i < len(pending) and pending[i][1] == stop:
                    stop += pending[i][2]
                    pos += pending[i][2]
                    i += 1
                self._events[k] = devices.upload_on(stream, flat[first:stop], buf[start:pos])
                self.chunks += 1
            self._k += 1
            pending, filled = [], 0

        for at, off, n in runs:
            done = 0
            while done < n:
                take = min(n - done, size - filled)
                pending.append((at + done, off + done, take))
                filled += take
                done += take
                if filled == size:
                    send()
        send()

    def finish(self) -> None:
        """Wait until every queued copy is done; the staging buffers go back to torch."""
        for device, stream in self._streams.items():
            devices.finish_uploads(stream, device)
        self._events = [None] * len(self._events)
        self._bufs = []
        self._streams = {}
