"""A rank's random number generators as a tree a checkpoint stores (no pickle): python ``random``,
numpy's global generator, torch CPU and CUDA when present. Checkpoints store it per rank
(``per_rank/__rng__``, :func:`coci_hpc.checkpoint.state.collect`); the survivors' partner copy
carries it too (:mod:`coci_hpc.runtime.rngstate`). Generator objects among the state's values
(:class:`GeneratorState`) are stored the same way.
"""
from __future__ import annotations

import json
import random
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from coci_hpc.errors import CheckpointError


def _python_tree(gen: Any) -> dict[str, Any]:
    """Python's generator state (the ``random`` module's own, or a ``random.Random``'s)."""
    version, internal, gauss = gen.getstate()
    return {"version": version, "state": np.asarray(internal, dtype=np.int64), "gauss": gauss}


def _set_python(gen: Any, tree: Mapping[str, Any]) -> None:
    gen.setstate((int(tree["version"]), tuple(int(x) for x in np.asarray(tree["state"])), tree["gauss"]))


def _legacy_tree(gen: Any) -> dict[str, Any]:
    """numpy's legacy generator state (``numpy.random``'s global one, or a ``RandomState``'s)."""
    st = gen.get_state(legacy=False)
    return {"bit_generator": st["bit_generator"], "key": np.asarray(st["state"]["key"]).copy(),
            "pos": int(st["state"]["pos"]), "has_gauss": int(st["has_gauss"]), "gauss": float(st["gauss"])}


def _set_legacy(gen: Any, tree: Mapping[str, Any]) -> None:
    gen.set_state({"bit_generator": tree["bit_generator"],
                   "state": {"key": np.asarray(tree["key"], dtype=np.uint32), "pos": int(tree["pos"])},
                   "has_gauss": int(tree["has_gauss"]), "gauss": float(tree["gauss"])})


def capture_rng() -> dict[str, Any]:
    """RNG states of this rank: python ``random``, numpy's global generator, torch CPU and CUDA."""
    out: dict[str, Any] = {"python": _python_tree(random), "numpy": _legacy_tree(np.random),
                           "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    _set_python(random, state["python"])
    _set_legacy(np.random, state["numpy"])
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in cuda])


def generator_kind(obj: Any) -> str | None:
    """Which kind of random number generator object ``obj`` is (one a user keeps in the state,
    e.g. a data sampler's or an augmentation's): "torch.Generator", "numpy.random.Generator",
    "numpy.random.RandomState" or "random.Random"; None for anything else."""
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
            return {"kind": self.kind, **_legacy_tree(g)}   # as the rank's global ones (capture_rng)
        return {"kind": self.kind, **_python_tree(g)}

    def load_state_dict(self, tree: Mapping[str, Any]) -> None:
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
                _set_legacy(g, tree)
            else:
                _set_python(g, tree)
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"the saved {self.kind} state does not fit the one in the state passed to "
                                  f"load: {exc}",
                                  hint="load into a generator of the same kind (numpy: the same bit "
                                       "generator; torch: the same device type) as the one saved") from exc
