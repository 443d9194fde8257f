"""Save and load orchestration (the short sequence described in :mod:`.protocol`).

``prepare`` (collective) -> ``write_items`` (per rank) -> ``commit`` (collective, rank 0 writes).
The two-phase save in :mod:`.twophase` reuses the same three steps with the write in a thread.
"""
from __future__ import annotations

import numbers
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint import perms
from coci_hpc.checkpoint.h5file import DatasetReader
from coci_hpc.checkpoint.layout import Layout, LeafDesc, make_layout
from coci_hpc.checkpoint.lustre import IOTuning, apply_setstripe
from coci_hpc.checkpoint.protocol import StorageWriter
from coci_hpc.checkpoint.rawio import WriteItem, write_posix
from coci_hpc.checkpoint.state import (
    Leaf,
    PerRank,
    Sharded,
    apply,
    check_skeleton,
    current_trees,
    empty_like_leaf,
    is_stateful,
    iter_targets,
)
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError, CheckpointNotFound, CociError, UsageError


@dataclass
class Prepared:
    """One save after its collective preparation: what this rank must write, and where."""

    step: int
    directory: Path
    layout: Layout
    offsets: dict[int, int]
    leaves: dict[str, Leaf]
    skeletons: dict[str, Any]
    tuning: IOTuning
    backend: str
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def data_path(self) -> Path:
        return self.directory / mf.DATA_FILE

    def my_pieces(self, rank: int):
        return [p for p in self.layout.pieces if p.rank == rank]

    def items(self, rank: int, arrays: Mapping[str, np.ndarray] | None = None) -> list[WriteItem]:
        """(file offset, bytes) of this rank's pieces, from ``arrays`` (snapshot) or the live leaves."""
        out = []
        for p in self.my_pieces(rank):
            src = arrays[p.leaf] if arrays is not None else self.leaves[p.leaf].array
            assert src is not None  # a device leaf (array None) is written from its snapshot only
            b = src.view(np.uint8)
            out.append(WriteItem(self.offsets[p.dataset] + p.start,
                                 b[p.src_start:p.src_start + (p.stop - p.start)]))
        return out


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        # step_-0000001 would be written but never listed, loaded as latest or retained.
        raise UsageError(f"step={step!r} is not a non-negative integer",
                         hint="pass the training step counter (0, 1, 2, ...)")
    return int(step)


def prepare(comm: Comm, root: Path, step: int, skeletons: dict[str, Any], leaves: Sequence[Leaf],
            writer: StorageWriter, tuning: IOTuning) -> Prepared:
    """Collective: agree on the layout, make the step directory and the file with all datasets."""
    step = check_step(step)
    descs = [LeafDesc(l.name, l.dtype, l.shape, l.kind, l.nbytes) for l in leaves]
    all_descs = comm.allgather(descs)
    layout = comm.run_step(lambda: make_layout(all_descs, align=tuning.align), "planning the checkpoint")
    directory = mf.step_dir(root, step)
    make_step_dir(comm, root, step, tuning)
    try:
        offsets = writer.create(directory, layout, tuning)
    except BaseException:  # raised on every rank (the writers agree): leave no partial directory
        def remove() -> None:
            if comm.rank == 0:
                shutil.rmtree(directory, ignore_errors=True)

        comm.run_step(remove, f"removing the failed step {step}")
        raise
    return Prepared(step, directory, layout, offsets, {l.name: l for l in leaves}, skeletons, tuning,
                    writer.name)


def make_step_dir(comm: Comm, root: Path, step: int, tuning: IOTuning) -> Path:
    """Collective: rank 0 creates the (empty) directory of ``step``; refuses a committed one."""
    directory = mf.step_dir(root, step)

    def make_dir() -> None:
        if comm.rank != 0:
            return
        if (directory / mf.MANIFEST).exists():
            raise CheckpointError(f"step {step} is already committed in {root}",
                                  hint="save under a new step number, or delete that checkpoint first")
        if directory.exists():  # leftover of a writer that died before commit
            shutil.rmtree(directory)
        perms.make_dirs(root, tuning.dir_mode)   # modes from access=, not the umask
        perms.make_dir(directory, tuning.dir_mode)
        # The new entry must survive a crash before the manifest's own directory fsync: without
        # it a power loss could keep the manifest's inode but lose the step directory's name.
        mf.fsync_dir(root)
        apply_setstripe(tuning, directory)

    comm.run_step(make_dir, f"creating {directory}")
    return directory


def recreate(comm: Comm, prepared: Prepared, writer: StorageWriter) -> None:
    """Collective: make the directory and file of a failed save again, for a retry of its items."""
    make_step_dir(comm, prepared.directory.parent, prepared.step, prepared.tuning)
    offsets = writer.create(prepared.directory, prepared.layout, prepared.tuning)
    if offsets != prepared.offsets:
        raise CheckpointError(f"retrying step {prepared.step}: the datasets landed at other offsets",
                              hint="report this; save again under a new step")


def discard(comm: Comm, prepared: Prepared) -> None:
    """Collective: remove the directory of a save that failed (nothing of it was committed)."""
    def remove() -> None:
        if comm.rank == 0 and not (prepared.directory / mf.MANIFEST).exists():
            shutil.rmtree(prepared.directory, ignore_errors=True)

    comm.run_step(remove, f"removing the failed step {prepared.step}")


def write_items(prepared: Prepared, items: Sequence[WriteItem], writer: StorageWriter | None) -> list[int]:
    """Write this rank's items; ``writer=None`` means independent pwrite (no MPI).

    With a collective writer every rank must get here: build ``items`` under
    ``Comm.run_step`` first so that a local failure stops all ranks before the collective.
    """
    if writer is None or not writer.collective_write:
        return write_posix(prepared.data_path, items)
    return writer.write(prepared.data_path, items, prepared.tuning)


def commit(comm: Comm, prepared: Prepared, crcs: list[int] | None, error: BaseException | None,
           keep: int) -> list[int]:
    """Collective: agree every rank wrote; rank 0 writes the manifest and applies retention.

    Raises one CommError on every rank if any rank failed; then nothing is committed.
    Returns the steps removed by retention.
    """
    comm.check(error, f"writing checkpoint step {prepared.step}")
    gathered = comm.gather({"crcs": crcs, "per_rank": prepared.skeletons["per_rank"]})

    def write_manifest() -> list[int]:
        if comm.rank != 0:
            return []
        assert gathered is not None
        layout = prepared.layout
        tensors = []
        for i, d in enumerate(layout.datasets):
            tensors.append({"name": d.name, "dataset": d.path, "file": mf.DATA_FILE, "dtype": d.dtype,
                            "shape": list(d.shape), "kind": d.kind, "rank": d.rank,
                            "nbytes": d.nbytes, "offset": prepared.offsets.get(i)})
        shards = []
        for r, g in enumerate(gathered):
            for p, crc in zip(layout.pieces_of(r), g["crcs"]):
                shards.append({"file": mf.DATA_FILE, "dataset": layout.datasets[p.dataset].path,
                               "rank": r, "start": p.start, "stop": p.stop, "crc32c": crc})
        skel = {"replicated": prepared.skeletons["replicated"],
                "per_rank": {str(r): g["per_rank"] for r, g in enumerate(gathered)}}
        m = mf.build(step=prepared.step, world_size=comm.size, tensors=tensors, shards=shards,
                     skeletons=skel, files=[mf.DATA_FILE], backend=prepared.backend,
                     extra={"lustre": prepared.tuning.lustre, "align": prepared.tuning.align})
        mf.commit(prepared.directory, m)
        return mf.apply_retention(prepared.directory.parent, keep)

    removed = comm.run_step(write_manifest, f"committing checkpoint step {prepared.step}")
    return comm.bcast(removed)


# ------------------------------------------------------------------------------------ load
@dataclass(frozen=True)
class LoadResult:
    step: int
    saved_world_size: int
    missing: tuple[str, ...]   # state keys (or "__rng__") the checkpoint had nothing for
    manifest: dict[str, Any]


_LATEST_ATTEMPTS = 3  # a concurrent writer's retention can remove "latest" while we open it


def load(comm: Comm, root: Path, step: int | None, state: Mapping[str, Any], *, rng: bool = True
         ) -> LoadResult:
    """Collective: every rank loads ``step`` (latest when None) into ``state`` in place.

    Everything is checked (manifest, datasets, shapes and dtypes against ``state``, the saved
    trees against the objects they go into) on every rank, and the data is read into fresh
    buffers, before the first byte goes into ``state``; objects whose ``load_state_dict``
    refuses are rolled back (:func:`~coci_hpc.checkpoint.state.apply`). A failed load leaves
    the state as it was.
    """
    trees = current_trees(state)
    targets = dict(iter_targets(state, trees))
    local_rows = {n: t.local.shape[0] for n, t in targets.items() if isinstance(t, Sharded)}
    all_rows = comm.allgather(local_rows)
    for attempt in range(_LATEST_ATTEMPTS):
        # Rank 0 picks the step so that all ranks load the same one even while a writer commits.
        chosen = comm.bcast(mf.latest_step(root) if step is None and comm.rank == 0 else step)
        if chosen is None:
            comm.run_step(lambda: mf.read_step(root, None), "finding the latest checkpoint")  # raises
            raise CheckpointNotFound(f"no committed checkpoint under {root}", hint="save one first")
        try:
            m, reader = _open_checked(comm, root, chosen, state, targets, all_rows, trees)
            break
        except CociError:
            # Asked for "latest" and a newer commit retired the chosen one meanwhile: choose again.
            gone = comm.bcast(not (mf.step_dir(root, chosen) / mf.MANIFEST).is_file()
                              if comm.rank == 0 else None)
            if step is not None or not gone or attempt == _LATEST_ATTEMPTS - 1:
                raise
    try:
        tensors = comm.run_step(lambda: _read_all(comm, m, reader, targets, all_rows),
                                f"reading checkpoint step {chosen}")
    finally:
        reader.close()
    # Every rank has all its bytes, checked, before any rank touches its state.
    return comm.run_step(lambda: _apply_loaded(comm, m, state, tensors, rng, trees),
                         f"loading checkpoint step {chosen} into the state")


def _dtype_of(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return str(obj.dtype)
    return f"numpy.{obj.dtype.newbyteorder('=').name}"


def _my_tensors(m: Mapping[str, Any], rank: int) -> list[dict[str, Any]]:
    return [t for t in m["tensors"] if t["kind"] != "per_rank" or t["rank"] == rank]


def _check_against_state(m: Mapping[str, Any], rank: int, state: Mapping[str, Any],
                         targets: Mapping[str, Any], all_rows: list[dict[str, int]],
                         trees: Mapping[str, Any]) -> None:
    """Raise a CheckpointError if the checkpoint cannot be loaded into ``state`` as it is."""
    step = m["step"]
    hint = "load into a state built like the one that was saved (same model, dtypes and sizes)"
    for meta in _my_tensors(m, rank):
        name, shape = meta["name"], tuple(meta["shape"])
        tgt = targets.get(name)
        if meta["kind"] == "sharded":
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
        section = "per_rank" if isinstance(value, PerRank) else "replicated"
        inner = value.value if isinstance(value, PerRank) else value
        skel = m["skeletons"][section] if section == "replicated" else \
            m["skeletons"]["per_rank"].get(str(rank), {})
        if key not in skel:
            continue
        if is_stateful(inner) and not isinstance(inner, torch.nn.Module):
            check_skeleton(key, trees[key], skel[key])
            continue
        if not isinstance(inner, torch.nn.Module):
            continue
        saved = skel[key]
        if isinstance(saved, dict) and "__dict__" in saved and len(saved) == 1:
            saved_keys = {k for k, _ in saved["__dict__"]}
        else:
            saved_keys = set(saved) if isinstance(saved, dict) else set()
        mine = set(inner.state_dict())
        if saved_keys != mine:
            missing, extra = sorted(mine - saved_keys)[:3], sorted(saved_keys - mine)[:3]
            raise CheckpointError(f"model {key!r} does not match checkpoint step {step}: entries missing "
                                  f"from the checkpoint {missing}, entries the model lacks {extra}",
                                  hint=hint)


def _open_checked(comm: Comm, root: Path, step: int, state: Mapping[str, Any],
                  targets: Mapping[str, Any], all_rows: list[dict[str, int]], trees: Mapping[str, Any]
                  ) -> tuple[dict[str, Any], DatasetReader]:
    """Collective: read the manifest, open the data file, check everything; nothing written yet."""
    opened: list[DatasetReader] = []

    def step_fn() -> dict[str, Any]:
        m = mf.read_step(root, step)
        opened.append(DatasetReader(mf.step_dir(root, step) / mf.DATA_FILE, m))  # checks CRCs on read
        for meta in _my_tensors(m, comm.rank):
            opened[0].offset(meta)  # present, same shape/dtype/size as the manifest, inside the file
        _check_against_state(m, comm.rank, state, targets, all_rows, trees)
        return m

    try:
        m = comm.run_step(step_fn, f"checking checkpoint step {step}")
    except BaseException:
        for r in opened:
            r.close()
        raise
    return m, opened[0]


def _read_all(comm: Comm, m: dict[str, Any], reader: DatasetReader,
              targets: Mapping[str, Any], all_rows: list[dict[str, int]]) -> dict[str, Any]:
    rank = comm.rank
    tensors: dict[str, Any] = {}
    for meta in _my_tensors(m, rank):
        shape = tuple(meta["shape"])
        start = 0
        if meta["kind"] == "sharded":
            tgt = targets[meta["name"]]
            before = sum(rows.get(meta["name"], 0) for rows in all_rows[:rank])
            row_bytes = meta["nbytes"] // shape[0] if shape[0] else 0
            start = before * row_bytes
            shape = (tgt.local.shape[0],) + shape[1:]
        # Always a fresh buffer, never the live tensor: a read or check that fails half way, or
        # a load_state_dict that refuses, must leave the state untouched (costs one copy).
        obj, dest = empty_like_leaf(meta["dtype"], shape)
        reader.read(meta, dest, start)
        tensors[meta["name"]] = obj
    return tensors


def _apply_loaded(comm: Comm, m: dict[str, Any], state: Mapping[str, Any], tensors: dict[str, Any],
                  rng: bool, trees: Mapping[str, Any]) -> LoadResult:
    rank = comm.rank
    per_rank_skel = m["skeletons"]["per_rank"].get(str(rank), {})
    skeletons = {"replicated": m["skeletons"]["replicated"], "per_rank": per_rank_skel}
    with torch.no_grad():
        missing = apply(state, skeletons, tensors, rng=rng and str(rank) in m["skeletons"]["per_rank"],
                        before=trees)
    if rng and str(rank) not in m["skeletons"]["per_rank"]:
        missing.append("__rng__")
    return LoadResult(int(m["step"]), int(m["world_size"]), tuple(missing), m)
