"""Save and load orchestration (the short sequence described in :mod:`.protocol`).

``prepare`` (collective) -> ``write_items`` (per rank) -> ``commit`` (collective, rank 0 writes).
The two-phase save in :mod:`.twophase` reuses the same three steps with the write in a thread.
"""
from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.h5file import DatasetReader
from coci_hpc.checkpoint.lustre import IOTuning, apply_setstripe
from coci_hpc.checkpoint.plan import LeafDesc, Plan, make_plan
from coci_hpc.checkpoint.protocol import StorageWriter
from coci_hpc.checkpoint.rawio import WriteItem, write_posix
from coci_hpc.checkpoint.state import Leaf, Sharded, apply, empty_like_leaf, iter_targets, leaf_view
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError, CheckpointNotFound


@dataclass
class Prepared:
    """One save after its collective preparation: what this rank must write, and where."""

    step: int
    directory: Path
    plan: Plan
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
        return [p for p in self.plan.pieces if p.rank == rank]

    def items(self, rank: int, arrays: Mapping[str, np.ndarray] | None = None) -> list[WriteItem]:
        """(file offset, bytes) of this rank's pieces, from ``arrays`` (snapshot) or the live leaves."""
        out = []
        for p in self.my_pieces(rank):
            src = arrays[p.leaf] if arrays is not None else self.leaves[p.leaf].array
            b = src.view(np.uint8)
            out.append(WriteItem(self.offsets[p.dataset] + p.start,
                                 b[p.src_start:p.src_start + (p.stop - p.start)]))
        return out


def prepare(comm: Comm, root: Path, step: int, skeletons: dict[str, Any], leaves: Sequence[Leaf],
            writer: StorageWriter, tuning: IOTuning) -> Prepared:
    """Collective: agree on the plan, make the step directory and the file with all datasets."""
    descs = [LeafDesc(l.name, l.dtype, l.shape, l.kind, l.nbytes) for l in leaves]
    all_descs = comm.allgather(descs)
    plan = comm.run_step(lambda: make_plan(all_descs, align=tuning.align), "planning the checkpoint")
    directory = mf.step_dir(root, step)

    def make_dir() -> None:
        if comm.rank != 0:
            return
        if (directory / mf.MANIFEST).exists():
            raise CheckpointError(f"step {step} is already committed in {root}",
                                  hint="save under a new step number, or delete that checkpoint first")
        if directory.exists():  # leftover of a writer that died before commit
            shutil.rmtree(directory)
        root.mkdir(parents=True, exist_ok=True)
        directory.mkdir()
        apply_setstripe(tuning, directory)

    comm.run_step(make_dir, f"creating {directory}")
    offsets = writer.create(directory, plan, tuning)
    return Prepared(step, directory, plan, offsets, {l.name: l for l in leaves}, skeletons, tuning,
                    writer.name)


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
        plan = prepared.plan
        tensors = []
        for i, d in enumerate(plan.datasets):
            tensors.append({"name": d.name, "dataset": d.path, "file": mf.DATA_FILE, "dtype": d.dtype,
                            "shape": list(d.shape), "kind": d.kind, "rank": d.rank,
                            "nbytes": d.nbytes, "offset": prepared.offsets.get(i)})
        shards = []
        for r, g in enumerate(gathered):
            for p, crc in zip([p for p in plan.pieces if p.rank == r], g["crcs"]):
                shards.append({"file": mf.DATA_FILE, "dataset": plan.datasets[p.dataset].path,
                               "rank": r, "start": p.start, "stop": p.stop, "crc32": crc})
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


def load(comm: Comm, root: Path, step: int | None, state: Mapping[str, Any], *, rng: bool = True
         ) -> LoadResult:
    """Collective: every rank loads ``step`` (latest when None) into ``state`` in place."""
    def read_manifest() -> dict[str, Any]:
        return mf.read_step(root, step)

    # Rank 0 picks the step so that all ranks load the same one even while a writer commits.
    chosen = comm.bcast(mf.latest_step(root) if step is None and comm.rank == 0 else step)
    if chosen is None:
        comm.run_step(read_manifest, "finding the latest checkpoint")  # raises CheckpointNotFound
        raise CheckpointNotFound(f"no committed checkpoint under {root}", hint="save one first")
    step = chosen
    m = comm.run_step(read_manifest, f"reading the manifest of step {step}")
    targets = dict(iter_targets(state))
    local_rows = {n: t.local.shape[0] for n, t in targets.items() if isinstance(t, Sharded)}
    all_rows = comm.allgather(local_rows)

    def read_all() -> LoadResult:
        rank = comm.rank
        saved = int(m["world_size"])
        tensors: dict[str, Any] = {}
        path = mf.step_dir(root, step) / mf.DATA_FILE
        with DatasetReader(path) as reader:
            for meta in m["tensors"]:
                kind = meta["kind"]
                if kind == "per_rank" and meta["rank"] != rank:
                    continue
                shape = tuple(meta["shape"])
                start = 0
                if kind == "sharded":
                    tgt = targets.get(meta["name"])
                    if not isinstance(tgt, Sharded):
                        raise CheckpointError(f"{meta['name']!r} is sharded in the checkpoint but the state "
                                              f"passed to load has no Sharded(...) for it",
                                              hint="pass Sharded(local_rows_tensor) at the same place")
                    total = sum(rows.get(meta["name"], 0) for rows in all_rows)
                    if total != shape[0]:
                        raise CheckpointError(f"sharded {meta['name']!r} has {shape[0]} rows in the "
                                              f"checkpoint but the ranks hold {total}",
                                              hint="size the local parts so they add up to the saved rows")
                    before = sum(rows.get(meta["name"], 0) for rows in all_rows[:rank])
                    row_bytes = meta["nbytes"] // shape[0] if shape[0] else 0
                    start = before * row_bytes
                    shape = (tgt.local.shape[0],) + shape[1:]
                dest = leaf_view(targets.get(meta["name"]), meta["dtype"], shape)
                if dest is not None:
                    obj = targets[meta["name"]]
                    obj = obj.local if isinstance(obj, Sharded) else obj
                else:
                    obj, dest = empty_like_leaf(meta["dtype"], shape)
                reader.read(meta, dest, start)
                tensors[meta["name"]] = obj
        per_rank_skel = m["skeletons"]["per_rank"].get(str(rank), {})
        skeletons = {"replicated": m["skeletons"]["replicated"], "per_rank": per_rank_skel}
        import torch

        with torch.no_grad():
            missing = apply(state, skeletons, tensors, rng=rng and str(rank) in m["skeletons"]["per_rank"])
        if rng and str(rank) not in m["skeletons"]["per_rank"]:
            missing.append("__rng__")
        return LoadResult(int(m["step"]), saved, tuple(missing), m)

    return comm.run_step(read_all, f"loading checkpoint step {step}")
