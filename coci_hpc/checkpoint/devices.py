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


def pinned_empty(nbytes: int) -> torch.Tensor | None:
    """Page-locked host bytes for device-to-host copies; None without CUDA (plain memory serves)."""
    if not torch.cuda.is_available():
        return None
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def wait_copies(device: torch.device) -> None:
    """Block until the copies issued (``non_blocking=True``) on ``device``'s current stream are done."""
    torch.cuda.current_stream(device).synchronize()
