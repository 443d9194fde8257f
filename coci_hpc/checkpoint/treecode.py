"""A tree of state as named tensors plus a JSON skeleton, and back (never pickle).

:func:`flatten` turns a tree into ``(skeleton, leaves)``: the skeleton is JSON where every
tensor became ``{"__tensor__": name}``; non-string dict keys (optimizer state uses ints) and
tuples are encoded so the tree comes back with the same types (:func:`unflatten`). Each tensor
becomes a :class:`Leaf`, a contiguous host view of its bytes in the storage dtype
(:mod:`.leaves`); :func:`empty_like_leaf` and :func:`leaf_view` give the buffers a load reads into.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint.devices import on_host
from coci_hpc.checkpoint.dtensor import check_plain, is_dtensor, local_box, local_of
from coci_hpc.checkpoint.leaves import NUMPY_KINDS, LeafKind, Sharded, escape_key, storage_dtype, torch_dtypes
from coci_hpc.errors import CheckpointCorrupt, CheckpointError

_TORCH_DTYPES = torch_dtypes()


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
    check_plain(t, prefix)
    box = local_box(t, prefix)
    local = local_of(t)
    deferrable = local.numel() > 0 and local.data_ptr() in guarded
    if defer_device and not on_host(local) and str(local.dtype) in _TORCH_DTYPES:
        return Leaf(prefix, str(local.dtype), tuple(t.shape), None, LeafKind.DTENSOR,
                    local.numel() * local.element_size(), local.detach(), deferrable, box)
    name, arr = _tensor_bytes(local)
    return Leaf(prefix, name, tuple(t.shape), arr, LeafKind.DTENSOR, int(arr.nbytes), None, deferrable, box)


def _numpy_bytes(a: np.ndarray) -> tuple[str, np.ndarray]:
    if a.dtype.kind not in NUMPY_KINDS:
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
        leaves.append(_tensor_leaf(tree.local, prefix, LeafKind.SHARDED, defer_device, guarded))
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
            return {k: flatten(v, f"{prefix}/{escape_key(k)}", kind, leaves, defer_device, guarded)
                    for k, v in tree.items()}
        return {"__dict__": [[_json_leaf(k, prefix),
                              flatten(v, f"{prefix}/{escape_key(str(k))}", kind, leaves, defer_device, guarded)]
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
