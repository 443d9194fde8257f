"""The load: every rank checks a committed step against its state, then copies it in.

(The save is :mod:`.transaction`; choosing the step to load, and falling back from a damaged
one, is :mod:`.recovery`'s.)
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import devices
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.dtensor import (
    is_dtensor,
    local_of,
    optimizer_targets,
    refuse_meta,
    runs,
    target_box,
    wrap_like,
)
from coci_hpc.checkpoint.h5read import DatasetReader, ScratchCopies
from coci_hpc.checkpoint.leaves import LeafKind, PerRank, Sharded, storage_dtype
from coci_hpc.checkpoint.loadcheck import check_skeleton
from coci_hpc.checkpoint.rawio import copy_pool, copy_threads, prefault
from coci_hpc.checkpoint.restore import apply
from coci_hpc.checkpoint.staging import DeviceRuns, DeviceStager
from coci_hpc.checkpoint.state import (
    _collect_tensors,
    current_trees,
    is_stateful,
    iter_targets,
    live_trees,
    match_saved_keys,
    saved_keys,
    with_generators,
)
from coci_hpc.checkpoint.treecode import empty_like_leaf, leaf_view
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError


# ------------------------------------------------------------------------------------ load
@dataclass(frozen=True)
class LoadResult:
    step: int
    saved_world_size: int
    missing: tuple[str, ...]   # state keys (or "__rng__") the checkpoint had nothing for
    manifest: dict[str, Any] = field(repr=False)   # thousands of lines for a real model: not in repr
    # bytes this rank copied into its own state (a DTensor: only its new box), beyond the
    # checks it shares with the other ranks of its node
    read_bytes: int = 0

    def __repr__(self) -> str:
        n = len(self.manifest.get("tensors") or ())
        return (f"LoadResult(step={self.step}, saved_world_size={self.saved_world_size}, "
                f"missing={self.missing!r}, manifest=<{n} tensor(s)>)")


def load(comm: Comm, root: Path, step: int, state: Mapping[str, Any], *, rng: bool = True,
         stats: dict[str, float] | None = None) -> LoadResult:
    """Collective: every rank loads ``step`` into ``state`` in place (choosing the step, and
    falling back from a damaged one, is :mod:`.recovery`'s).

    Everything is checked (manifest, datasets, shapes and dtypes against ``state``, the saved
    trees against the objects they go into, the CRC of every byte) on every rank before the
    first byte goes into ``state``; objects whose ``load_state_dict`` refuses are rolled back
    (:func:`~coci_hpc.checkpoint.restore.apply`). A failed load leaves the state as it was.

    ``stats`` receives this rank's time in each phase (issue 33: a slow load names its phase):
    ``targets_s`` (the state's trees and targets), ``open_s`` (manifest, file, checks against
    the state), ``plan_s`` (boxes, byte ranges, who checks what), ``check_s`` (reading and
    CRC-checking this rank's shards), ``prefetch_s`` (mapping what other ranks of the node
    check), ``check_wait_s`` (the agreement that every rank's check passed), ``fresh_s``
    (copies into fresh buffers), ``apply_s`` (the objects' ``load_state_dict``), ``fill_s``
    (within ``apply_s``: writing the state's own tensors), ``copy_s`` (within ``fill_s``: the
    host copies alone), ``install_wait_s``,
    ``close_s``.
    """
    clock = _Clock(stats)
    state = with_generators(state)
    trees = current_trees(state)
    targets = dict(iter_targets(state, trees))
    local_rows = {n: t.local.shape[0] for n, t in targets.items() if isinstance(t, Sharded)}
    all_rows = comm.allgather(local_rows)
    boxes: dict[str, Any] = {}
    made: set[str] = set()  # the targets this load made for a fresh optimizer (nothing of the state yet)
    clock.lap("targets_s")
    m, reader = _open_checked(comm, root, step, state, targets, all_rows, trees, boxes, made)
    clock.lap("open_s")
    chosen = step
    try:
        # Each rank reads the box its own DTensor targets hold; the ranks of a node share the
        # checks, so each needs the others' boxes.
        all_boxes = comm.allgather(boxes)
        ranges = _ranges(comm.rank, m, all_rows, all_boxes)
        # Pass 1: every byte any rank will install is checked (CRC of whole shards, straight
        # over the file's mapping) before any buffer of the state is touched, each shard once per
        # node (ranks of a node share the page cache). The check reads into nothing of its own;
        # the only memory it touches is the fresh buffers the load needs anyway (below).
        node, sharing = _node_ranks(comm)

        def check() -> tuple[set[tuple[str, int]], list[_Dest], dict[int, list[tuple[np.ndarray, int]]],
                             ScratchCopies]:
            # Where each tensor's bytes go (inside the agreement: allocating a fresh buffer may
            # fail on one rank). The scratch ones (fresh buffers, a fresh optimizer's moment
            # targets: nothing of the state until every check passed) are filled by the check
            # itself, as it reads them, and are fresh memory: their pages are faulted in beside
            # the check, while it waits for the disk.
            dests = _destinations(state, ranges, targets)
            scratch = _scratch_pieces(reader, ranges, made, dests) if FILL_IN_CHECK else {}
            into = ScratchCopies([p for ps in scratch.values() for p in ps])
            fresh_memory = [d for ps in scratch.values() for d, _ in ps] if FILL_IN_CHECK else _fresh_targets(targets, made)
            faulting = copy_pool().submit(prefault, fresh_memory) if PREFAULT else None
            try:
                mine, needed = _my_checks(comm.rank, node, m, reader, all_rows, all_boxes)
                clock.lap("plan_s")
                # each rank one contiguous run of the file from its start (see _my_checks);
                # SPREAD_READS (off) would begin each rank's at another place of it
                reader.verify(mine, node.index(comm.rank) / len(node) if SPREAD_READS else 0.0, into)
                clock.lap("check_s")
                reader.prefetch(needed - mine, into)  # what the other ranks of the node check
                clock.lap("prefetch_s")
            finally:
                if faulting is not None:
                    faulting.result()
            return needed, dests, scratch, into

        needed, dests, scratch, into = comm.run_step(check, f"checking checkpoint step {chosen}")
        clock.lap("check_wait_s")
        reader.trust(needed)  # every rank checked its part, or all would have raised above
        filled = {i for i, ps in scratch.items() if all(into.full(d, at) for d, at in ps)}
        # Pass 2: the checked bytes, still mapped, go straight into their final place (one memcpy).
        threads = copy_threads(sharing)
        result = comm.run_step(lambda: _install(comm, m, state, reader, ranges, targets, rng, trees, threads,
                                                clock, dests, filled, made),
                               f"loading checkpoint step {chosen} into the state")
        clock.lap("install_wait_s")
        return result
    finally:
        reader.close()
        clock.lap("close_s")


NODE_RUNS = True  # every shard the node reads dealt out over all its ranks (False: over its readers; A/B)
# True: each rank of a node begins its stream at another place of its shards (DatasetReader.verify);
# a help when a rank's shards interleaved with the others', a jump more since NODE_RUNS gives each
# rank one contiguous run (1 GB FSDP2 on 2 ranks, 10 rounds: 0.612 s median against 0.569 s)
SPREAD_READS = False
PREFAULT = True  # fault in fresh targets' pages during the check (False: in the copy; for A/B runs)
FILL_IN_CHECK = True  # the check fills scratch destinations as it reads (False: copied after it; A/B)


@dataclass
class _Dest:
    """Where one tensor's checked bytes go: into the state's own host bytes (``view``), its own
    device tensor (``dev``, through staging) or a fresh buffer (``fresh``); at most one is set."""

    how: str | None                              # :func:`_in_place`'s answer
    view: np.ndarray | None = None               # the state's own host bytes (or a fresh target's)
    dev: torch.Tensor | None = None              # the state's own device tensor
    fresh: tuple[Any, np.ndarray] | None = None  # a fresh buffer (object, its bytes)


def _destinations(state: Mapping[str, Any], ranges: list[tuple[dict[str, Any], Runs, tuple[int, ...], int]],
                  targets: Mapping[str, Any]) -> list[_Dest]:
    """The destination of each entry of ``ranges``: in place where that keeps the load
    all-or-nothing (see :func:`_in_place`), else a fresh buffer, allocated here (uninitialised)."""
    out = []
    for meta, _, shape, _ in ranges:
        tgt = targets.get(meta["name"])
        how = _in_place(_owner(state, meta["name"])) if tgt is not None else None
        view = leaf_view(tgt, meta["dtype"], shape) if how else None
        dev = _device_view(tgt, meta["dtype"], shape) if how and view is None else None
        fresh = empty_like_leaf(meta["dtype"], shape) if view is None and dev is None else None
        out.append(_Dest(how, view, dev, fresh))
    return out


def _scratch_pieces(reader: DatasetReader, ranges: list[tuple[dict[str, Any], Runs, tuple[int, ...], int]],
                    made: set[str], dests: list[_Dest]) -> dict[int, list[tuple[np.ndarray, int]]]:
    """(bytes, file offset) pieces of the destinations nothing of the state sees before every
    check passed, by entry: fresh buffers, and the targets this load made for a fresh optimizer
    (``made``: :func:`~.dtensor.optimizer_targets`) on the host."""
    out: dict[int, list[tuple[np.ndarray, int]]] = {}
    for i, ((meta, rs, _, _), d) in enumerate(zip(ranges, dests)):
        if d.fresh is not None:
            dest = d.fresh[1]
        elif d.view is not None and d.how == "after" and meta["name"] in made:
            dest = d.view
        else:
            continue
        b = dest.reshape(-1).view(np.uint8)
        base = reader.offset(meta)
        out[i] = [(b[at:at + n], base + start) for start, at, n in rs if n]
    return out


def _fresh_targets(targets: Mapping[str, Any], made: set[str]) -> list[np.ndarray]:
    """The host bytes of the targets this load made for a fresh optimizer (``made``)."""
    out = []
    for name, t in targets.items():
        if is_dtensor(t) and name in made:
            local = local_of(t)
            if devices.on_host(local) and local.is_contiguous() and local.numel():
                out.append(local.reshape(-1).view(torch.uint8).numpy())
    return out


class _Clock:
    """Per-phase wall times of one load into ``stats`` (nothing kept without it)."""

    def __init__(self, stats: dict[str, float] | None) -> None:
        self.stats = stats
        self.t = time.perf_counter()

    def lap(self, key: str) -> None:
        """Add the time since the last lap to ``key``."""
        now = time.perf_counter()
        if self.stats is not None:
            self.stats[key] = self.stats.get(key, 0.0) + now - self.t
        self.t = now

    def add(self, key: str, seconds: float) -> None:
        if self.stats is not None:
            self.stats[key] = self.stats.get(key, 0.0) + seconds


def _dtype_of(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return str(obj.dtype)
    return f"numpy.{obj.dtype.newbyteorder('=').name}"


def _my_tensors(m: Mapping[str, Any], rank: int) -> list[dict[str, Any]]:
    """The tensor entries ``rank`` loads. A packed per-rank dataset (format 3) comes back as its
    entry plus ``"part"``: [start byte, this rank's shape]; a format-2 per-rank dataset
    (``rank00003/...``) only for its rank."""
    out = []
    for t in m["tensors"]:
        if t["kind"] != LeafKind.PER_RANK:
            out.append(t)
        elif t["rank"] is not None:
            if t["rank"] == rank:
                out.append(t)
        else:
            parts = t["parts"]
            p = parts[rank] if rank < len(parts) and parts[rank][0] == rank else \
                next((q for q in parts if q[0] == rank), None)
            if p is not None:
                out.append({**t, "part": (p[1], tuple(p[2]))})
    return out


def _check_against_state(m: Mapping[str, Any], rank: int, state: Mapping[str, Any],
                         targets: Mapping[str, Any], all_rows: list[dict[str, int]],
                         trees: Mapping[str, Any]) -> None:
    """Raise a CheckpointError if the checkpoint cannot be loaded into ``state`` as it is."""
    step = m["step"]
    for name, tgt in targets.items():
        refuse_meta(tgt.local if isinstance(tgt, Sharded) else tgt, name, "to load into")
    hint = "load into a state built like the one that was saved (same model, dtypes and sizes)"
    for meta in _my_tensors(m, rank):
        name, shape = meta["name"], tuple(meta["part"][1] if "part" in meta else meta["shape"])
        tgt = targets.get(name)
        if is_dtensor(tgt):
            assert tgt is not None
            if "part" in meta or meta["kind"] == LeafKind.PER_RANK:
                raise CheckpointError(f"{name!r} is a DTensor in the state passed to load but per-rank "
                                      f"state in checkpoint step {step}", hint=hint)
            if tuple(tgt.shape) != shape or str(tgt.dtype) != meta["dtype"]:
                raise CheckpointError(f"DTensor {name!r} has global shape {list(tgt.shape)} ({tgt.dtype}) in "
                                      f"the state passed to load but {list(shape)} ({meta['dtype']}) in "
                                      f"checkpoint step {step}", hint="resharding changes how a tensor is "
                                      "split, not its global shape: build the model with the saved sizes")
            continue
        if meta["kind"] == LeafKind.SHARDED:
            if not isinstance(tgt, Sharded):
                raise CheckpointError(f"{name!r} is sharded in the checkpoint but the state "
                                      f"passed to load has no Sharded(...) for it",
                                      hint="pass Sharded(local_rows_tensor) at the same place")
            total = sum(rows.get(name, 0) for rows in all_rows)
            if not shape or total != shape[0]:
                raise CheckpointError(f"sharded {name!r} has {shape[0] if shape else 0} rows in the "
                                      f"checkpoint but the ranks hold {total}",
                                      hint="size the local parts so they add up to the saved rows")
            local = tgt.local
            tgt, shape = local, (local.shape[0],) + shape[1:]
        elif isinstance(tgt, Sharded):
            raise CheckpointError(f"{name!r} is Sharded(...) in the state passed to load but "
                                  f"{meta['kind']} in checkpoint step {step}", hint=hint)
        if tgt is not None and (tuple(tgt.shape) != shape or _dtype_of(tgt) != meta["dtype"]):
            raise CheckpointError(f"{name!r} is {_dtype_of(tgt)} {list(tgt.shape)} in the state passed to "
                                  f"load but {meta['dtype']} {list(shape)} in checkpoint step {step}",
                                  hint=hint)
    for key, value in state.items():
        section = LeafKind.PER_RANK if isinstance(value, PerRank) else LeafKind.REPLICATED
        inner = value.value if isinstance(value, PerRank) else value
        skel = m["skeletons"][section] if section == LeafKind.REPLICATED else \
            m["skeletons"][LeafKind.PER_RANK].get(str(rank), {})
        if key not in skel:
            continue
        if is_stateful(inner) and not isinstance(inner, torch.nn.Module):
            check_skeleton(key, trees[key], skel[key])
            continue
        if not isinstance(inner, torch.nn.Module):
            continue
        saved = saved_keys(skel[key])
        # the module's keys as this load names them (match_saved_keys: the saved naming where
        # the module's clean or own keys map onto it)
        mine = set(trees[key]) if isinstance(trees[key], Mapping) else set(inner.state_dict())
        if saved != mine:
            missing, extra = sorted(mine - saved)[:3], sorted(saved - mine)[:3]
            raise CheckpointError(f"model {key!r} does not match checkpoint step {step}: entries missing "
                                  f"from the checkpoint {missing}, entries the model lacks {extra}",
                                  hint=hint)


def _open_checked(comm: Comm, root: Path, step: int, state: Mapping[str, Any],
                  targets: dict[str, Any], all_rows: list[dict[str, int]], trees: dict[str, Any],
                  boxes: dict[str, Any], made: set[str]) -> tuple[dict[str, Any], DatasetReader]:
    """Collective: read the manifest, open the data file, check everything; nothing written yet.

    Adds DTensor targets for a fresh optimizer's saved state to ``targets``
    (:func:`~coci_hpc.checkpoint.dtensor.optimizer_targets`; their names to ``made``) and this
    rank's box of every DTensor target to ``boxes``."""
    opened: list[DatasetReader] = []

    def step_fn() -> dict[str, Any]:
        m = cat.read_step(root, step)
        opened.append(DatasetReader(cat.step_dir(root, step) / mf.DATA_FILE, m))  # checks CRCs on read
        mine = _my_tensors(m, comm.rank)
        for meta in mine:
            opened[0].offset(meta)  # present, same shape/dtype/size as the manifest, inside the file
        match_saved_keys(state, {LeafKind.REPLICATED: m["skeletons"][LeafKind.REPLICATED],
                                 LeafKind.PER_RANK: m["skeletons"][LeafKind.PER_RANK].get(str(comm.rank), {})},
                         trees, targets)
        made.update(optimizer_targets(state, mine, targets))
        _check_against_state(m, comm.rank, state, targets, all_rows, trees)
        wanted = {meta["name"] for meta in mine}
        boxes.update({n: target_box(t, n) for n, t in targets.items() if n in wanted and is_dtensor(t)})
        return m

    try:
        m = comm.run_step(step_fn, f"checking checkpoint step {step}")
    except BaseException:
        for r in opened:
            r.close()
        raise
    return m, opened[0]


Runs = list[tuple[int, int, int]]  # (dataset byte, byte in the local buffer, bytes)


def _ranges(rank: int, m: dict[str, Any], all_rows: list[dict[str, int]],
            all_boxes: list[dict[str, Any]] | None = None) -> list[tuple[dict[str, Any], Runs, tuple[int, ...], int]]:
    """(tensor entry, byte runs, local shape, bytes) of everything ``rank`` loads: one run,
    except for a DTensor target, which reads the runs of its box of the global dataset."""
    out: list[tuple[dict[str, Any], Runs, tuple[int, ...], int]] = []
    boxes = all_boxes[rank] if all_boxes is not None and rank < len(all_boxes) else {}
    for meta in _my_tensors(m, rank):
        shape = tuple(meta["shape"])
        start = 0
        box = boxes.get(meta["name"]) if "part" not in meta else None
        if box is not None:
            itemsize = storage_dtype(meta["dtype"]).itemsize
            shape = tuple(box[1])
            out.append((meta, runs(meta["shape"], (tuple(box[0]), shape), itemsize), shape,
                        math.prod(shape) * itemsize))
            continue
        if "part" in meta:  # this rank's leaf inside a packed per-rank dataset
            start, shape = meta["part"]
        elif meta["kind"] == LeafKind.SHARDED:
            before = sum(rows.get(meta["name"], 0) for rows in all_rows[:rank])
            row_bytes = meta["nbytes"] // shape[0] if shape[0] else 0
            start = before * row_bytes
            shape = (all_rows[rank].get(meta["name"], 0),) + shape[1:]
        nbytes = math.prod(shape) * storage_dtype(meta["dtype"]).itemsize
        out.append((meta, [(start, 0, nbytes)], shape, nbytes))
    return out


def _node_ranks(comm: Comm) -> tuple[list[int], int]:
    """(the world ranks that share this rank's node (its shared-memory domain), sorted; how many
    of them may run on a core this rank may run on, itself included)."""
    mine = _cores()
    if not comm.is_mpi:
        return [comm.rank], 1
    from mpi4py import MPI

    node = comm.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        got = node.allgather((comm.rank, sorted(mine)))
    finally:
        node.Free()
    sharing = sum(1 for _, cores in got if mine & set(cores))
    return sorted(r for r, _ in got), max(1, sharing)


def _cores() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _my_checks(rank: int, node: list[int], m: dict[str, Any], reader: DatasetReader,
               all_rows: list[dict[str, int]], all_boxes: list[dict[str, Any]] | None = None
               ) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """(shards this rank checks, shards it reads): every shard a rank of the node reads is dealt
    out among all the node's ranks (they share the page cache, so a node checks each shard once),
    each rank one contiguous run of the file by bytes, whoever reads the shards in it: every rank
    reads one sequential stream instead of skipping about. For a replicated (DDP) state that was
    already so (benchmark A/B on 2 ranks, two alternating runs each while a cluster test ran:
    restore_ratio 1.51 / 1.64 against 1.55 / 1.81 with shards dealt out in turn). A sharded state
    (FSDP2) on its saving mesh had each rank check its own shards, which in the one file per step
    interleave with the other ranks' (each tensor's rows in rank order): one pread of a rank's own
    bytes out of that file took 1.06-1.16 x a read of the same bytes from a file of its own, and
    the check about as long. Dealt out over the node instead (``NODE_RUNS``; issue 33, the 1 GB
    FSDP2 state on 2 ranks, a save before each round, 10-12 rotating rounds, three runs): load
    0.571 / 0.576 / 0.569 s median against 0.620 / 0.651 / 0.671 s, 1.11-1.19 x the raw read of
    files of their own against 1.27-1.31 x; the copies after the check read the other rank's
    half from the page cache (:meth:`DatasetReader.prefetch` maps it)."""
    needs = {r: reader.shards_of([(meta, start, start + n) for meta, rs, _, _ in _ranges(r, m, all_rows, all_boxes)
                                  for start, _, n in rs])
             for r in node}
    groups: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    for key in set().union(*needs.values()):
        groups.setdefault(tuple(node) if NODE_RUNS else tuple(r for r in node if key in needs[r]), []).append(key)
    mine = set()
    for readers, keys in groups.items():
        if rank not in readers:
            continue
        extents = sorted((reader.shard_extent(k), k) for k in keys)
        total, at = sum(n for (_, n), _ in extents), 0
        me = readers.index(rank)
        for (_, n), key in extents:
            # a shard goes to the reader whose byte range holds its middle
            if min(len(readers) - 1, (2 * at + n) * len(readers) // (2 * total or 1)) == me:
                mine.add(key)
            at += n
    return mine, needs[rank]


def _plan(reader: DatasetReader, pieces: list[tuple[np.ndarray, int]], meta: Mapping[str, Any],
          dest: np.ndarray, rs: Runs) -> None:
    """Plan the copies of runs ``rs`` of a dataset into ``dest`` (the local buffer, 1-D)."""
    if len(rs) == 1 and rs[0][1] == 0 and rs[0][2] == dest.nbytes:
        piece = reader.plan_verified(meta, dest, rs[0][0])
        if piece is not None:
            pieces.append(piece)
        return
    b = dest.reshape(-1).view(np.uint8)
    for start, at, n in rs:
        piece = reader.plan_verified(meta, b[at:at + n], start)
        if piece is not None:
            pieces.append(piece)


def _owner(state: Mapping[str, Any], leaf: str) -> Any:
    """The state value a leaf name ("replicated/<key>/...") belongs to."""
    value = state.get(leaf.split("/", 2)[1])
    return value.value if isinstance(value, PerRank) else value


def _in_place(owner: Any) -> str | None:
    """How a leaf of ``owner`` may be loaded into the tensor the state already has.

    Modules, plain tensors and trees are written to only after every object that may refuse its
    state accepted it, so writing their own buffers keeps the load all-or-nothing ("direct").
    An optimizer keeps the state tensors it is given (``Optimizer.load_state_dict`` casts to the
    parameter's dtype and device, which the checks made equal): it is loaded with its own
    tensors, and once every refusable object accepted, the bytes go into whatever tensors its
    ``state_dict()`` then names ("after"). Any other object might copy values while loading,
    so its tensors are read into fresh buffers (None).
    """
    if isinstance(owner, torch.optim.Optimizer):
        return "after"
    if is_stateful(owner) and not isinstance(owner, torch.nn.Module):
        return None
    return "direct"


def _device_view(obj: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The device tensor (CUDA) that receives a stored leaf in place, or None: a contiguous one of
    the leaf's dtype and shape (a DTensor's or ``Sharded``'s local tensor)."""
    if isinstance(obj, Sharded):
        obj = obj.local
    if is_dtensor(obj):
        obj = local_of(obj)
    if not isinstance(obj, torch.Tensor) or devices.on_host(obj):
        return None
    if str(obj.dtype) != dtype or tuple(obj.shape) != tuple(shape) or not obj.is_contiguous():
        return None
    return obj


def _check_cover(reader: DatasetReader, meta: Mapping[str, Any], rs: Runs) -> None:
    """CheckpointCorrupt unless checked shards cover runs ``rs`` of a dataset (what :func:`_plan`
    checks before it copies), for bytes the check itself already put in place."""
    for start, _, n in rs:
        if n:
            reader.verified_offset(meta, start, n)


def _device_runs(reader: DatasetReader, meta: Mapping[str, Any], rs: Runs) -> DeviceRuns:
    """Runs ``rs`` of a dataset as (file offset, byte in the device tensor, bytes), every byte
    covered by checked shards (CheckpointCorrupt otherwise)."""
    return [(reader.verified_offset(meta, start, n), at, n) for start, at, n in rs if n]


def _install(comm: Comm, m: dict[str, Any], state: Mapping[str, Any], reader: DatasetReader,
             ranges: list[tuple[dict[str, Any], Runs, tuple[int, ...], int]], targets: Mapping[str, Any],
             rng: bool, trees: Mapping[str, Any], threads: int, clock: _Clock, dests: list[_Dest],
             filled: set[int], made: set[str]) -> LoadResult:
    """Put the checked bytes into the state: fresh buffers only where in place is not safe.

    ``dests``: each entry's destination (:func:`_destinations`); ``filled``: the entries whose
    scratch destination the check filled whole (:class:`~.h5read.ScratchCopies`), not copied
    again. The copies of each group run as one batch split over ``threads`` threads (see
    :meth:`~coci_hpc.checkpoint.h5read.DatasetReader.copy_verified`)."""
    tensors: dict[str, Any] = {}
    direct: list[tuple[dict[str, Any], Runs, np.ndarray]] = []
    after: list[tuple[dict[str, Any], Runs, tuple[int, ...], Any]] = []
    fresh: list[tuple[np.ndarray, int]] = []
    wrap: list[tuple[str, Any, torch.Tensor]] = []  # (leaf, DTensor target, its fresh local) after the fill
    to_device: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a module's live device shard, its checked host copy)
    in_place: set[int] = set()  # ids of the state's own tensors the checked bytes go into
    on_device: list[tuple[dict[str, Any], Runs, torch.Tensor]] = []  # direct, into device tensors
    prefilled: dict[str, np.ndarray] = {}  # a fresh target the check filled: its bytes
    for i, ((meta, start, shape, _), d) in enumerate(zip(ranges, dests)):
        name = meta["name"]
        tgt = targets.get(name)
        how, view, dev = d.how, d.view, d.dev
        if dev is not None:
            # A device tensor (CUDA) is written as the host one is, in place and only in fill(),
            # its checked bytes streamed through pinned staging buffers (.staging): no fresh host
            # copy of it, no second device copy (issue 32).
            tensors[name] = tgt.local if isinstance(tgt, Sharded) else tgt
            if how == "direct":
                on_device.append((meta, start, dev))
                in_place.add(id(tensors[name]))
            else:
                after.append((meta, start, shape, _owner(state, name)))
            continue
        if view is None:
            # A fresh buffer, never the live tensor: an object that refuses its state, or copies
            # it while loading, must see the checkpoint's bytes and leave the state as it was.
            assert d.fresh is not None
            obj, dest = d.fresh
            if i in filled:
                _check_cover(reader, meta, start)  # filled by the check: nothing to copy
            else:
                _plan(reader, fresh, meta, dest, start)
            if how == "direct" and is_dtensor(tgt) and local_of(tgt).dtype == obj.dtype \
                    and tuple(local_of(tgt).shape) == tuple(obj.shape):
                # A module's own shard on its device (FSDP2 on CUDA): the checked host copy goes
                # into it in fill(), once nothing can refuse, as a CPU shard's bytes do. Wrapping
                # the host copy instead would allocate the whole shard again on the device.
                tensors[name] = tgt
                to_device.append((local_of(tgt), obj))
                in_place.add(id(tgt))
                continue
            if is_dtensor(tgt):
                wrap.append((name, tgt, obj))  # wrapped once filled: see below
            else:
                tensors[name] = obj  # torch copies it (load_state_dict, the optimizer's cast) in apply, after the fill
            continue
        tensors[name] = tgt.local if isinstance(tgt, Sharded) else tgt
        if how == "direct":
            direct.append((meta, start, view))
            in_place.add(id(tensors[name]))
        else:
            if i in filled:
                prefilled[name] = view
            after.append((meta, start, shape, _owner(state, name)))
    reader.copy_verified(fresh, threads)
    for name, tgt, obj in wrap:
        # Only now: from_local onto a mesh of another device (CUDA) copies the buffer at once, so
        # wrapping it before the fill handed the state uninitialised memory (issue 32).
        live = local_of(tgt)
        if name in made and live.dtype == obj.dtype and live.shape == obj.shape:
            # a fresh optimizer's moment target (already on the device, not yet the state's):
            # filled in place, so the moments take their device memory once, not twice
            with torch.no_grad():
                live.copy_(obj)
            tensors[name] = tgt
        else:
            tensors[name] = wrap_like(tgt, obj, name)   # too little device memory: a CheckpointError

    clock.lap("fresh_s")

    def fill() -> None:
        """Called once every refusable object accepted its state: from here on nothing refuses."""
        t0 = time.perf_counter()
        stager = DeviceStager(lambda buf, at: reader.copy_verified([(buf, at)]))
        pieces: list[tuple[np.ndarray, int]] = []
        cast: list[tuple[torch.Tensor, Any]] = []
        try:
            for meta, start, dev in on_device:
                stager.put(dev, _device_runs(reader, meta, start))
            for meta, start, view in direct:
                _plan(reader, pieces, meta, view, start)
            now: dict[int, dict[str, Any]] = {}
            for meta, start, shape, owner in after:
                if id(owner) not in now:
                    key = meta["name"].split("/", 2)
                    now[id(owner)] = {}
                    for tree in live_trees(state, owner):  # by position and, for an optimizer, by name
                        _collect_tensors(tree, f"{key[0]}/{key[1]}", now[id(owner)])
                live = now[id(owner)].get(meta["name"])
                live_view = leaf_view(live, meta["dtype"], shape)
                if live_view is not None:
                    mine = prefilled.get(meta["name"])
                    # the optimizer kept the fresh target the check filled: nothing to copy
                    if mine is not None and mine.ctypes.data == live_view.ctypes.data \
                            and mine.nbytes == live_view.nbytes:
                        _check_cover(reader, meta, start)
                    else:
                        _plan(reader, pieces, meta, live_view, start)
                    continue
                live_dev = _device_view(live, meta["dtype"], shape)
                if live_dev is not None:
                    stager.put(live_dev, _device_runs(reader, meta, start))
                    continue
                if not isinstance(live, torch.Tensor):
                    raise CheckpointError(f"{meta['name']!r}: the optimizer dropped this tensor while loading",
                                          hint="report this; load with a freshly built optimizer")
                obj, dest = empty_like_leaf(meta["dtype"], shape)
                _plan(reader, pieces, meta, dest, start)
                cast.append((local_of(live) if is_dtensor(live) else live, obj))
            t1 = time.perf_counter()
            reader.copy_verified(pieces, threads)  # while the last device copies run
            clock.add("copy_s", time.perf_counter() - t1)
        finally:
            stager.finish()  # no copy out of a staging buffer outlives the load
        with torch.no_grad():
            for live, obj in to_device:
                # blocking: obj is pageable and dropped after the load; filled before apply began
                live.copy_(obj)
            for live, obj in cast:
                # the optimizer cast it (dtype/device): copy with the same cast; blocking (obj is
                # pageable and dropped right after), obj was filled just above
                live.copy_(obj)
        clock.add("fill_s", time.perf_counter() - t0)

    rank = comm.rank
    per_rank_skel = m["skeletons"][LeafKind.PER_RANK].get(str(rank), {})
    skeletons: dict[str, Any] = {LeafKind.REPLICATED: m["skeletons"][LeafKind.REPLICATED], LeafKind.PER_RANK: per_rank_skel}
    with torch.no_grad():
        missing = apply(state, skeletons, tensors, rng=rng and str(rank) in m["skeletons"][LeafKind.PER_RANK],
                        before=trees, fill=fill, in_place=frozenset(in_place))
    clock.lap("apply_s")
    if rng and str(rank) not in m["skeletons"][LeafKind.PER_RANK]:
        missing.append("__rng__")
    return LoadResult(int(m["step"]), int(m["world_size"]), tuple(missing), m,
                      sum(n for _, _, _, n in ranges))
