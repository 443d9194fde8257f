"""A rank's random number generators as a tree a checkpoint stores (no pickle): python ``random``,
numpy's global generator, torch CPU and CUDA when present. Checkpoints store it per rank
(``per_rank/__rng__``, :func:`coci_hpc.checkpoint.state.collect`); the survivors' partner copy
carries it too (:mod:`coci_hpc.runtime.rngstate`).
"""
from __future__ import annotations

import json
import random
import zlib
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


GENERATOR_KINDS = ("torch.Generator", "numpy.random.Generator", "numpy.random.RandomState", "random.Random")


def generator_kind(obj: Any) -> str | None:
    """Which of :data:`GENERATOR_KINDS` ``obj`` is (a random number generator object a user keeps
    in the state, e.g. a data sampler's or an augmentation's), or None."""
    if isinstance(obj, torch.Generator):
        return "torch.Generator"
    if isinstance(obj, np.random.Generator):
        return "numpy.random.Generator"
    if isinstance(obj, np.random.RandomState):
        return "numpy.random.RandomState"
    if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):  # SystemRandom has no state
        return "random.Random"
    return None


def _plain(tree: Any) -> Any:
    """numpy's generator state as the store keeps it: dicts, Python scalars, arrays (copied)."""
    if isinstance(tree, Mapping):
        return {str(k): _plain(v) for k, v in tree.items()}
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, np.generic):
        return tree.item()
    return tree


def _digest(tree: Any) -> int:
    def plain(x: Any) -> Any:
        return x.tolist() if isinstance(x, np.ndarray) else x

    text = json.dumps(tree, sort_keys=True, default=plain)
    return zlib.crc32(text.encode())


class GeneratorState:
    """A random number generator object of the user's state, saved and loaded like a stateful
    object (``state_dict`` / ``load_state_dict``): tensors and JSON values, no pickle, the same
    numbers drawn after a load as after the save. The store wraps the generators it finds as
    values of the state (:func:`~coci_hpc.checkpoint.state.with_generators`); a value that
    differs between ranks (a generator seeded by rank) goes in ``PerRank`` as any other.

    The tree names the generator's kind; a load into another kind (or a torch generator of
    another device type, whose state has another size) is refused and changes nothing."""

    def __init__(self, gen: Any) -> None:
        kind = generator_kind(gen)
        if kind is None:
            raise TypeError(f"not a random number generator: {type(gen).__name__}")
        self.gen, self.kind = gen, kind

    def state_dict(self) -> dict[str, Any]:
        g = self.gen
        if self.kind == "torch.Generator":
            return {"kind": self.kind, "state": g.get_state()}
        if self.kind == "numpy.random.Generator":
            state = _plain(g.bit_generator.state)
            # PCG64's state (numpy's default) is two 128-bit integers, JSON only: its digest, a
            # tensor leaf, lets the first save's cross-rank check (.replicas) see a generator
            # that differs between ranks outside PerRank (seeded by rank) instead of saving rank 0's
            return {"kind": self.kind, "state": state, "digest": np.array([_digest(state)], dtype=np.uint32)}
        if self.kind == "numpy.random.RandomState":
            return {"kind": self.kind, "state": _plain(g.get_state(legacy=False))}
        version, internal, gauss = g.getstate()
        return {"kind": self.kind, "version": version, "state": np.asarray(internal, dtype=np.int64), "gauss": gauss}

    def load_state_dict(self, tree: Mapping[str, Any]) -> None:
        from coci_hpc.errors import CheckpointError

        saved = tree.get("kind") if isinstance(tree, Mapping) else None
        if saved != self.kind:
            raise CheckpointError(f"the checkpoint holds a {saved or 'value that is not a generator'} where the "
                                  f"state passed to load has a {self.kind}",
                                  hint="load into a state built like the one that was saved")
        g = self.gen
        try:
            if self.kind == "torch.Generator":
                g.set_state(torch.as_tensor(tree["state"], dtype=torch.uint8).cpu())
            elif self.kind == "numpy.random.Generator":
                g.bit_generator.state = dict(tree["state"])
            elif self.kind == "numpy.random.RandomState":
                g.set_state(dict(tree["state"]))
            else:
                g.setstate((int(tree["version"]), tuple(int(x) for x in np.asarray(tree["state"])), tree["gauss"]))
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"the saved {self.kind} state does not fit the one in the state passed to "
                                  f"load: {exc}",
                                  hint="load into a generator of the same kind (numpy: the same bit "
                                       "generator; torch: the same device type) as the one saved") from exc
