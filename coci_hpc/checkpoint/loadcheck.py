"""The check of a saved tree against the object it would be loaded into, before anything is loaded.

``load_state_dict`` of many objects trusts its input, so a tree from a checkpoint (which may be
damaged or crafted) is refused unless its entries are ones the object has, each of a compatible
kind (:func:`check_skeleton`).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint.treecode import unflatten
from coci_hpc.errors import CheckpointError


class AnyTensor(Mapping):
    """Stands for every tensor of a skeleton when only its structure is checked."""

    def __getitem__(self, name: str) -> Any:
        return _TENSOR

    def __contains__(self, name: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


_TENSOR = object()


def check_skeleton(key: str, current: Any, skeleton: Any) -> None:
    """Refuse a saved tree that does not fit the state object it would be loaded into.

    ``load_state_dict`` of many objects trusts its input (an LR scheduler does
    ``__dict__.update``: an entry ``"optimizer": "pwn"`` replaced its optimizer and training
    crashed later). Checked: the saved tree has no top-level entry the object does not have, and
    every entry both have is of a compatible kind (number, bool, string, tensor, dict, list).
    Entries missing from the checkpoint are the object's business (older versions).
    """
    saved = unflatten(skeleton, AnyTensor())
    problem = None
    if isinstance(current, Mapping) and current and all(isinstance(k, str) for k in current):
        if not isinstance(saved, Mapping):
            problem = f"the checkpoint holds a {type(saved).__name__}, the object's state is a dict"
        else:
            extra = sorted(str(k) for k in saved if k not in current)
            if extra:
                problem = f"entries {extra[:5]} are not part of this object's state"
    problem = problem or _tree_problem(current, saved, key)
    if problem:
        raise CheckpointError(f"state {key!r} in the checkpoint does not fit the "
                                f"object passed to load: {problem}",
                                hint="the manifest was edited, damaged, or written for another kind of "
                                     "object; load an older step or pass the same kind of object")


def _kind(x: Any) -> str:
    if x is _TENSOR or isinstance(x, (torch.Tensor, np.ndarray)):
        return "tensor"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, (int, float, np.number)):
        return "number"
    if isinstance(x, str):
        return "string"
    if isinstance(x, Mapping):
        return "dict"
    if isinstance(x, (list, tuple)):
        return "list"
    if isinstance(x, torch.dtype):
        return "dtype"
    return "other"


_COMPATIBLE = {("tensor", "number"), ("number", "tensor")}  # e.g. optimizer "step" across versions


def _tree_problem(cur: Any, saved: Any, where: str, depth: int = 0) -> str | None:
    if cur is None or saved is None or depth > 64:
        return None
    a, b = _kind(cur), _kind(saved)
    if a == "other" or (a != b and (a, b) not in _COMPATIBLE):
        if a == "other":
            return None
        return f"{where!r} is a {b} in the checkpoint but a {a} in the object's state"
    if a == "dict":
        for k in cur:
            if k in saved:
                p = _tree_problem(cur[k], saved[k], f"{where}/{k}", depth + 1)
                if p:
                    return p
    elif a == "list":
        for i, (x, y) in enumerate(zip(cur, saved)):
            p = _tree_problem(x, y, f"{where}/{i}", depth + 1)
            if p:
                return p
    return None
