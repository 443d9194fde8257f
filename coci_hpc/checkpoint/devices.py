"""Where a tensor's bytes live, and the waits a copy across the host/device boundary needs.

The store reads a tensor's memory as host bytes only when :func:`on_host` says so, and hands host
bytes to torch (``DTensor.from_local``, ``load_state_dict``, ``copy_``) only once they are filled:
across a boundary torch copies at that moment. The three calls are one place, so the CPU tests'
device-boundary fake (``tests/checkpoint/fake_device.py``) can make CPU tensors behave as CUDA
ones (issue 32: on a CPU mesh ``from_local`` shares memory, which hid a bug every GPU load hit).
"""
from __future__ import annotations

import torch


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
