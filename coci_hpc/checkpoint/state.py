"""Collect training state as trees, and find what in it a load must treat specially.

A *state* given to :class:`~coci_hpc.checkpoint.api.CheckpointManager` is a mapping whose values
are either *stateful* objects (``state_dict()`` / ``load_state_dict()``: a model, an optimizer, an
LR scheduler, an AMP ``GradScaler``, a :class:`~coci_hpc.runtime.data.ResumableSampler`) or
plain trees of dicts/lists/tuples with JSON leaves and tensors (the training step, the planner
state, user extras). Values are *replicated* by default (identical on every data-parallel rank);
wrap a value in :class:`~coci_hpc.checkpoint.leaves.PerRank` for state that differs per rank, and
a tensor in :class:`~coci_hpc.checkpoint.leaves.Sharded` for a tensor split along dim 0 across
ranks (it is stored whole and re-split on load). RNG states (python ``random``, numpy, torch CPU,
CUDA when present) are always per rank.

:func:`collect` flattens a state (:mod:`.treecode`); :func:`current_trees`, :func:`iter_targets`
and :func:`match_saved_keys` find where a load's tensors go; the load's checks are
:mod:`.loadcheck`'s and its all-or-nothing restore :mod:`.restore`'s.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint.dtensor import is_dtensor, local_of
from coci_hpc.checkpoint.fqn import saved_to_live, state_names
from coci_hpc.checkpoint.leaves import LeafKind, PerRank, Sharded, escape_key
from coci_hpc.checkpoint.loadcheck import AnyTensor
from coci_hpc.checkpoint.optim_names import is_fqn_keyed, param_names, to_fqn, to_index
from coci_hpc.checkpoint.rng import GeneratorState, capture_rng, generator_kind
from coci_hpc.checkpoint.treecode import Leaf, flatten, unflatten
from coci_hpc.checkpoint.unsupported import check_value
from coci_hpc.errors import CheckpointError


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def find_optimizers(tree: Any, found: list[torch.optim.Optimizer] | None = None,
                    _seen: set[int] | None = None) -> list[torch.optim.Optimizer]:
    """Every optimizer anywhere in a state: top level, inside PerRank, dicts, lists, tuples."""
    found = [] if found is None else found
    seen = set() if _seen is None else _seen
    if id(tree) in seen:
        return found
    seen.add(id(tree))
    if isinstance(tree, torch.optim.Optimizer):
        if all(o is not tree for o in found):
            found.append(tree)
    elif isinstance(tree, PerRank):
        find_optimizers(tree.value, found, seen)
    elif isinstance(tree, Mapping):
        for v in tree.values():
            find_optimizers(v, found, seen)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            find_optimizers(v, found, seen)
    else:
        inner = getattr(tree, "optimizer", None)  # wrappers (LR schedulers, ZeRO-style shells)
        if isinstance(inner, torch.optim.Optimizer):
            find_optimizers(inner, found, seen)
    return found


def guarded_ptrs(optimizers: list[torch.optim.Optimizer]) -> frozenset[int]:
    """Data pointers of the tensors only these optimizers' ``step`` changes: their parameters
    and their state. A module buffer (BatchNorm statistics, a step counter) changes in forward
    and is not among them, so it is snapshot synchronously."""
    ptrs = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if isinstance(p, torch.Tensor) and p.numel():
                    ptrs.add((local_of(p) if is_dtensor(p) else p).data_ptr())
        for st in opt.state.values():
            if isinstance(st, Mapping):
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.numel():
                        ptrs.add((local_of(v) if is_dtensor(v) else v).data_ptr())
    return frozenset(ptrs)


def with_generators(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` with each random number generator object among its values (top level or in
    ``PerRank``) seen through a :class:`~coci_hpc.checkpoint.rng.GeneratorState`, which saves
    and loads it like any stateful object; ``state`` itself when it holds none. Saves
    (:func:`collect`) and loads (:func:`~coci_hpc.checkpoint.load.load`) begin here."""
    out: dict[str, Any] | None = None
    for key, value in state.items():
        inner = value.value if isinstance(value, PerRank) else value
        if generator_kind(inner) is not None:
            out = dict(state) if out is None else out
            out[key] = PerRank(GeneratorState(inner)) if isinstance(value, PerRank) else GeneratorState(inner)
    return state if out is None else out


def collect(state: Mapping[str, Any], *, rng: bool = True, defer_device: bool = False,
            guarded: frozenset[int] = frozenset()) -> tuple[dict[str, Any], list[Leaf]]:
    """Flatten a user state into ``({"replicated":..., "per_rank":...} skeletons, leaves)``."""
    state = with_generators(state)
    leaves: list[Leaf] = []
    repl: dict[str, Any] = {}
    per_rank: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not key or "/" in key or key == "__rng__":
            raise CheckpointError(f"state key {key!r} is not a plain name",
                                  hint="use short string keys such as 'model' or 'optimizer'")
        target, kind, value = (per_rank, LeafKind.PER_RANK, value.value) if isinstance(value, PerRank) \
            else (repl, LeafKind.REPLICATED, value)
        check_value(key, value)
        tree = _tree_of(state, value)
        first = len(leaves)
        target[key] = flatten(tree, f"{kind}/{key}", kind, leaves, defer_device, guarded)
        if kind == LeafKind.REPLICATED and isinstance(value, torch.nn.Module):
            _buffers_from_rank0(value, f"{kind}/{key}", leaves, first)
    if rng:
        per_rank["__rng__"] = flatten(capture_rng(), f"{LeafKind.PER_RANK}/__rng__", LeafKind.PER_RANK, leaves)
    return {LeafKind.REPLICATED: repl, LeafKind.PER_RANK: per_rank}, leaves


def _buffers_from_rank0(module: torch.nn.Module, prefix: str, leaves: list[Leaf], first: int) -> None:
    """Mark the leaves ``leaves[first:]`` of ``module``'s buffers as LeafKind.FROM_RANK0: replicated, with
    rank 0's value the authoritative one, written by rank 0 alone (:mod:`.layout`). Ranks may hold
    different values there (BatchNorm running statistics come from each rank's own batch) and DDP
    broadcasts rank 0's at the next forward (``broadcast_buffers``), so rank 0's are the ones the
    uninterrupted run goes on with. Every other replicated leaf must be equal on all ranks
    (checked: :mod:`.replicas`). A buffer's leaf is named by its clean name (:mod:`.fqn`; also
    where the module's own ``state_dict`` cleans it: activation checkpointing's wrapper does,
    its ``named_buffers`` does not) or, where the module's keys are kept, its own."""
    own = [n for n, _ in module.named_buffers(remove_duplicate=False)]
    clean = state_names(module, own)
    names = {f"{prefix}/{escape_key(x)}" for n in own for x in (n, clean.get(n, n))}
    if not names:
        return
    for i in range(first, len(leaves)):
        if leaves[i].name in names:
            leaves[i] = replace(leaves[i], kind=LeafKind.FROM_RANK0)


def current_trees(state: Mapping[str, Any]) -> dict[str, Any]:
    """Each state value as a tree (``state_dict()`` of stateful objects), taken ONCE per load.

    Some ``state_dict`` methods are collective (a planner that broadcasts rank 0's view), so
    every rank calls them here, at the same point; the trees then serve for the in-place
    targets, the checks and the rollback of a refused load.
    """
    out = {}
    for key, value in state.items():
        inner = value.value if isinstance(value, PerRank) else value
        check_value(key, inner)
        out[key] = _tree_of(state, inner)
    return out


def _tree_of(state: Mapping[str, Any], value: Any) -> Any:
    """The tree a state value is saved as: ``state_dict()`` of a stateful object, a module's
    keyed by their names without wrapper parts (:mod:`.fqn`), an optimizer's by parameter
    names when its model is in the state (:mod:`.optim_names`)."""
    if isinstance(value, torch.nn.Module):
        sd = value.state_dict()
        names = state_names(value, sd.keys())
        return {names.get(k, k): v for k, v in sd.items()} if names else sd
    return _named(state, value, value.state_dict()) if is_stateful(value) else value


def _named(state: Mapping[str, Any], value: Any, tree: Any) -> Any:
    if isinstance(value, torch.optim.Optimizer) and isinstance(tree, Mapping) and "param_groups" in tree:
        names = param_names(state, value)
        if names is not None:
            return to_fqn(tree, names)
    return tree


def live_trees(state: Mapping[str, Any], obj: Any) -> list[Any]:
    """``obj.state_dict()`` and, for an optimizer whose model is in the state, the same keyed by
    parameter name: where a loaded tensor now lives, under either naming."""
    tree = obj.state_dict()
    named = _named(state, obj, tree)
    return [tree] if named is tree else [tree, named]


def saved_keys(skeleton: Any) -> set[str]:
    """The top-level keys of a saved tree's skeleton (a module's state-dict keys)."""
    if isinstance(skeleton, dict) and "__dict__" in skeleton and len(skeleton) == 1:
        return {str(k) for k, _ in skeleton["__dict__"]}
    return set(skeleton) if isinstance(skeleton, dict) else set()


def match_saved_keys(state: Mapping[str, Any], skeletons: Mapping[str, Any], trees: dict[str, Any],
                     targets: dict[str, Any]) -> None:
    """Name the current trees as the checkpoint names them. A module saved under other names
    than its clean ones (:mod:`.fqn`: a checkpoint written before modules were saved under
    them) gets its tree and in-place targets under the saved names. An optimizer saved
    index-keyed (before optimizer state was keyed by name, or without its model) is loaded
    index-keyed: its current tree and in-place targets go back to positions.
    ``skeletons``: this rank's {"replicated": ..., "per_rank": ...} saved skeletons."""
    for key, value in state.items():
        section = LeafKind.PER_RANK if isinstance(value, PerRank) else LeafKind.REPLICATED
        inner = value.value if isinstance(value, PerRank) else value
        saved = skeletons.get(section, {}).get(key)
        if isinstance(inner, torch.nn.Module) and saved is not None and isinstance(trees[key], Mapping):
            _module_as_saved(inner, saved_keys(saved), trees, key, f"{section}/{key}", targets)
            continue
        if not isinstance(inner, torch.optim.Optimizer) or saved is None or not is_fqn_keyed(trees[key]):
            continue
        if is_fqn_keyed(unflatten(saved, AnyTensor())):
            continue
        trees[key] = to_index(trees[key], inner, param_names(state, inner), key)
        prefix = f"{section}/{key}/"
        for name in [n for n in targets if n.startswith(prefix)]:
            del targets[name]
        _collect_tensors(trees[key], f"{section}/{key}", targets)


def _module_as_saved(module: torch.nn.Module, saved: set[str], trees: dict[str, Any], key: str,
                     prefix: str, targets: dict[str, Any]) -> None:
    tree = trees[key]
    if saved == set(tree):
        return
    live = list(module.state_dict(keep_vars=True))
    names = state_names(module, live)
    mapping = saved_to_live(saved, live, names)
    if mapping is None:
        return  # the load's checks name what differs
    trees[key] = {s: tree[names.get(raw, raw)] for s, raw in mapping.items()}
    for name in [n for n in targets if n.startswith(prefix + "/")]:
        del targets[name]
    _collect_tensors(trees[key], prefix, targets)


def module_tree(module: torch.nn.Module, tree: Mapping[str, Any], live: list[str]) -> Mapping[str, Any]:
    """A loaded module tree under the module's own state-dict keys ``live`` (it may be saved
    under the clean names, or another wrapping's: :func:`~.fqn.saved_to_live`); as it is when
    the keys cannot be mapped (``load_state_dict`` then names them)."""
    if set(tree) == set(live):
        return tree
    mapping = saved_to_live(set(tree), live, state_names(module, live))
    return tree if mapping is None else {mapping[s]: v for s, v in tree.items()}


def load_tree(state: Mapping[str, Any], key: str, inner: Any, tree: Any) -> None:
    """``inner.load_state_dict(tree)``, an optimizer's name-keyed tree mapped to its positions."""
    if isinstance(inner, torch.optim.Optimizer) and is_fqn_keyed(tree):
        tree = to_index(tree, inner, param_names(state, inner), key)
    inner.load_state_dict(tree)


def iter_targets(state: Mapping[str, Any], trees: Mapping[str, Any] | None = None
                 ) -> Iterator[tuple[str, Any]]:
    """(leaf name, current tensor) pairs of the user's state, used to load in place."""
    trees = current_trees(state) if trees is None else trees
    objs: dict[str, Any] = {}
    for key, value in state.items():
        kind = LeafKind.PER_RANK if isinstance(value, PerRank) else LeafKind.REPLICATED
        _collect_tensors(trees[key], f"{kind}/{key}", objs)
    yield from objs.items()


def _collect_tensors(tree: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(tree, (torch.Tensor, np.ndarray, Sharded)):
        out[prefix] = tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            _collect_tensors(v, f"{prefix}/{escape_key(str(k))}", out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _collect_tensors(v, f"{prefix}/{i}", out)
