"""A rank's random number generators as a tree a checkpoint stores (no pickle): python ``random``,
numpy's global generator, torch CPU and CUDA when present. Checkpoints store it per rank
(``per_rank/__rng__``, :func:`coci_hpc.checkpoint.state.collect`); the survivors' partner copy
carries it too (:mod:`coci_hpc.runtime.rngstate`).
"""
from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """RNG states of this rank: python ``random``, numpy's global generator, torch CPU and CUDA."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    out: dict[str, Any] = {
        "python": {"version": version, "state": np.asarray(internal, dtype=np.int64), "gauss": gauss},
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": np.asarray(np_state["state"]["key"]).copy(),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in np.asarray(py["state"])), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state({"bit_generator": npst["bit_generator"],
                         "state": {"key": np.asarray(npst["key"], dtype=np.uint32), "pos": int(npst["pos"])},
                         "has_gauss": int(npst["has_gauss"]), "gauss": float(npst["gauss"])})
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in cuda])
