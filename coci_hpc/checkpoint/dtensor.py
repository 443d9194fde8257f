"""DTensor state (FSDP2, tensor parallel, HSDP): boxes of one global dataset per tensor.

A ``torch.distributed.tensor.DTensor`` leaf is stored as ONE dataset of its global shape, named
like any other leaf, so h5py users and exporters read it whole. Each rank holds a *box* of it
(global offsets + local shape, from its placements on the device mesh: ``Shard(d)`` on any dim,
``Replicate()``, uneven FSDP2 chunks included). Saving: each distinct box is written once, by the
one of the ranks holding it that has been given the fewest bytes so far, so the writing of
replicated boxes (HSDP) spreads over the replicas (:func:`plan`). A box of a row-major tensor is a set of contiguous byte runs (one for
``Shard(0)``); :func:`runs` expands it, coalesced, for the byte-range writer and reader. The
manifest records the boxes compactly (``"boxes"``: [writer rank, offsets, shape]) beside the
per-run CRCs.

Loading: the *target's* tensor decides what is read. A DTensor target reads exactly the runs of
its new box (any world size, any mesh, any placement); a plain tensor reads the whole dataset;
a DTensor target also reads its box out of a plain (replicated or ``Sharded``) checkpoint.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from coci_hpc.errors import CheckpointError, UsageError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, local shape)

# torch.distributed.tensor is imported only where a DTensor is in hand: it cost 0.7 s of each import
# of coci_hpc.session (2.2 s). torch imports it too once an optimizer is built (Optimizer.add_param_group
# imports torch._dynamo, which imports FSDP), so what this saves is the import of coci_hpc itself.
_DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing torch.distributed.tensor: a DTensor can exist only
    once its module has been imported (by whoever made it), so a module not yet loaded means no."""
    mod = sys.modules.get(_DTENSOR_MODULE)
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


def check_plain(t: torch.Tensor, name: str) -> None:
    """Refuse tensor subclasses the store does not know (their bytes are not the tensor's), and
    tensors whose values are not a dense block of memory (sparse, nested, on the meta device)."""
    if type(t) in _PLAIN:
        # three attribute reads (~0.2 us): every save asks this of every leaf
        if t.is_meta or t.is_nested or t.layout is not torch.strided:
            refuse_meta(t, name, "to save")
            what = "a nested tensor" if t.is_nested else f"a {t.layout} tensor"
            raise UsageError(f"tensor {name!r} is {what}: the checkpoint store saves dense tensors only",
                             hint="save its dense form (t.to_dense()) or its parts (indices and values, "
                                  "or the nested tensor's unbind()) as plain tensors")
        return
    if is_dtensor(t):
        refuse_meta(t, name, "to save")
        return
    raise UsageError(f"tensor {name!r} is a {type(t).__module__}.{type(t).__qualname__}, a tensor "
                     f"subclass the checkpoint store does not know how to save",
                     hint="save plain tensors or DTensors (FSDP2 fully_shard, parallelize_module); "
                          "convert this one first (e.g. with .full_tensor() or a plain copy)")


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def refuse_meta(t: Any, name: str, doing: str) -> None:
    """UsageError if ``t`` (or a DTensor's local shard) is on the meta device: a model built there
    (the FSDP2 recipe: build on meta, shard, then ``to_empty``) has shapes but no memory yet."""
    if type(t) in _PLAIN and not t.is_meta:
        return
    local = local_of(t) if is_dtensor(t) else t
    if isinstance(local, torch.Tensor) and local.is_meta:
        mesh = f" (its device mesh: {t.device_mesh.device_type!r})" if is_dtensor(t) else ""
        raise UsageError(f"tensor {name!r} is on the meta device{mesh}: it has a shape but no memory {doing}",
                         hint="materialise the model first (model.to_empty(device=...), then initialise "
                              "or load it), or leave the tensor out of the state")


# (global shape, mesh, coordinate, placements) -> this rank's (local shape, global offset): torch's
# computation costs ~0.05 ms per tensor and every save and load asks it again for every DTensor
# leaf (2026-11-29: 48 leaves, 2.5 ms of an async save's blocking start, issue 33).
_LOCAL_BOXES: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def local_box(dt: Any, name: str) -> Box:
    """This rank's box of ``dt`` after checking its placements and mesh."""
    import torch.distributed as dist
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in dt.placements:
        if isinstance(p, Partial):
            raise UsageError(f"DTensor {name!r} has a Partial placement {dt.placements}: its local "
                             f"values are unreduced partial sums, not the tensor",
                             hint="redistribute it to Shard/Replicate placements (dt.redistribute("
                                  "placements=[Replicate()]) or finish the reduction) before saving")
        if not isinstance(p, (Shard, Replicate)):
            raise UsageError(f"DTensor {name!r} has placement {p!r}, which the checkpoint store "
                             f"does not know", hint="use Shard(d) or Replicate() placements")
    mesh = dt.device_mesh
    local_device = local_of(dt).device
    if local_device.type != mesh.device_type:
        # e.g. part of an FSDP2 model moved to the CPU after fully_shard on a CUDA mesh: the ranks'
        # shards of one tensor on different devices; refused before anything is written or read
        raise CheckpointError(f"DTensor {name!r} holds its local shard on {local_device} but lives on a "
                              f"{mesh.device_type!r} device mesh: one tensor's shards on different devices",
                              hint=f"keep every shard on the mesh's device: move the model before sharding it, "
                                   f"or the shard back (model.to({mesh.device_type!r})), then save or load")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.size() != world or mesh.get_coordinate() is None:
        raise UsageError(f"DTensor {name!r} lives on a device mesh of {mesh.size()} rank(s) "
                         f"({mesh.mesh.flatten().tolist()}) but the job has {world}: the store saves "
                         f"state of the whole communicator",
                         hint="put the DTensor state on a mesh that covers every rank (init_device_mesh "
                              "over the whole world), or save it as PerRank(...) state")
    # the coordinate too: this rank's box, whatever a mesh's equality compares (ranks as threads)
    key = (tuple(dt.shape), mesh, tuple(mesh.get_coordinate() or ()), tuple(dt.placements))
    got = _LOCAL_BOXES.get(key)
    if got is None:
        if len(_LOCAL_BOXES) >= 4096:
            _LOCAL_BOXES.clear()
        got = _LOCAL_BOXES[key] = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    shape, offset = got
    local = tuple(local_of(dt).shape)  # to_local() is an autograd op: 0.05 ms a tensor
    if tuple(shape) != local:
        raise UsageError(f"DTensor {name!r} holds a local tensor of shape {list(local)} where its "
                         f"placements {dt.placements} give {list(shape)}",
                         hint="DTensors with hand-made uneven local shapes are not supported; use the "
                              "layout torch's own sharding makes")
    return tuple(int(x) for x in offset), tuple(int(x) for x in shape)


def runs(global_shape: Sequence[int], box: Box, itemsize: int) -> list[tuple[int, int, int]]:
    """The byte runs of ``box`` inside a row-major tensor: (dataset byte, local byte, bytes),
    coalesced (a box spanning whole trailing dims is one run per leading index)."""
    offs, shape = box
    n = len(global_shape)
    if n == 0:
        return [(0, 0, itemsize)]
    if math.prod(shape) == 0:
        return []
    strides = [itemsize] * n
    for d in range(n - 2, -1, -1):
        strides[d] = strides[d + 1] * int(global_shape[d + 1])
    k = n - 1  # first dim of the contiguous run: trailing dims the box spans wholly join it
    while k > 0 and shape[k] == global_shape[k]:
        k -= 1
    length = shape[k] * strides[k]
    base = sum(o * s for o, s in zip(offs, strides))
    if k == 0:
        return [(base, 0, length)]
    grid = np.indices(shape[:k], dtype=np.int64).reshape(k, -1)
    starts = base + (grid * np.asarray(strides[:k], dtype=np.int64)[:, None]).sum(axis=0)
    return [(int(s), i * length, length) for i, s in enumerate(starts.tolist())]


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))


def plan(name: str, descs: Sequence[Any], written: dict[int, int], itemsize: int) -> list[tuple[int, Box]]:
    """Who writes what of one DTensor leaf: [(writer rank, box)] (each distinct non-empty box
    once), after checking the ranks' boxes tile the global tensor. ``descs[r]`` is rank r's
    description. A box held by several ranks (replicas) goes to the one of them that has been
    given the fewest bytes so far (``written``, updated), so the writing spreads over replicas."""
    base = descs[0]
    holders: dict[Box, list[int]] = {}
    for r, d in enumerate(descs):
        if d is None:
            raise CheckpointError(f"DTensor {name!r} is missing on rank {r}",
                                  hint="every rank must hold the same DTensor state (a mesh over all ranks)")
        if d.dtype != base.dtype or tuple(d.shape) != tuple(base.shape):
            raise CheckpointError(f"DTensor {name!r} is {d.dtype} {list(d.shape)} on rank {r} but "
                                  f"{base.dtype} {list(base.shape)} on rank 0",
                                  hint="every rank must hold the same DTensor state")
        box: Box = (tuple(d.box[0]), tuple(d.box[1]))
        if math.prod(box[1]) or not box[1]:
            holders.setdefault(box, []).append(r)
    boxes = list(holders)
    total = sum(math.prod(b[1]) for b in boxes)
    tiles = total == math.prod(base.shape) and all(
        not _overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    if not tiles:
        raise CheckpointError(f"the ranks' parts of DTensor {name!r} do not cover its global shape "
                              f"{list(base.shape)} exactly once", hint="the DTensor's device mesh must "
                              "span every rank of the communicator, with Shard/Replicate placements")
    out = []
    for box in boxes:
        r = min(holders[box], key=lambda q: written.get(q, 0))  # ties: the first replica
        written[r] = written.get(r, 0) + math.prod(box[1]) * itemsize
        out.append((r, box))
    return out


# ------------------------------------------------------------------------------------ load
def target_box(t: Any, name: str) -> Box:
    return local_box(t, name)


def local_of(t: Any) -> torch.Tensor:
    """The local tensor of a DTensor (sharing its storage)."""
    return t._local_tensor  # to_local() is an autograd op; the storage is what is loaded into


def wrap_like(target: Any, local: torch.Tensor, name: str = "") -> Any:
    """A DTensor with ``target``'s mesh, placements and global shape around ``local``.

    Onto a mesh of another device (a host buffer onto CUDA) ``from_local`` copies ``local`` to
    that device now: where the device has too little free memory for it, a CheckpointError
    names the tensor (``name``) and its bytes. Callers wrap before anything of the state changes.
    """
    from torch.distributed.tensor import DTensor

    try:
        return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                                  shape=target.shape, stride=target.stride())
    except torch.OutOfMemoryError as exc:
        raise CheckpointError(
            f"not enough memory on the device {target.device_mesh.device_type!r} for the loaded shard of "
            f"{name or 'a DTensor'!r} ({local.untyped_storage().nbytes()} bytes): {exc}",
            hint="free device memory before loading (load before the first training step, "
                 "torch.cuda.empty_cache()) or load on more ranks; nothing of the state was changed") from None


def optimizer_targets(state: Mapping[str, Any], tensors: Sequence[Mapping[str, Any]],
                      targets: dict[str, Any]) -> set[str]:
    """Give a fresh optimizer (no state tensors yet) a DTensor target, with its parameter's
    mesh and placements, for each saved state tensor of the parameter's global shape; returns
    the names of the targets made.

    They are no part of the user's state until the load hands them over, so that load (and it
    alone) may fill their memory before every check passed. Once handed over they are the
    optimizer's live moments like any other: the set is the calling load's, never kept (a
    registry that outlived the load made a later load into the same optimizer fill its live
    moments during the check, before it was known to pass).

    Without it a fresh FSDP2 optimizer would get full plain moments beside sharded parameters.
    DCP initialises the optimizer state instead (``_init_optim_state``: a step with zero grads),
    which changes the optimizer before the load is known to succeed; here nothing of the
    optimizer is touched until every check passed (all or nothing), and only the bytes of this
    rank's box are read.
    """
    from coci_hpc.checkpoint.leaves import LeafKind, PerRank, escape_key
    from coci_hpc.checkpoint.optim_names import param_names

    made: set[str] = set()
    for key, value in state.items():
        inner = value.value if isinstance(value, PerRank) else value
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        section = LeafKind.PER_RANK.value if isinstance(value, PerRank) else LeafKind.REPLICATED.value
        params = [p for g in inner.param_groups for p in g["params"]]
        # saved keyed by parameter name (.optim_names) or, older, by position
        names = param_names(state, inner)
        by_name = {escape_key(n): params[i] for i, n in enumerate(names)} if names is not None else {}
        prefix = f"{section}/{key}/state/"
        for meta in tensors:
            name = meta["name"]
            if name in targets or not name.startswith(prefix):
                continue
            idx, _, rest = name[len(prefix):].rpartition("/")
            if not idx or "/" in idx:
                continue
            if idx in by_name:
                p = by_name[idx]
            elif idx.isdigit() and int(idx) < len(params):
                p = params[int(idx)]
            else:
                continue
            if is_dtensor(p) and list(p.shape) == list(meta["shape"]) and p not in inner.state:
                dtype = getattr(torch, str(meta["dtype"]).split(".", 1)[1], None) \
                    if str(meta["dtype"]).startswith("torch.") else None
                if isinstance(dtype, torch.dtype):
                    # on the parameter's own device: from_local shares it (no copy); never read
                    # into in place (a device tensor): the load fills a host buffer and wraps that
                    targets[name] = wrap_like(p, torch.empty_like(local_of(p), dtype=dtype), name)
                    made.add(name)
    return made
