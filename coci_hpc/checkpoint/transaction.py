"""The save transaction: every kind of save drives one :class:`SaveTransaction` through its phases.

Phases, in order (the calls of the storage protocol, :mod:`.protocol`), and who calls them::

    1. plan     ALL ranks   agree on the layout: one allreduce when nothing changed since the
                            manager's last save, else a gather of the leaves' descriptions on
                            rank 0 and a scatter of each rank's pieces (:func:`.coordinator.agree`).
                            One process holding every rank's pieces: :meth:`~SaveTransaction.plan_whole`,
                            no communication.
    2. create   ALL ranks   rank 0's catalog makes the step directory (agreed: run_step);
                            ``writer.create`` makes the file and its datasets (collective);
                            a scatter of each rank's dataset offsets (none when unchanged).
    3. write    EACH rank   its own pieces: ``writer.write`` (collective when the writer's
                            ``collective_write``) or ``writer.write_independent`` (no MPI: the
                            async save's thread, the retry, one process); their CRC-32Cs.
    4. commit   ALL ranks   :class:`~.commit.Commit`: a MIN-allreduce (everyone wrote?), a
                            gather of the commit messages on rank 0, which seals the step (the
                            manifest, then retention), a bcast of the outcome. One process:
                            read every piece back, then seal (:meth:`~SaveTransaction.commit_whole`).
    abort       ALL ranks   any failure after plan: rank 0's catalog removes the step
                            directory (agreed: run_step). :meth:`~SaveTransaction.abort` is
                            the one place a save's directory is discarded.

The drivers: :func:`save` (the sync save: 1-4 at once), :class:`~.twophase.TwoPhaseSaver` (the
async save: 1-2 in ``start``, 3 in its thread, 4 stepped by ``poll``),
``CheckpointManager._async_failed`` (the async retry: 2 again, then 3-4 from the snapshot) and
:func:`save_whole` (the survivors' saves of both tiers: one process, no MPI).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint.catalog import StepCatalog
from coci_hpc.checkpoint.commit import Commit, Written, seal, verify
from coci_hpc.checkpoint.coordinator import LayoutCache, agree
from coci_hpc.checkpoint.layout import LeafDesc, make_layout
from coci_hpc.checkpoint.leaves import LeafKind
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.prepared import Prepared, check_step
from coci_hpc.checkpoint.protocol import StorageWriter
from coci_hpc.checkpoint.rawio import WriteItem, last_write_times
from coci_hpc.checkpoint.treecode import Leaf
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError

Progress = Callable[[str, bool], None]  # (phase, waiting for the other ranks): a watchdog's enter


class SaveTransaction:
    """One save of one step: :meth:`plan` (or :meth:`plan_whole`), :meth:`create`,
    :meth:`write`, :meth:`commit` (or :meth:`commit_whole`); :meth:`abort` on any failure."""

    def __init__(self, comm: Comm, writer: StorageWriter, prepared: Prepared, keep: int) -> None:
        self.comm, self.writer, self.prepared, self.keep = comm, writer, prepared, keep

    @property
    def step(self) -> int:
        return self.prepared.step

    @property
    def directory(self) -> Path:
        return self.prepared.directory

    # ------------------------------------------------------------------------ 1. plan
    @classmethod
    def plan(cls, comm: Comm, writer: StorageWriter, catalog: StepCatalog, layouts: LayoutCache, step: int,
             skeletons: dict[str, Any], leaves: Sequence[Leaf], tuning: IOTuning, keep: int) -> SaveTransaction:
        """1. ALL ranks: agree on the layout; nothing is created yet."""
        step = check_step(step)
        mine, full = agree(comm, leaves, tuning.align, layouts, last_manifest=lambda: _last_manifest(catalog))
        return cls(comm, writer, Prepared(step, cat.step_dir(catalog.root, step), mine, full, {},
                                          {l.name: l for l in leaves}, skeletons, tuning, "",
                                          dict(layouts.last), catalog, layouts), keep)

    @classmethod
    def plan_whole(cls, writer: StorageWriter, catalog: StepCatalog, step: int,
                   replicated: tuple[Any, Sequence[Leaf]], per_rank: Sequence[tuple[Any, Sequence[Leaf]]],
                   tuning: IOTuning, keep: int) -> SaveTransaction:
        """1. for one process that holds every rank's pieces (no communication): the layout of a
        world of ``len(per_rank)`` ranks, each with the ``replicated`` (skeleton, leaves) and its
        own (per-rank skeleton, leaves)."""
        skel, repl = replicated
        descs = [LeafDesc(l.name, l.dtype, l.shape, l.kind, l.nbytes, l.box) for l in repl]
        full = make_layout([descs + [LeafDesc(l.name, l.dtype, l.shape, l.kind, l.nbytes, l.box) for l in leaves]
                            for _, leaves in per_rank], align=tuning.align)
        prepared = Prepared(check_step(step), cat.step_dir(catalog.root, step), full.for_rank(0), full, {},
                            {l.name: l for l in repl}, {LeafKind.REPLICATED: skel, LeafKind.PER_RANK: None}, tuning, "", {},
                            catalog, None)
        return cls(Comm.serial(), writer, prepared, keep)

    # ---------------------------------------------------------------------- 2. create
    def create(self, *, again: bool = False) -> SaveTransaction:
        """2. ALL ranks: the step directory (rank 0's catalog), the file and its datasets
        (``writer.create``); each rank learns its offsets. ``again``: a retry of a failed save,
        whose datasets must land where they did. Aborts on failure."""
        comm, prepared = self.comm, self.prepared
        catalog = prepared.catalog
        assert catalog is not None
        comm.run_step(lambda: _on_rank0(comm, catalog.create, prepared.step, prepared.tuning),
                      f"creating the directory of step {prepared.step} in {catalog.root}")
        prepared.backend = self.writer.name
        with self.aborting():  # raised on every rank (the writers agree): leave no partial directory
            full = prepared.full
            created = self.writer.create(prepared.directory, None if full is None else full.datasets,
                                         prepared.tuning)
            if again:
                comm.run_step(lambda: _same_offsets(prepared, created), f"recreating the file of step {prepared.step}")
            elif prepared.layouts is None:
                prepared.offsets = created  # one process: it created them
            else:
                prepared.offsets = _share_offsets(comm, prepared.layouts, created)
        return self

    # ----------------------------------------------------------------------- 3. write
    def write(self, items: Sequence[WriteItem], *, independent: bool = False, direct: bool = False) -> list[int]:
        """3. EACH rank: write its items, return their CRC-32Cs. ``independent``: no MPI (a
        background thread, a retry, one process); else ``writer.write``, which is collective when
        ``writer.collective_write`` (every rank must get here). A failure here is agreed on in
        the commit, not raised to the other ranks."""
        p = self.prepared
        if independent:
            return self.writer.write_independent(p.data_path, items, p.tuning, direct=direct)
        return self.writer.write(p.data_path, items, p.tuning)

    # ---------------------------------------------------------------------- 4. commit
    def commit(self, written: Written) -> Commit:
        """4. ALL ranks: the commit of what ``written`` reports; ``run()`` it (blocking) or
        ``step()`` it (one non-blocking collective per call). Its failure is raised on every
        rank; the driver then calls :meth:`abort`."""
        return Commit(self.comm, self.prepared, written, self.keep)

    def commit_whole(self, items: Sequence[WriteItem], crcs: Sequence[int], skeletons: Sequence[Any]) -> None:
        """4. for one process (after :meth:`plan_whole`): read every item back against its
        CRC-32C, then seal the step with each rank's (CRCs, per-rank skeleton)."""
        p = self.prepared
        assert p.full is not None
        verify(p, items, crcs)
        gathered, at = [], 0
        for r, skel in enumerate(skeletons):
            n = len(p.full.pieces_of(r))
            gathered.append({"crcs": list(crcs[at:at + n]), LeafKind.PER_RANK: skel})
            at += n
        seal(len(skeletons), p, gathered, self.keep, background=False)

    # ------------------------------------------------------------------------- abort
    def abort(self) -> None:
        """ALL ranks, on any failure after :meth:`plan`: rank 0's catalog removes the directory
        of the save (nothing of it was committed). The only discard of a save."""
        comm, prepared = self.comm, self.prepared
        catalog = prepared.catalog
        assert catalog is not None
        comm.run_step(lambda: _on_rank0(comm, catalog.discard, prepared.step),
                      f"removing the failed step {prepared.step}")

    @contextlib.contextmanager
    def aborting(self) -> Iterator[None]:
        """Abort the transaction if the body raises (anything: also an interrupt), then re-raise."""
        try:
            yield
        except BaseException:
            self.abort()
            raise

    # ---------------------------------------------------------- 3-4 at once, blocking
    def write_and_commit(self, items: Callable[[], Sequence[WriteItem]], *, independent: bool = False,
                         progress: Progress | None = None) -> list[int]:
        """Collective, blocking: phases 3-4 of a created save (the sync save, the async retry);
        aborts on failure. Returns the steps retention removed (rank 0)."""
        prepared = self.prepared
        with self.aborting():
            written = Written()
            clock = time.perf_counter
            t0 = t1 = clock()
            try:
                if progress is not None:
                    progress("writing its data", False)
                data = items()
                t1 = clock()
                written.finish(self.write(data, independent=independent))
            except Exception as exc:  # noqa: BLE001 - agreed on in the commit
                written.finish(error=exc)
            t2 = clock()
            if progress is not None:
                progress("waiting for the other ranks to commit", True)
            commit = self.commit(written)
            removed = commit.run()
            io = last_write_times()  # the writer's own split of its time: the data, then the sync
            prepared.stats.update(collect_s=t1 - t0, write_s=io.get("write_s", t2 - t1),
                                  sync_s=io.get("sync_s", 0.0), commit_s=clock() - t2, manifest_s=commit.manifest_s)
            return removed


# ------------------------------------------------------------------------------- the drivers
def save(comm: Comm, writer: StorageWriter, catalog: StepCatalog, layouts: LayoutCache, step: int,
         skeletons: dict[str, Any], leaves: Sequence[Leaf], tuning: IOTuning, keep: int,
         progress: Progress | None = None, stats: dict[str, float] | None = None) -> Path:
    """Collective, blocking: the sync save, the whole transaction; returns the step directory.
    ``stats`` receives this rank's time in each phase (``plan_s``, ``create_s``, ``collect_s``,
    ``write_s``, ``sync_s``, ``commit_s``, ``manifest_s``)."""
    t0 = time.perf_counter()
    tx = SaveTransaction.plan(comm, writer, catalog, layouts, step, skeletons, leaves, tuning, keep)  # 1.
    t1 = time.perf_counter()
    tx.create()                                                                                       # 2.
    tx.prepared.stats.update(plan_s=t1 - t0, create_s=time.perf_counter() - t1)
    # 3-4; every rank agrees that it has its data before any collective write starts.
    tx.write_and_commit(lambda: comm.run_step(lambda: tx.prepared.items(comm.rank),
                                              f"collecting the data of step {tx.step}"), progress=progress)
    if stats is not None:
        stats.update({k: v for k, v in tx.prepared.stats.items() if k.endswith("_s")})
    return tx.directory


def save_whole(writer: StorageWriter, catalog: StepCatalog, step: int, replicated: tuple[Any, Sequence[Leaf]],
               per_rank: Sequence[tuple[Any, Sequence[Leaf]]], tuning: IOTuning, keep: int, *,
               backend: str | None = None, extra: Mapping[str, Any] | None = None) -> Path:
    """One process, no MPI: the transaction for the checkpoint of a world of ``len(per_rank)``
    ranks whose pieces this process holds (the survivors' saves of both tiers): plan, create,
    write every rank's pieces, read them back and seal; abort on failure. ``replicated``:
    (skeleton, leaves) of the replicated state; ``per_rank``: each rank's (per-rank skeleton,
    leaves): its per-rank leaves and its parts of state held in parts (``Sharded`` rows,
    DTensor leaves with their boxes: the memory tier's save). ``catalog``: the one of the
    root's writer in this process (``CheckpointManager.catalog``). ``backend``, ``extra``:
    what the manifest records."""
    # Listed afresh (what a new catalog does at its first use): in a survivor that is not rank 0
    # the manager's catalog never saw what rank 0 wrote since.
    catalog.refresh()
    tx = SaveTransaction.plan_whole(writer, catalog, step, replicated, per_rank, tuning, keep)  # 1.
    tx.create()                                                                                 # 2.
    p = tx.prepared
    p.backend = backend or p.backend
    p.extra = dict(extra or {})
    with tx.aborting():
        assert p.full is not None
        items: list[WriteItem] = []
        for r, (_, leaves) in enumerate(per_rank):
            arrays = {}
            for leaf in (*replicated[1], *leaves):
                if leaf.array is None:
                    raise ValueError(f"{leaf.name} is not in host memory (a device tensor): a save of "
                                     f"every rank by one process needs CPU copies")
                arrays[leaf.name] = leaf.array
            items += p.items(r, arrays, p.full.pieces_of(r))
        crcs = tx.write(items, independent=True)                                                # 3.
        tx.commit_whole(items, crcs, [skel for skel, _ in per_rank])                            # 4.
    return tx.directory


# ----------------------------------------------------------------------------- helpers
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
