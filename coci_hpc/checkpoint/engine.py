"""Save and load orchestration.

The save transaction (the sequence of :mod:`.protocol`; every kind of save runs these phases)::

    prepared = create(comm, writer, plan(comm, catalog, step, skeletons, leaves, tuning, layouts))
    try:
        crcs = write(writer, prepared, items)         # async: in a thread, write_independent
        Commit(comm, prepared, Written(crcs), keep).run()     # async: .step() at each poll()
    except BaseException:
        discard(comm, prepared)
        raise

:func:`save` is this sequence for the sync save; :class:`~.twophase.TwoPhaseSaver` splits it over
``start`` (plan, create, snapshot), its background thread (write) and ``poll`` (commit);
:func:`save_whole` is the survivors' save (one process writes every rank's pieces).
"""
from __future__ import annotations

import json
import math
import numbers
import os
import pickle
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import integrity
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.catalog import StepCatalog
from coci_hpc.checkpoint.coordinator import LayoutCache, agree
from coci_hpc.checkpoint.dtensor import (
    is_dtensor,
    local_of,
    made_for_load,
    optimizer_targets,
    runs,
    target_box,
    wrap_like,
)
from coci_hpc.checkpoint.h5file import DatasetReader
from coci_hpc.checkpoint.layout import Layout, LeafDesc, Piece, RankLayout, make_layout, shard_entries
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.protocol import StorageWriter
from coci_hpc.checkpoint.rawio import WriteItem, copy_threads, last_write_times, pread_into
from coci_hpc.checkpoint.state import (
    Leaf,
    PerRank,
    Sharded,
    _collect_tensors,
    apply,
    check_skeleton,
    current_trees,
    empty_like_leaf,
    is_stateful,
    iter_targets,
    leaf_view,
    live_trees,
    match_saved_keys,
    storage_dtype,
)
from coci_hpc.comm import Comm, Pending
from coci_hpc.errors import CheckpointError, UsageError

T = TypeVar("T")
Progress = Callable[[str, bool], None]  # (phase, waiting for the other ranks): a watchdog's enter


@dataclass
class Prepared:
    """One save after its collective preparation: what this rank must write, and where."""

    step: int
    directory: Path
    layout: RankLayout            # this rank's pieces (and the dataset list where creation is collective)
    full: Layout | None           # the whole layout: rank 0 only (it writes the manifest)
    offsets: dict[int, int]       # file offset of each dataset this rank writes (rank 0: of all)
    leaves: dict[str, Leaf]
    skeletons: dict[str, Any]
    tuning: IOTuning
    backend: str
    stats: dict[str, Any] = field(default_factory=dict)
    catalog: StepCatalog | None = None  # rank 0's step catalog: owns the step directory
    layouts: LayoutCache | None = None  # the manager's cache (also of the commit's skeletons)
    extra: dict[str, Any] = field(default_factory=dict)  # more manifest fields (the survivors' mark)

    @property
    def data_path(self) -> Path:
        return self.directory / mf.DATA_FILE

    def my_pieces(self, rank: int | None = None) -> list[Piece]:
        return list(self.layout.pieces)

    def items(self, rank: int, arrays: Mapping[str, np.ndarray] | None = None,
              pieces: Sequence[Piece] | None = None) -> list[WriteItem]:
        """(file offset, bytes) of this rank's pieces (or ``pieces``), from ``arrays`` (a
        snapshot, another rank's state) or the live leaves."""
        out = []
        for p in self.layout.pieces if pieces is None else pieces:
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


# ------------------------------------------------------------------- the save transaction
def save(comm: Comm, writer: StorageWriter, catalog: StepCatalog, layouts: LayoutCache, step: int,
         skeletons: dict[str, Any], leaves: Sequence[Leaf], tuning: IOTuning, keep: int,
         progress: Progress | None = None, stats: dict[str, float] | None = None) -> Path:
    """Collective, blocking: the sync save, the whole transaction; returns the step directory.
    ``stats`` receives this rank's time in each phase (``plan_s``, ``create_s``, ``collect_s``,
    ``write_s``, ``sync_s``, ``commit_s``, ``manifest_s``)."""
    t0 = time.perf_counter()
    planned = plan(comm, catalog, step, skeletons, leaves, tuning, layouts)
    t1 = time.perf_counter()
    prepared = create(comm, writer, planned)
    prepared.stats.update(plan_s=t1 - t0, create_s=time.perf_counter() - t1)

    def items() -> list[WriteItem]:
        # Agree that every rank has its data before any collective write starts.
        return comm.run_step(lambda: prepared.items(comm.rank), f"collecting the data of step {step}")

    write_and_commit(comm, writer, prepared, items, keep, progress=progress)
    if stats is not None:
        stats.update({k: v for k, v in prepared.stats.items() if k.endswith("_s")})
    return prepared.directory


def write_and_commit(comm: Comm, writer: StorageWriter, prepared: Prepared,
                     items: Callable[[], Sequence[WriteItem]], keep: int, *, independent: bool = False,
                     progress: Progress | None = None) -> list[int]:
    """Collective, blocking: phases 3-4 of a created save (the sync save, the async retry), and
    the discard on any failure; returns the steps retention removed (rank 0)."""
    try:
        written = Written()
        clock = time.perf_counter
        t0 = t1 = clock()
        try:
            if progress is not None:
                progress("writing its data", False)
            data = items()
            t1 = clock()
            written.finish(write(writer, prepared, data, independent=independent))
        except Exception as exc:  # noqa: BLE001 - agreed on in the commit
            written.finish(error=exc)
        t2 = clock()
        if progress is not None:
            progress("waiting for the other ranks to commit", True)
        commit = Commit(comm, prepared, written, keep)
        removed = commit.run()
        io = last_write_times()  # the writer's own split of its time: the data, then the sync
        prepared.stats.update(collect_s=t1 - t0, write_s=io.get("write_s", t2 - t1), sync_s=io.get("sync_s", 0.0),
                              commit_s=clock() - t2, manifest_s=commit.manifest_s)
        return removed
    except BaseException:
        discard(comm, prepared)  # raised on every rank: no partial step left
        raise


def plan(comm: Comm, catalog: StepCatalog, step: int, skeletons: dict[str, Any], leaves: Sequence[Leaf],
         tuning: IOTuning, layouts: LayoutCache) -> Prepared:
    """1. ALL ranks: agree on the layout (:func:`~.coordinator.agree`: one allreduce when nothing
    changed since the manager's last save); nothing is created yet."""
    step = check_step(step)
    mine, full = agree(comm, leaves, tuning.align, layouts, last_manifest=lambda: _last_manifest(catalog))
    return Prepared(step, cat.step_dir(catalog.root, step), mine, full, {}, {l.name: l for l in leaves},
                    skeletons, tuning, "", dict(layouts.last), catalog, layouts)


def plan_whole(catalog: StepCatalog, step: int, replicated: tuple[Any, Sequence[Leaf]],
               per_rank: Sequence[tuple[Any, Sequence[Leaf]]], tuning: IOTuning) -> Prepared:
    """1. for one process that holds every rank's pieces (the survivors' save): the layout of a
    world of ``len(per_rank)`` ranks, each with the ``replicated`` (skeleton, leaves) and its
    own (per-rank skeleton, leaves)."""
    skel, repl = replicated
    descs = [LeafDesc(l.name, l.dtype, l.shape, l.kind, l.nbytes, l.box) for l in repl]
    full = make_layout([descs + [LeafDesc(l.name, l.dtype, l.shape, l.kind, l.nbytes, l.box) for l in leaves]
                        for _, leaves in per_rank], align=tuning.align)
    return Prepared(check_step(step), cat.step_dir(catalog.root, step), full.for_rank(0), full, {},
                    {l.name: l for l in repl},
                    {"replicated": skel, "per_rank": None}, tuning, "", {}, catalog, None)


def create(comm: Comm, writer: StorageWriter, prepared: Prepared, *, again: bool = False) -> Prepared:
    """2. ALL ranks: rank 0's catalog makes the step directory, ``writer.create`` the file and
    its datasets; each rank learns its offsets. ``again``: a retry of a failed save, whose
    datasets must land where they did. On failure the directory is discarded on every rank."""
    catalog = prepared.catalog
    assert catalog is not None
    comm.run_step(lambda: _on_rank0(comm, catalog.create, prepared.step, prepared.tuning),
                  f"creating the directory of step {prepared.step} in {catalog.root}")
    prepared.backend = writer.name
    try:
        full = prepared.full
        created = writer.create(prepared.directory, None if full is None else full.datasets, prepared.tuning)
        if again:
            comm.run_step(lambda: _same_offsets(prepared, created), f"recreating the file of step {prepared.step}")
        elif prepared.layouts is None:
            prepared.offsets = created  # one process: it created them
        else:
            prepared.offsets = _share_offsets(comm, prepared.layouts, created)
    except BaseException:  # raised on every rank (the writers agree): leave no partial directory
        discard(comm, prepared)
        raise
    return prepared


def write(writer: StorageWriter, prepared: Prepared, items: Sequence[WriteItem], *,
          independent: bool = False, direct: bool = False) -> list[int]:
    """3. EACH rank: write its items, return their CRC-32Cs. ``independent``: no MPI (a
    background thread, a retry, one process); else ``writer.write``, which is collective when
    ``writer.collective_write`` (every rank must get here)."""
    if independent:
        return writer.write_independent(prepared.data_path, items, prepared.tuning, direct=direct)
    return writer.write(prepared.data_path, items, prepared.tuning)


@dataclass
class Written:
    """This rank's write of one save: done now (sync) or by a background thread (async)."""

    crcs: list[int] | None = None
    error: BaseException | None = None
    timeout_s: float | None = None
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.timeout_s is not None:
            self.deadline = time.monotonic() + self.timeout_s

    def finish(self, crcs: list[int] | None = None, error: BaseException | None = None) -> None:
        self.crcs, self.error = crcs, error
        self.done.set()

    def timed_out(self, step: int, rank: int) -> bool:
        if self.done.is_set() or self.deadline is None or time.monotonic() < self.deadline:
            return False
        if self.error is None:
            self.error = TimeoutError(
                f"the background write of step {step} did not finish within {self.timeout_s:g} s on "
                f"rank {rank} (hung filesystem or stuck process?)")
        return True


# What each rank contributes to the "finished writing?" MIN-allreduce of the commit.
_TIMED_OUT, _WRITING, _DONE_FAILED, _DONE_OK = -1.0, 0.0, 1.0, 2.0


class Commit:
    """4. ALL ranks: the commit of one save, as a sequence of non-blocking collectives;
    :meth:`run` completes them at once (the sync save), :meth:`step` one per call (the async
    save's ``poll``: each completes the collective every rank started at the previous call, so
    no training step waits for a slower rank to reach the same call):

    a. agree (MIN-allreduce) whether every rank finished writing, without error, and on the size
       of the largest commit message; repeated each step until all finished;
    b. gather every rank's commit message (CRCs, per-rank skeleton if changed) on rank 0, which
       seals the step (:func:`seal`: the manifest, the commit point; then retention);
    c. broadcast rank 0's outcome: committed, or failed.

    A failure anywhere (a rank's write, a timeout, the manifest) is raised on every rank as one
    CommError naming the failed ranks; the caller discards the step directory.
    """

    def __init__(self, comm: Comm, prepared: Prepared, written: Written, keep: int) -> None:
        self.comm, self.prepared, self.written, self.keep = comm, prepared, written, keep
        self.removed: list[int] = []      # steps retention removed (rank 0)
        self.manifest_s = 0.0
        self._block = False
        self._steps = self._run()

    def step(self, block: bool = False) -> bool:
        """Move the commit on (``block``: to its end); True once committed, on every rank at the
        same call. Raises the agreed error on failure."""
        self._block = block
        try:
            next(self._steps)
        except StopIteration:
            return True
        return False

    def run(self) -> list[int]:
        self.step(block=True)
        return self.removed

    def _completed(self, pending: Pending[T]) -> Generator[None, None, T]:
        """The result of ``pending``, at the next step or now (blocking). Every rank makes the
        same calls, so every rank completes it at the same one."""
        if not self._block:
            yield
        return pending.wait()

    def _run(self) -> Generator[None, None, None]:
        comm, prepared, written = self.comm, self.prepared, self.written
        data, blob = b"", None
        while True:  # a.
            if self._block and not written.done.is_set():
                written.done.wait(None if written.deadline is None else max(0.0, written.deadline - time.monotonic()))
            if written.done.is_set():
                flag = _DONE_FAILED if written.error is not None else _DONE_OK
            else:
                flag = _TIMED_OUT if written.timed_out(prepared.step, comm.rank) else _WRITING
            if flag == _DONE_OK and not data:  # this rank's commit message, made once
                try:
                    message, blob = commit_message(prepared, written.crcs)
                    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:  # noqa: BLE001 - agreed on like a failed write
                    written.error, flag = exc, _DONE_FAILED
            sent = len(data) if flag == _DONE_OK else 0
            agreed, longest = yield from self._completed(comm.iallreduce_min_array([flag, -sent]))
            if agreed != _WRITING:
                break
        if written.thread is not None and written.done.is_set():
            written.thread.join()
        if agreed != _DONE_OK:  # some rank failed or timed out: one error on every rank
            comm.check(written.error, f"writing checkpoint step {prepared.step}")
            raise AssertionError("the ranks agreed on success after a failure was reported")
        raw = yield from self._completed(comm.igather_bytes(data, int(-longest)))  # b.
        error: BaseException | None = None
        removed: list[int] = []
        t0 = time.perf_counter()
        if raw is not None:  # rank 0
            try:
                gathered = [pickle.loads(b) for b in raw]  # noqa: S301 - our own ranks' messages, over MPI
                commit_received(prepared, blob, gathered)
                removed = seal(comm.size, prepared, gathered, self.keep)
            except Exception as exc:  # noqa: BLE001 - every rank hears of it below
                error = exc
        else:
            commit_received(prepared, blob, None)
        self.manifest_s = time.perf_counter() - t0
        outcome = comm.ibcast_floats([0.0 if error is None else 1.0] if comm.rank == 0 else None, 1)
        (failed,) = yield from self._completed(outcome)  # c.
        if failed:  # the same CommError on every rank
            comm.check(error, f"committing checkpoint step {prepared.step}")
            raise AssertionError("rank 0 reported a failed manifest but no error")
        self.removed = removed  # rank 0's news (the others: [])


def discard(comm: Comm, prepared: Prepared) -> None:
    """On failure, ALL ranks: rank 0's catalog removes the directory of the save (nothing of
    it was committed)."""
    catalog = prepared.catalog
    assert catalog is not None
    comm.run_step(lambda: _on_rank0(comm, catalog.discard, prepared.step),
                  f"removing the failed step {prepared.step}")


def save_whole(writer: StorageWriter, root: Path, step: int, replicated: tuple[Any, Sequence[Leaf]],
               per_rank: Sequence[tuple[Any, Sequence[Leaf]]], tuning: IOTuning, keep: int, *,
               backend: str | None = None, extra: Mapping[str, Any] | None = None) -> Path:
    """One process, no MPI: the transaction for the checkpoint of a world of ``len(per_rank)``
    ranks whose pieces this process holds (the survivors' save): plan, create, write every
    rank's pieces, read them back and check their CRCs, seal; discard on failure.
    ``replicated``: (skeleton, leaves) of the replicated state; ``per_rank``: each rank's
    (per-rank skeleton, leaves): its per-rank leaves and its parts of state held in parts
    (``Sharded`` rows, DTensor leaves with their boxes: the memory tier's save). ``backend``,
    ``extra``: what the manifest records."""
    serial = Comm.serial()
    catalog = StepCatalog(root)  # this process alone writes: its catalog owns the step directory
    prepared = create(serial, writer, plan_whole(catalog, step, replicated, per_rank, tuning))
    prepared.backend = backend or prepared.backend
    prepared.extra = dict(extra or {})
    try:
        assert prepared.full is not None
        items: list[WriteItem] = []
        for r, (_, leaves) in enumerate(per_rank):
            arrays = {}
            for leaf in (*replicated[1], *leaves):
                if leaf.array is None:
                    raise ValueError(f"{leaf.name} is not in host memory (a device tensor): a save of "
                                     f"every rank by one process needs CPU copies")
                arrays[leaf.name] = leaf.array
            items += prepared.items(r, arrays, prepared.full.pieces_of(r))
        crcs = write(writer, prepared, items, independent=True)
        verify(prepared, items, crcs)
        gathered, at = [], 0
        for r, (skel, _) in enumerate(per_rank):
            n = len(prepared.full.pieces_of(r))
            gathered.append({"crcs": crcs[at:at + n], "per_rank": skel})
            at += n
        seal(len(per_rank), prepared, gathered, keep, background=False)
    except BaseException:
        discard(serial, prepared)
        raise
    return prepared.directory


def verify(prepared: Prepared, items: Sequence[WriteItem], crcs: Sequence[int]) -> None:
    """Read every item back from the file and check it against its CRC-32C (before it counts)."""
    fd = os.open(prepared.data_path, os.O_RDONLY)
    try:
        for it, crc in zip(items, crcs):
            buf = np.empty(it.buf.nbytes, dtype=np.uint8)
            if buf.nbytes:
                pread_into(fd, buf, it.offset)
            if integrity.checksum(buf) != crc:
                raise OSError(f"bytes {it.offset}..{it.offset + buf.nbytes} of {prepared.data_path} read back "
                              f"with a wrong checksum")
    finally:
        os.close(fd)


def _last_manifest(catalog: StepCatalog) -> dict[str, Any] | None:
    """Rank 0, first save of a manager: the newest manifest, whose layout may be reused."""
    step = catalog.latest()
    return None if step is None else cat.read_manifest(cat.step_dir(catalog.root, step))


def _share_offsets(comm: Comm, cache: LayoutCache, created: dict[int, int]) -> dict[int, int]:
    """Each rank's dataset offsets: rank 0 created the file, and scatters each rank the offsets
    of its own datasets, or nothing when they are unchanged since the last save."""
    def parts() -> list[dict[int, int] | None]:
        full = cache.full
        assert full is not None
        if cache.offsets == created:
            return [None] * comm.size
        return [{p.dataset: created[p.dataset] for p in full.pieces_of(r) if p.dataset in created}
                for r in range(comm.size)]

    got = comm.scatter(parts() if comm.rank == 0 else None)
    offsets = created if comm.rank == 0 else (cache.offsets if got is None else got)
    assert offsets is not None
    cache.offsets = offsets
    return offsets


def _same_offsets(prepared: Prepared, created: dict[int, int]) -> None:
    if created and any(created.get(i) != off for i, off in prepared.offsets.items()):
        raise CheckpointError(f"retrying step {prepared.step}: the datasets landed at other offsets",
                              hint="report this; save again under a new step")


def _on_rank0(comm: Comm, fn: Callable[..., Any], *args: Any) -> None:
    """The catalog is rank 0's: the other ranks only take part in the agreement."""
    if comm.rank == 0:
        fn(*args)


def commit_message(prepared: Prepared, crcs: list[int] | None) -> tuple[dict[str, Any], bytes | None]:
    """What this rank sends rank 0 for the commit (its CRCs and, when changed, its per-rank
    skeleton), and the skeleton's JSON form for :func:`commit_received`."""
    skeleton, blob = _skeleton_to_send(prepared)
    return {"crcs": crcs, "per_rank": skeleton}, blob


def commit_received(prepared: Prepared, blob: bytes | None, gathered: list[dict[str, Any]] | None) -> None:
    """After the commit gather: from now on this rank and rank 0 both know this skeleton."""
    cache = prepared.layouts
    if cache is not None:
        cache.sent_skeleton = blob
        for r, g in enumerate(gathered or ()):
            if g["per_rank"] is not None:
                cache.skeletons[r] = g["per_rank"]


def seal(world_size: int, prepared: Prepared, gathered: list[dict[str, Any]], keep: int, *,
         background: bool = True) -> list[int]:
    """Rank 0, no communication: write the manifest of ``prepared`` from every rank's commit
    message (the commit point, ``catalog.commit``), then apply retention; returns the steps
    removed."""
    assert prepared.full is not None
    cache = prepared.layouts
    if any(g["per_rank"] is None for g in gathered):
        assert cache is not None
        for r, g in enumerate(gathered):
            if g["per_rank"] is None:
                if r not in cache.skeletons:
                    raise CheckpointError(f"rank {r} sent no skeleton and none is cached",
                                          hint="report this; save again under a new step")
                g["per_rank"] = cache.skeletons[r]
    layout = prepared.full
    tensors = []
    for i, d in enumerate(layout.datasets):
        entry: dict[str, Any] = {"name": d.name, "dataset": d.path, "file": mf.DATA_FILE, "dtype": d.dtype,
                 "shape": list(d.shape), "kind": d.kind, "rank": None,
                 "nbytes": d.nbytes, "offset": prepared.offsets.get(i)}
        if d.kind == "per_rank":
            entry["parts"] = [[p.rank, p.start, list(p.shape), p.nbytes] for p in layout.parts[i]]
        elif d.kind == "dtensor":
            entry["boxes"] = [[r, list(o), list(sh)] for r, o, sh in layout.boxes[i]]
        tensors.append(entry)
    shards = shard_entries(layout, [g["crcs"] for g in gathered], mf.DATA_FILE)
    skel = {"replicated": prepared.skeletons["replicated"],
            "per_rank": {str(r): g["per_rank"] for r, g in enumerate(gathered)}}
    m = mf.build(step=prepared.step, world_size=world_size, tensors=tensors, shards=shards,
                 skeletons=skel, files=[mf.DATA_FILE], backend=prepared.backend,
                 extra={"lustre": prepared.tuning.lustre, "align": prepared.tuning.align, **prepared.extra,
                        "layout": {"align": prepared.tuning.align,
                                   "signatures": list(layout.signatures)}})
    assert prepared.catalog is not None
    prepared.catalog.commit(prepared.step, m)
    return prepared.catalog.retain(keep, background=background)


def _skeleton_to_send(prepared: Prepared) -> tuple[Any, bytes | None]:
    """(what this rank sends rank 0 as its per-rank skeleton, its JSON form): None when it is
    the one this rank sent at the last commit of the same manager (rank 0 still has it). The
    skeleton goes into the JSON manifest, so its JSON text is exactly what must not change; it
    also tells 1, 1.0 and True apart, which ``==`` does not."""
    skeleton = prepared.skeletons["per_rank"]
    if prepared.layouts is None:
        return skeleton, None
    blob = json.dumps(skeleton, separators=(",", ":")).encode()
    return (None if blob == prepared.layouts.sent_skeleton else skeleton), blob


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


def load(comm: Comm, root: Path, step: int, state: Mapping[str, Any], *, rng: bool = True) -> LoadResult:
    """Collective: every rank loads ``step`` into ``state`` in place (choosing the step, and
    falling back from a damaged one, is :mod:`.recovery`'s).

    Everything is checked (manifest, datasets, shapes and dtypes against ``state``, the saved
    trees against the objects they go into, the CRC of every byte) on every rank before the
    first byte goes into ``state``; objects whose ``load_state_dict`` refuses are rolled back
    (:func:`~coci_hpc.checkpoint.state.apply`). A failed load leaves the state as it was.
    """
    trees = current_trees(state)
    targets = dict(iter_targets(state, trees))
    local_rows = {n: t.local.shape[0] for n, t in targets.items() if isinstance(t, Sharded)}
    all_rows = comm.allgather(local_rows)
    boxes: dict[str, Any] = {}
    m, reader = _open_checked(comm, root, step, state, targets, all_rows, trees, boxes)
    chosen = step
    try:
        # Each rank reads the box its own DTensor targets hold; the ranks of a node share the
        # checks, so each needs the others' boxes.
        all_boxes = comm.allgather(boxes)
        ranges = _ranges(comm.rank, m, all_rows, all_boxes)
        # Pass 1: every byte any rank will install is checked (CRC of whole shards, straight
        # over the file's mapping) before any buffer of the state is touched, each shard once per
        # node (ranks of a node share the page cache); nothing is allocated per tensor.
        node, sharing = _node_ranks(comm)

        def check() -> set[tuple[str, int]]:
            mine, needed = _my_checks(comm.rank, node, m, reader, all_rows, all_boxes)
            reader.verify(mine)
            reader.prefetch(needed - mine)  # what the other ranks of the node check
            return needed

        needed = comm.run_step(check, f"checking checkpoint step {chosen}")
        reader.trust(needed)  # every rank checked its part, or all would have raised above
        # Pass 2: the checked bytes, still mapped, go straight into their final place (one memcpy).
        threads = copy_threads(sharing)
        return comm.run_step(lambda: _install(comm, m, state, reader, ranges, targets, rng, trees, threads),
                             f"loading checkpoint step {chosen} into the state")
    finally:
        reader.close()


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
        if t["kind"] != "per_rank":
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
    hint = "load into a state built like the one that was saved (same model, dtypes and sizes)"
    for meta in _my_tensors(m, rank):
        name, shape = meta["name"], tuple(meta["part"][1] if "part" in meta else meta["shape"])
        tgt = targets.get(name)
        if is_dtensor(tgt):
            assert tgt is not None
            if "part" in meta or meta["kind"] == "per_rank":
                raise CheckpointError(f"{name!r} is a DTensor in the state passed to load but per-rank "
                                      f"state in checkpoint step {step}", hint=hint)
            if tuple(tgt.shape) != shape or str(tgt.dtype) != meta["dtype"]:
                raise CheckpointError(f"DTensor {name!r} has global shape {list(tgt.shape)} ({tgt.dtype}) in "
                                      f"the state passed to load but {list(shape)} ({meta['dtype']}) in "
                                      f"checkpoint step {step}", hint="resharding changes how a tensor is "
                                      "split, not its global shape: build the model with the saved sizes")
            continue
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
                  targets: dict[str, Any], all_rows: list[dict[str, int]], trees: dict[str, Any],
                  boxes: dict[str, Any] | None = None) -> tuple[dict[str, Any], DatasetReader]:
    """Collective: read the manifest, open the data file, check everything; nothing written yet.

    Adds DTensor targets for a fresh optimizer's saved state to ``targets``
    (:func:`~coci_hpc.checkpoint.dtensor.optimizer_targets`) and this rank's box of every
    DTensor target to ``boxes``."""
    opened: list[DatasetReader] = []

    def step_fn() -> dict[str, Any]:
        m = cat.read_step(root, step)
        opened.append(DatasetReader(cat.step_dir(root, step) / mf.DATA_FILE, m))  # checks CRCs on read
        mine = _my_tensors(m, comm.rank)
        for meta in mine:
            opened[0].offset(meta)  # present, same shape/dtype/size as the manifest, inside the file
        match_saved_keys(state, {"replicated": m["skeletons"]["replicated"],
                                 "per_rank": m["skeletons"]["per_rank"].get(str(comm.rank), {})},
                         trees, targets)
        optimizer_targets(state, mine, targets)
        _check_against_state(m, comm.rank, state, targets, all_rows, trees)
        if boxes is not None:
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
        elif meta["kind"] == "sharded":
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
    """(shards this rank checks, shards it reads): the shards the ranks of a node read are
    dealt out among the ranks that read each, so a node checks each shard once. Each rank gets
    one contiguous run of the file (by bytes), so that every rank reads one sequential stream
    instead of skipping about (benchmark A/B on 2 ranks, two alternating runs each while a
    cluster test ran: restore_ratio 1.51 / 1.64 against 1.55 / 1.81 with shards dealt out in turn)."""
    needs = {r: reader.shards_of([(meta, start, start + n) for meta, rs, _, _ in _ranges(r, m, all_rows, all_boxes)
                                  for start, _, n in rs])
             for r in node}
    groups: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    for key in set().union(*needs.values()):
        groups.setdefault(tuple(r for r in node if key in needs[r]), []).append(key)
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


def _install(comm: Comm, m: dict[str, Any], state: Mapping[str, Any], reader: DatasetReader,
             ranges: list[tuple[dict[str, Any], Runs, tuple[int, ...], int]], targets: Mapping[str, Any],
             rng: bool, trees: Mapping[str, Any], threads: int = 1) -> LoadResult:
    """Put the checked bytes into the state: fresh buffers only where in place is not safe.

    The copies of each group run as one batch split over ``threads`` threads (see
    :meth:`~coci_hpc.checkpoint.h5file.DatasetReader.copy_verified`)."""
    tensors: dict[str, Any] = {}
    direct: list[tuple[dict[str, Any], Runs, np.ndarray]] = []
    after: list[tuple[dict[str, Any], Runs, tuple[int, ...], Any]] = []
    fresh: list[tuple[np.ndarray, int]] = []
    wrap: list[tuple[str, Any, torch.Tensor]] = []  # (leaf, DTensor target, its fresh local) after the fill
    to_device: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a module's live device shard, its checked host copy)
    in_place: set[int] = set()  # ids of the state's own tensors the checked bytes go into
    for meta, start, shape, _ in ranges:
        name = meta["name"]
        tgt = targets.get(name)
        how = _in_place(_owner(state, name)) if tgt is not None else None
        view = leaf_view(tgt, meta["dtype"], shape) if how else None
        if view is None:
            # A fresh buffer, never the live tensor: an object that refuses its state, or copies
            # it while loading, must see the checkpoint's bytes and leave the state as it was.
            obj, dest = empty_like_leaf(meta["dtype"], shape)
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
            after.append((meta, start, shape, _owner(state, name)))
    reader.copy_verified(fresh, threads)
    for name, tgt, obj in wrap:
        # Only now: from_local onto a mesh of another device (CUDA) copies the buffer at once, so
        # wrapping it before the fill handed the state uninitialised memory (issue 32).
        live = local_of(tgt)
        if made_for_load(tgt) and live.dtype == obj.dtype and live.shape == obj.shape:
            # a fresh optimizer's moment target (already on the device, not yet the state's):
            # filled in place, so the moments take their device memory once, not twice
            with torch.no_grad():
                live.copy_(obj)
            tensors[name] = tgt
        else:
            tensors[name] = wrap_like(tgt, obj, name)   # too little device memory: a CheckpointError

    def fill() -> None:
        """Called once every refusable object accepted its state: from here on nothing refuses."""
        pieces: list[tuple[np.ndarray, int]] = []
        for meta, start, view in direct:
            _plan(reader, pieces, meta, view, start)
        now: dict[int, dict[str, Any]] = {}
        cast: list[tuple[torch.Tensor, Any]] = []
        for meta, start, shape, owner in after:
            if id(owner) not in now:
                key = meta["name"].split("/", 2)
                now[id(owner)] = {}
                for tree in live_trees(state, owner):  # by position and, for an optimizer, by name
                    _collect_tensors(tree, f"{key[0]}/{key[1]}", now[id(owner)])
            live = now[id(owner)].get(meta["name"])
            live_view = leaf_view(live, meta["dtype"], shape)
            if live_view is not None:
                _plan(reader, pieces, meta, live_view, start)
                continue
            if not isinstance(live, torch.Tensor):
                raise CheckpointError(f"{meta['name']!r}: the optimizer dropped this tensor while loading",
                                      hint="report this; load with a freshly built optimizer")
            obj, dest = empty_like_leaf(meta["dtype"], shape)
            _plan(reader, pieces, meta, dest, start)
            cast.append((local_of(live) if is_dtensor(live) else live, obj))
        reader.copy_verified(pieces, threads)
        with torch.no_grad():
            for live, obj in to_device:
                # blocking: obj is pageable and dropped after the load; filled before apply began
                live.copy_(obj)
            for live, obj in cast:
                # the optimizer cast it (dtype/device): copy with the same cast; blocking (obj is
                # pageable and dropped right after), obj was filled just above
                live.copy_(obj)

    rank = comm.rank
    per_rank_skel = m["skeletons"]["per_rank"].get(str(rank), {})
    skeletons = {"replicated": m["skeletons"]["replicated"], "per_rank": per_rank_skel}
    with torch.no_grad():
        missing = apply(state, skeletons, tensors, rng=rng and str(rank) in m["skeletons"]["per_rank"],
                        before=trees, fill=fill, in_place=frozenset(in_place))
    if rng and str(rank) not in m["skeletons"]["per_rank"]:
        missing.append("__rng__")
    return LoadResult(int(m["step"]), int(m["world_size"]), tuple(missing), m,
                      sum(n for _, _, _, n in ranges))
