"""Restoring loaded trees into the user's state: all or nothing.

Objects that may refuse their input are loaded first and, if one refuses, those already loaded
get their previous state back (the rollback); modules, tensors, dicts and lists come after, once
nothing can refuse any more. A module whose tensors were filled in place is not loaded again.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from coci_hpc.checkpoint.dtensor import is_dtensor, local_of
from coci_hpc.checkpoint.leaves import LeafKind, PerRank, Sharded
from coci_hpc.checkpoint.rng import restore_rng
from coci_hpc.checkpoint.state import is_stateful, load_tree, module_tree
from coci_hpc.checkpoint.treecode import unflatten
from coci_hpc.errors import CheckpointError


def apply(state: Mapping[str, Any], skeletons: Mapping[str, Any], tensors: Mapping[str, Any],
          *, rng: bool = True, before: Mapping[str, Any] | None = None,
          fill: Callable[[], None] | None = None, in_place: frozenset[int] = frozenset()) -> list[str]:
    """Restore loaded trees into the user's state in place; return the keys that were missing.

    All or nothing: stateful objects that may refuse their input (optimizers, schedulers,
    samplers, scalers: everything but modules) are loaded first; if one refuses, those already
    loaded get back their previous state (``before``: their trees from
    :func:`current_trees`, taken before the load) and nothing else was touched. Modules, plain
    tensors, dicts and lists come after; their keys, shapes and dtypes were checked beforehand,
    and ``tensors`` are fresh buffers, so no byte reached the state before this point.
    ``fill`` runs between the two groups: a load that writes the checked bytes into the state's
    own tensors does it there, once no object can refuse any more. ``in_place``: ids of the
    tensors ``fill`` wrote into (the module's own storage); a module whose every entry is one of
    them is not given to ``load_state_dict`` at all (:func:`_loaded_in_place`).
    """
    missing: list[str] = []
    pending: list[tuple[str, Any, Any]] = []
    for key, value in state.items():
        section = LeafKind.PER_RANK if isinstance(value, PerRank) else LeafKind.REPLICATED
        inner = value.value if isinstance(value, PerRank) else value
        skel = skeletons.get(section, {})
        if key not in skel:
            missing.append(key)
            continue
        pending.append((key, inner, unflatten(skel[key], tensors)))
        if not (is_stateful(inner) or isinstance(inner, (dict, list, Sharded, torch.Tensor))):
            raise CheckpointError(f"cannot restore state key {key!r} of type {type(inner).__name__} in place",
                                  hint="pass a dict, a list, a tensor or an object with load_state_dict")
    rng_tree = None
    if rng and "__rng__" in skeletons.get(LeafKind.PER_RANK, {}):
        rng_tree = unflatten(skeletons[LeafKind.PER_RANK]["__rng__"], tensors)
    loaded: list[tuple[str, Any]] = []
    try:
        for key, inner, tree in pending:
            if is_stateful(inner) and not isinstance(inner, torch.nn.Module):
                load_tree(state, key, inner, tree)
                loaded.append((key, inner))
    except BaseException:
        for key, inner in reversed(loaded):
            if before is not None and key in before:
                load_tree(state, key, inner, before[key])
        raise
    if fill is not None:
        fill()
    for _key, inner, tree in pending:
        if is_stateful(inner) and not isinstance(inner, torch.nn.Module):
            continue
        if isinstance(inner, torch.nn.Module) and isinstance(tree, Mapping):
            live = inner.state_dict(keep_vars=True)
            tree = module_tree(inner, tree, list(live))  # saved under clean names (.fqn)
            if not _loaded_in_place(inner, tree, in_place, live):
                inner.load_state_dict(tree)
        elif is_stateful(inner):
            inner.load_state_dict(tree)
        elif isinstance(inner, dict):
            _load_into_dict(inner, tree)
        elif isinstance(inner, list):
            inner[:] = tree
        elif isinstance(inner, Sharded):
            if tree is not inner.local:
                inner.local.copy_(tree)
        elif isinstance(inner, torch.Tensor):
            if tree is not inner:
                with torch.no_grad():
                    inner.copy_(tree)
    if rng:
        if rng_tree is not None:
            restore_rng(rng_tree)
        else:
            missing.append("__rng__")
    return missing


def _known_hook(hook: Any) -> bool:
    """A load-state-dict hook of FSDP2's own: the pre-hook reshards unsharded parameters (they
    are sharded: their shards were just written) and the post-hook re-pads a parameter only
    if it was replaced (it was not)."""
    fn = getattr(hook, "hook", hook)  # pre-hooks come wrapped (_WrappedHook)
    return str(getattr(fn, "__module__", "")).startswith("torch.distributed.fsdp._fully_shard")


def _loaded_in_place(module: torch.nn.Module, tree: Any, in_place: frozenset[int],
                     live: Mapping[str, Any] | None = None) -> bool:
    """True when ``tree`` holds only tensors already written into ``module``'s own storage, so
    ``load_state_dict`` would copy each onto itself (for FSDP2 a DTensor dispatch and a memcpy
    per parameter: a tenth of a same-mesh load in the issue-23 profile). Any hook of the user's
    (or extra state) keeps the ordinary path. ``live``: the module's
    ``state_dict(keep_vars=True)`` where the caller has it already."""
    if not in_place or not isinstance(tree, Mapping) or not tree:
        return False
    if not all(isinstance(v, torch.Tensor) and id(v) in in_place for v in tree.values()):
        return False
    for m in module.modules():
        hooks = list(m._load_state_dict_pre_hooks.values()) + list(m._load_state_dict_post_hooks.values())
        if any(not _known_hook(h) for h in hooks) or \
                type(m).get_extra_state is not torch.nn.Module.get_extra_state:
            return False
    if live is None:
        live = module.state_dict(keep_vars=True)
    return len(live) == len(tree) and all(_same_memory(tree[k], live.get(k)) for k in tree)


def _same_memory(a: torch.Tensor, b: Any) -> bool:
    """``a`` is a view of exactly ``b``'s bytes (a module whose state_dict() hands out copies
    must get its loaded values through load_state_dict)."""
    if not isinstance(b, torch.Tensor):
        return False
    if is_dtensor(a) != is_dtensor(b):
        return False
    a, b = (local_of(a), local_of(b)) if is_dtensor(a) else (a, b)
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.device == b.device and a.data_ptr() == b.data_ptr())


def _load_into_dict(target: dict, tree: Any) -> None:
    for k, v in tree.items():
        cur = target.get(k)
        if isinstance(cur, Sharded):
            if v is not cur.local:
                cur.local.copy_(v)
        else:
            target[k] = v
    for k in [k for k in target if k not in tree]:
        del target[k]
