"""Checkpoints to export and compare against, shared by the interop tests and their scripts."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from coci_hpc.checkpoint import CheckpointManager
from tests.checkpoint.helpers import empty_state, full_state


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bit-identity, NaNs and -0.0 included)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))


def save_full(root: Path, step: int = 3, seed: int = 1) -> dict[str, Any]:
    """Save :func:`full_state` (a model with fp32, bf16, bool, int64 tensors, Adam, ...) at ``step``."""
    state = full_state(seed)
    mgr = CheckpointManager(root, keep=3)
    mgr.save(step, state)
    mgr.close()
    return state


def loaded_reference(root: Path, step: int) -> dict[str, Any]:
    """What CheckpointManager.load gives back: the reference every export is compared with."""
    state = empty_state()
    mgr = CheckpointManager(root, lock=False)
    mgr.load(step, state)
    mgr.close()
    return state
