"""Collect and restore training state as named tensors plus a JSON skeleton (never pickle).

A *state* given to :class:`~coci_hpc.checkpoint.api.CheckpointManager` is a mapping whose values
are either *stateful* objects (``state_dict()`` / ``load_state_dict()``: a model, an optimizer, an
LR scheduler, an AMP ``GradScaler``, a :class:`~coci_hpc.checkpoint.data.ResumableSampler`) or
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

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from coci_hpc.errors import CheckpointCorrupt, CheckpointError

# torch dtype name -> (numpy dtype used for the stored bytes, torch dtype to view as on the way out).
# bfloat16 and bool have no exact numpy twin of the same meaning, so their bytes go out as uint.
_TORCH_DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "torch.float64": (np.dtype("<f8"), torch.float64),
    "torch.float32": (np.dtype("<f4"), torch.float32),
    "torch.float16": (np.dtype("<f2"), torch.float16),
    "torch.bfloat16": (np.dtype("<u2"), torch.int16),
    "torch.int64": (np.dtype("<i8"), torch.int64),
    "torch.int32": (np.dtype("<i4"), torch.int32),
    "torch.int16": (np.dtype("<i2"), torch.int16),
    "torch.int8": (np.dtype("i1"), torch.int8),
    "torch.uint8": (np.dtype("u1"), torch.uint8),
    "torch.bool": (np.dtype("u1"), torch.uint8),
}
_NUMPY_KINDS = "fiub"


@dataclass(frozen=True)
class PerRank:
    """Marks a state value as different on every rank (stored once per rank)."""

    value: Any


@dataclass
class Sharded:
    """A tensor split along dim 0 across ranks; ``local`` is this rank's rows, in rank order."""

    local: torch.Tensor


@dataclass(frozen=True)
class Leaf:
    """One tensor of a flattened tree: ``array`` is a contiguous CPU numpy view of its bytes."""

    name: str
    dtype: str          # "torch.float32" or "numpy.float32": how to give it back
    shape: tuple[int, ...]
    array: np.ndarray | None  # 1-D view in the storage dtype; shares memory with a CPU tensor.
    kind: str           # "replicated" | "per_rank" | "sharded"
    nbytes: int
    source: torch.Tensor | None = None  # a device tensor left for the two-phase save to copy


def storage_dtype(dtype: str) -> np.dtype:
    if dtype in _TORCH_DTYPES:
        return _TORCH_DTYPES[dtype][0]
    if isinstance(dtype, str) and dtype.startswith("numpy."):
        try:
            dt = np.dtype(dtype[len("numpy."):])
        except TypeError:
            dt = None
        # Only the numeric kinds that are ever saved: raw bytes read into an object (pointer)
        # array would be memory corruption, never a tensor.
        if dt is not None and dt.kind in _NUMPY_KINDS:
            return dt.newbyteorder("<")
    raise CheckpointError(f"unsupported tensor dtype {dtype!r} in checkpoint",
                          hint="supported: " + ", ".join(sorted(_TORCH_DTYPES)) + ", numpy numeric")


def _tensor_bytes(t: torch.Tensor) -> tuple[str, np.ndarray]:
    """A contiguous 1-D CPU numpy view (no copy for contiguous CPU tensors)."""
    name = str(t.dtype)
    if name not in _TORCH_DTYPES:
        raise CheckpointError(f"cannot checkpoint a tensor of dtype {t.dtype}",
                              hint="convert it to a supported dtype before saving")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    view_as = _TORCH_DTYPES[name][1]
    if t.dtype != view_as:
        t = t.view(view_as)
    return name, t.reshape(-1).numpy()


def _tensor_leaf(t: torch.Tensor, prefix: str, kind: str, defer_device: bool) -> Leaf:
    if defer_device and t.device.type != "cpu" and str(t.dtype) in _TORCH_DTYPES:
        return Leaf(prefix, str(t.dtype), tuple(t.shape), None, kind,
                    t.numel() * t.element_size(), t.detach())
    name, arr = _tensor_bytes(t)
    return Leaf(prefix, name, tuple(t.shape), arr, kind, int(arr.nbytes))


def _numpy_bytes(a: np.ndarray) -> tuple[str, np.ndarray]:
    if a.dtype.kind not in _NUMPY_KINDS:
        raise CheckpointError(f"cannot checkpoint a numpy array of dtype {a.dtype}",
                              hint="only numeric numpy arrays are stored; use JSON for the rest")
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return f"numpy.{a.dtype.newbyteorder('=').name}", a.reshape(-1)


def _escape(key: str) -> str:
    """A key as one HDF5 path component ("/" separates groups; "." and ".." are special)."""
    key = key.replace("%", "%25").replace("/", "%2F")
    return {"": "%00", ".": "%2E", "..": "%2E%2E"}.get(key, key)


def _json_leaf(x: Any, where: str) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, torch.dtype):
        return {"__torch_dtype__": str(x)}
    raise CheckpointError(f"cannot checkpoint {type(x).__name__} at {where!r} without pickle",
                          hint="checkpoint state must be tensors, numpy arrays and JSON values")


def flatten(tree: Any, prefix: str, kind: str, leaves: list[Leaf], defer_device: bool = False) -> Any:
    """Return the JSON skeleton of ``tree``; append its tensors to ``leaves`` as :class:`Leaf`.

    ``defer_device``: leave device (CUDA) tensors uncopied, for a pinned-buffer snapshot later.
    """
    if isinstance(tree, Sharded):
        leaves.append(_tensor_leaf(tree.local, prefix, "sharded", defer_device))
        return {"__tensor__": prefix}
    if isinstance(tree, torch.Tensor):
        leaves.append(_tensor_leaf(tree, prefix, kind, defer_device))
        return {"__tensor__": prefix}
    if isinstance(tree, np.ndarray):
        name, arr = _numpy_bytes(tree)
        leaves.append(Leaf(prefix, name, tuple(tree.shape), arr, kind, int(arr.nbytes)))
        return {"__tensor__": prefix}
    if isinstance(tree, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in tree):
            return {k: flatten(v, f"{prefix}/{_escape(k)}", kind, leaves, defer_device)
                    for k, v in tree.items()}
        return {"__dict__": [[_json_leaf(k, prefix),
                              flatten(v, f"{prefix}/{_escape(str(k))}", kind, leaves, defer_device)]
                             for k, v in tree.items()]}
    if isinstance(tree, tuple):
        return {"__tuple__": [flatten(v, f"{prefix}/{i}", kind, leaves, defer_device)
                              for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [flatten(v, f"{prefix}/{i}", kind, leaves, defer_device) for i, v in enumerate(tree)]
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
        t = torch.empty(shape, dtype=getattr(torch, dtype.split(".", 1)[1]))
        return t, _tensor_bytes(t)[1]
    a = np.empty(shape, dtype=storage_dtype(dtype))
    return a, a.reshape(-1)


def leaf_view(obj: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """A writable 1-D view of an existing tensor/array if it can receive the stored leaf in place."""
    if isinstance(obj, Sharded):
        obj = obj.local
    if isinstance(obj, torch.Tensor):
        if (obj.device.type != "cpu" or str(obj.dtype) != dtype or tuple(obj.shape) != tuple(shape)
                or not obj.is_contiguous()):
            return None
        return _tensor_bytes(obj)[1]
    if isinstance(obj, np.ndarray):
        if (f"numpy.{obj.dtype.newbyteorder('=').name}" != dtype or tuple(obj.shape) != tuple(shape)
                or not obj.flags.c_contiguous or not obj.flags.writeable or obj.dtype.byteorder == ">"):
            return None
        return obj.reshape(-1)
    return None


# ---------------------------------------------------------------------------------- RNG
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


# ------------------------------------------------------------------------ collecting state
def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def collect(state: Mapping[str, Any], *, rng: bool = True, defer_device: bool = False
            ) -> tuple[dict[str, Any], list[Leaf]]:
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
        tree = value.state_dict() if is_stateful(value) else value
        target[key] = flatten(tree, f"{kind}/{key}", kind, leaves, defer_device)
    if rng:
        per_rank["__rng__"] = flatten(capture_rng(), "per_rank/__rng__", "per_rank", leaves)
    return {"replicated": repl, "per_rank": per_rank}, leaves


def iter_targets(state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(leaf name, current tensor) pairs of the user's state, used to load in place."""
    objs: dict[str, Any] = {}
    for key, value in state.items():
        kind = "per_rank" if isinstance(value, PerRank) else "replicated"
        value = value.value if isinstance(value, PerRank) else value
        tree = value.state_dict() if is_stateful(value) else value
        _collect_tensors(tree, f"{kind}/{key}", objs)
    yield from objs.items()


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
          *, rng: bool = True) -> list[str]:
    """Restore loaded trees into the user's state in place; return the keys that were missing."""
    missing: list[str] = []
    for key, value in state.items():
        section = "per_rank" if isinstance(value, PerRank) else "replicated"
        inner = value.value if isinstance(value, PerRank) else value
        skel = skeletons.get(section, {})
        if key not in skel:
            missing.append(key)
            continue
        tree = unflatten(skel[key], tensors)
        if is_stateful(inner):
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
        else:
            raise CheckpointError(f"cannot restore state key {key!r} of type {type(inner).__name__} in place",
                                  hint="pass a dict, a list, a tensor or an object with load_state_dict")
    if rng:
        if "__rng__" in skeletons.get("per_rank", {}):
            restore_rng(unflatten(skeletons["per_rank"]["__rng__"], tensors))
        else:
            missing.append("__rng__")
    return missing


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
