"""What the example training scripts share: a fixed synthetic regression task and a fingerprint of
a model's parameters (the ``final_params_sha256=`` / ``PARAM_HASH`` they print, compared across an
interrupted and an uninterrupted run). Not a script; imported by the examples next to it."""
from __future__ import annotations

import hashlib

import numpy as np
import torch


def make_data(n: int, d_in: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples of a fixed regression task y = tanh(x @ w) + noise (independent of the global RNG)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    w = rng.standard_normal((d_in, 1)).astype(np.float32)
    y = np.tanh(x @ w) + 0.1 * rng.standard_normal((n, 1)).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y)


def params_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the model's state dict, names and bytes, in name order (on any device). A DTensor
    (FSDP2) is gathered first (a collective: every rank calls it), so sharded and plain runs hash alike."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
