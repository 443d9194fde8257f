"""Collect and restore training state as named tensors plus a JSON skeleton (never pickle).

A *state* given to :class:`~coci_hpc.checkpoint.api.CheckpointManager` is a mapping whose values
are either *stateful* objects (``state_dict()`` / ``load_state_dict()``: a model, an optimizer, an
LR scheduler, an AMP ``GradScaler``, a :class:`~coci_hpc.runtime.data.ResumableSampler`) or
plain trees of dicts/lists/tuples with JSON leaves and tensors (the training step, the planner
state, user extras). Values are *replicated* by default (identical on every data-parallel rank);
wrap a value in :class:`PerRank` for state that differs per rank, and a tensor in :class:`Sharded`
for a tensor split along dim 0 across ranks (it is stored whole and re-split on load).
RNG states (python ``random``, numpy, torch CPU, CUDA when present) are always per rank.

:func:`flatten` turns a tree into ``(skeleton, leaves)``: the skeleton is JSON where every
tensor became ``{"__tensor__": name}``; non-string dict keys (optimizer state uses ints) and
tuples are encoded so the tree comes back with the same types.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint.devices import on_host
from coci_hpc.checkpoint.dtensor import check_plain, is_dtensor, local_box, local_of
from coci_hpc.checkpoint.layout import FROM_RANK0
from coci_hpc.checkpoint.leaves import NUMPY_KINDS, PerRank, Sharded, escape_key, storage_dtype, torch_dtypes
from coci_hpc.checkpoint.optim_names import is_fqn_keyed, param_names, to_fqn, to_index
from coci_hpc.checkpoint.rng import capture_rng, restore_rng
from coci_hpc.checkpoint.unsupported import check_value
from coci_hpc.errors import CheckpointCorrupt, CheckpointError

# The wrapper types, leaf kinds, dtype encoding and key escaping live in .leaves (so that dtensor,
# layout and optim_names need not import this module back); the old names stay importable here.
_TORCH_DTYPES = torch_dtypes()
_NUMPY_KINDS = NUMPY_KINDS
_escape = escape_key


@dataclass(frozen=True)
class Leaf:
    """One tensor of a flattened tree: ``array`` is a contiguous CPU numpy view of its bytes."""

    name: str
    dtype: str          # "torch.float32" or "numpy.float32": how to give it back
    shape: tuple[int, ...]
    array: np.ndarray | None  # 1-D view in the storage dtype; shares memory with a CPU tensor.
    kind: str           # a LeafKind value: "replicated" | "from_rank0" | "per_rank" | "sharded" | "dtensor"
    nbytes: int
    source: torch.Tensor | None = None  # a device tensor left for the two-phase save to copy
    # Only the optimizer step changes it (a parameter or the state of an optimizer whose step
    # waits for the snapshot), so the two-phase save may copy it in the background.
    deferrable: bool = False
    # A DTensor leaf (kind "dtensor"): this rank's box of the global tensor, (global offsets,
    # local shape); ``shape`` is the global shape, ``array``/``nbytes`` the local part's.
    box: tuple[Any, ...] = ()


def _tensor_bytes(t: torch.Tensor) -> tuple[str, np.ndarray]:
    """A contiguous 1-D CPU numpy view (no copy for contiguous CPU tensors)."""
    name = str(t.dtype)
    if name not in _TORCH_DTYPES:
        raise CheckpointError(f"cannot checkpoint a tensor of dtype {t.dtype}",
                              hint="convert it to a supported dtype before saving")
    t = t.detach()
    if not on_host(t):
        t = t.cpu()  # a blocking copy to new host memory: the bytes are there when it returns
    t = t.contiguous()
    view_as = _TORCH_DTYPES[name][1]
    if t.dtype != view_as:
        t = t.view(view_as)
    return name, t.reshape(-1).numpy()


def _tensor_leaf(t: torch.Tensor, prefix: str, kind: str, defer_device: bool,
                 guarded: frozenset[int] = frozenset()) -> Leaf:
    if is_dtensor(t):
        return _dtensor_leaf(t, prefix, defer_device, guarded)
    check_plain(t, prefix)
    deferrable = t.numel() > 0 and t.data_ptr() in guarded
    if defer_device and not on_host(t) and str(t.dtype) in _TORCH_DTYPES:
        return Leaf(prefix, str(t.dtype), tuple(t.shape), None, kind,
                    t.numel() * t.element_size(), t.detach(), deferrable)
    name, arr = _tensor_bytes(t)
    return Leaf(prefix, name, tuple(t.shape), arr, kind, int(arr.nbytes), None, deferrable)


def _dtensor_leaf(t: Any, prefix: str, defer_device: bool, guarded: frozenset[int]) -> Leaf:
    """One global dataset, of which this rank holds (and may write) its box."""
    box = local_box(t, prefix)
    local = local_of(t)
    deferrable = local.numel() > 0 and local.data_ptr() in guarded
    if defer_device and not on_host(local) and str(local.dtype) in _TORCH_DTYPES:
        return Leaf(prefix, str(local.dtype), tuple(t.shape), None, "dtensor",
                    local.numel() * local.element_size(), local.detach(), deferrable, box)
    name, arr = _tensor_bytes(local)
    return Leaf(prefix, name, tuple(t.shape), arr, "dtensor", int(arr.nbytes), None, deferrable, box)


def _numpy_bytes(a: np.ndarray) -> tuple[str, np.ndarray]:
    if a.dtype.kind not in _NUMPY_KINDS:
        raise CheckpointError(f"cannot checkpoint a numpy array of dtype {a.dtype}",
                              hint="only numeric numpy arrays are stored; use JSON for the rest")
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return f"numpy.{a.dtype.newbyteorder('=').name}", a.reshape(-1)


def _json_leaf(x: Any, where: str) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, torch.dtype):
        return {"__torch_dtype__": str(x)}
    raise CheckpointError(f"cannot checkpoint {type(x).__name__} at {where!r} without pickle",
                          hint="checkpoint state must be tensors, numpy arrays and JSON values")


def flatten(tree: Any, prefix: str, kind: str, leaves: list[Leaf], defer_device: bool = False,
            guarded: frozenset[int] = frozenset()) -> Any:
    """Return the JSON skeleton of ``tree``; append its tensors to ``leaves`` as :class:`Leaf`.

    ``defer_device``: leave device (CUDA) tensors uncopied, for a pinned-buffer snapshot later.
    ``guarded``: data pointers of tensors only an optimizer step changes (see :func:`guarded_ptrs`).
    """
    if isinstance(tree, Sharded):
        leaves.append(_tensor_leaf(tree.local, prefix, "sharded", defer_device, guarded))
        return {"__tensor__": prefix}
    if isinstance(tree, torch.Tensor):
        leaves.append(_tensor_leaf(tree, prefix, kind, defer_device, guarded))
        return {"__tensor__": prefix}
    if isinstance(tree, np.ndarray):
        name, arr = _numpy_bytes(tree)
        leaves.append(Leaf(prefix, name, tuple(tree.shape), arr, kind, int(arr.nbytes)))
        return {"__tensor__": prefix}
    if isinstance(tree, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in tree):
            return {k: flatten(v, f"{prefix}/{_escape(k)}", kind, leaves, defer_device, guarded)
                    for k, v in tree.items()}
        return {"__dict__": [[_json_leaf(k, prefix),
                              flatten(v, f"{prefix}/{_escape(str(k))}", kind, leaves, defer_device, guarded)]
                             for k, v in tree.items()]}
    if isinstance(tree, tuple):
        return {"__tuple__": [flatten(v, f"{prefix}/{i}", kind, leaves, defer_device, guarded)
                              for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [flatten(v, f"{prefix}/{i}", kind, leaves, defer_device, guarded)
                for i, v in enumerate(tree)]
    return _json_leaf(tree, prefix)


def unflatten(skeleton: Any, tensors: Mapping[str, Any]) -> Any:
    """Inverse of :func:`flatten`; ``tensors`` maps leaf names to the loaded tensors/arrays."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton and len(skeleton) == 1:
            if skeleton["__tensor__"] not in tensors:
                raise CheckpointCorrupt(f"the manifest names tensor {skeleton['__tensor__']!r} but "
                                        f"lists no dataset for it",
                                        hint="the manifest was edited or damaged; load an older step")
            return tensors[skeleton["__tensor__"]]
        if "__dict__" in skeleton and len(skeleton) == 1:
            return {_unjson_key(k): unflatten(v, tensors) for k, v in skeleton["__dict__"]}
        if "__tuple__" in skeleton and len(skeleton) == 1:
            return tuple(unflatten(v, tensors) for v in skeleton["__tuple__"])
        if "__torch_dtype__" in skeleton and len(skeleton) == 1:
            return _torch_dtype(skeleton["__torch_dtype__"])
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


def _unjson_key(k: Any) -> Any:
    if isinstance(k, dict) and "__torch_dtype__" in k:
        return _torch_dtype(k["__torch_dtype__"])
    return k


def _torch_dtype(name: Any) -> torch.dtype:
    """The torch dtype saved as ``"torch.float32"``; anything else in a manifest is refused."""
    attr = name.split(".", 1)[1] if isinstance(name, str) and name.startswith("torch.") else None
    dt = getattr(torch, attr, None) if attr else None
    if not isinstance(dt, torch.dtype):
        raise CheckpointCorrupt(f"the manifest holds {name!r} where a torch dtype belongs",
                                hint="the manifest was edited or damaged; load an older step")
    return dt


def empty_like_leaf(dtype: str, shape: tuple[int, ...]) -> tuple[Any, np.ndarray]:
    """A fresh tensor/array for a stored leaf and a 1-D byte-compatible numpy view to read into."""
    if dtype in _TORCH_DTYPES:
        # host memory, uninitialised: hand it to torch (from_local, load_state_dict) only once filled
        t = torch.empty(shape, dtype=getattr(torch, dtype.split(".", 1)[1]))
        return t, _tensor_bytes(t)[1]
    a = np.empty(shape, dtype=storage_dtype(dtype))
    return a, a.reshape(-1)


def leaf_view(obj: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """A writable 1-D view of an existing tensor/array if it can receive the stored leaf in place."""
    if isinstance(obj, Sharded):
        obj = obj.local
    if is_dtensor(obj):
        obj = local_of(obj)
    if isinstance(obj, torch.Tensor):
        # a device tensor is never read into in place: its bytes go through a filled host buffer
        if (not on_host(obj) or str(obj.dtype) != dtype or tuple(obj.shape) != tuple(shape)
                or not obj.is_contiguous()):
            return None
        return _tensor_bytes(obj)[1]
    if isinstance(obj, np.ndarray):
        if (f"numpy.{obj.dtype.newbyteorder('=').name}" != dtype or tuple(obj.shape) != tuple(shape)
                or not obj.flags.c_contiguous or not obj.flags.writeable or obj.dtype.byteorder == ">"):
            return None
        return obj.reshape(-1)
    return None


# ------------------------------------------------------------------------ collecting state
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


def collect(state: Mapping[str, Any], *, rng: bool = True, defer_device: bool = False,
            guarded: frozenset[int] = frozenset()) -> tuple[dict[str, Any], list[Leaf]]:
    """Flatten a user state into ``({"replicated":..., "per_rank":...} skeletons, leaves)``."""
    leaves: list[Leaf] = []
    repl: dict[str, Any] = {}
    per_rank: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not key or "/" in key or key == "__rng__":
            raise CheckpointError(f"state key {key!r} is not a plain name",
                                  hint="use short string keys such as 'model' or 'optimizer'")
        target, kind, value = (per_rank, "per_rank", value.value) if isinstance(value, PerRank) \
            else (repl, "replicated", value)
        check_value(key, value)
        tree = _tree_of(state, value)
        first = len(leaves)
        target[key] = flatten(tree, f"{kind}/{key}", kind, leaves, defer_device, guarded)
        if kind == "replicated" and isinstance(value, torch.nn.Module):
            _buffers_from_rank0(value, f"{kind}/{key}", leaves, first)
    if rng:
        per_rank["__rng__"] = flatten(capture_rng(), "per_rank/__rng__", "per_rank", leaves)
    return {"replicated": repl, "per_rank": per_rank}, leaves


def _buffers_from_rank0(module: torch.nn.Module, prefix: str, leaves: list[Leaf], first: int) -> None:
    """Mark the leaves ``leaves[first:]`` of ``module``'s buffers as FROM_RANK0: replicated, with
    rank 0's value the authoritative one, written by rank 0 alone (:mod:`.layout`). Ranks may hold
    different values there (BatchNorm running statistics come from each rank's own batch) and DDP
    broadcasts rank 0's at the next forward (``broadcast_buffers``), so rank 0's are the ones the
    uninterrupted run goes on with. Every other replicated leaf must be equal on all ranks
    (checked: :mod:`.replicas`)."""
    names = {f"{prefix}/{_escape(n)}" for n, _ in module.named_buffers(remove_duplicate=False)}
    if not names:
        return
    for i in range(first, len(leaves)):
        if leaves[i].name in names:
            leaves[i] = replace(leaves[i], kind=FROM_RANK0)


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
    """The tree a state value is saved as: ``state_dict()`` of a stateful object, keyed by
    parameter names for an optimizer whose model is in the state (:mod:`.optim_names`)."""
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


def match_saved_keys(state: Mapping[str, Any], skeletons: Mapping[str, Any], trees: dict[str, Any],
                     targets: dict[str, Any]) -> None:
    """An optimizer saved index-keyed (before optimizer state was keyed by name, or without its
    model) is loaded index-keyed: its current tree and in-place targets go back to positions.
    ``skeletons``: this rank's {"replicated": ..., "per_rank": ...} saved skeletons."""
    for key, value in state.items():
        section = "per_rank" if isinstance(value, PerRank) else "replicated"
        inner = value.value if isinstance(value, PerRank) else value
        saved = skeletons.get(section, {}).get(key)
        if not isinstance(inner, torch.optim.Optimizer) or saved is None or not is_fqn_keyed(trees[key]):
            continue
        if is_fqn_keyed(unflatten(saved, _AnyTensor())):
            continue
        trees[key] = to_index(trees[key], inner, param_names(state, inner), key)
        prefix = f"{section}/{key}/"
        for name in [n for n in targets if n.startswith(prefix)]:
            del targets[name]
        _collect_tensors(trees[key], f"{section}/{key}", targets)


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
        kind = "per_rank" if isinstance(value, PerRank) else "replicated"
        _collect_tensors(trees[key], f"{kind}/{key}", objs)
    yield from objs.items()


class _AnyTensor(Mapping):
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
    saved = unflatten(skeleton, _AnyTensor())
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


def _collect_tensors(tree: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(tree, (torch.Tensor, np.ndarray, Sharded)):
        out[prefix] = tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            _collect_tensors(v, f"{prefix}/{_escape(str(k))}", out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _collect_tensors(v, f"{prefix}/{i}", out)


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
        section = "per_rank" if isinstance(value, PerRank) else "replicated"
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
    if rng and "__rng__" in skeletons.get("per_rank", {}):
        rng_tree = unflatten(skeletons["per_rank"]["__rng__"], tensors)
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
        if is_stateful(inner):
            if not _loaded_in_place(inner, tree, in_place):
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


def _loaded_in_place(module: torch.nn.Module, tree: Any, in_place: frozenset[int]) -> bool:
    """True when ``tree`` holds only tensors already written into ``module``'s own storage, so
    ``load_state_dict`` would copy each onto itself (for FSDP2 a DTensor dispatch and a memcpy
    per parameter: a tenth of a same-mesh load in the issue-23 profile). Any hook of the user's
    (or extra state) keeps the ordinary path."""
    if not in_place or not isinstance(tree, Mapping) or not tree:
        return False
    if not all(isinstance(v, torch.Tensor) and id(v) in in_place for v in tree.values()):
        return False
    for m in module.modules():
        hooks = list(m._load_state_dict_pre_hooks.values()) + list(m._load_state_dict_post_hooks.values())
        if any(not _known_hook(h) for h in hooks) or \
                type(m).get_extra_state is not torch.nn.Module.get_extra_state:
            return False
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
