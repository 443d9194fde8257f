"""The storage protocol: how the save transaction talks to a file backend.

Every save is one :class:`~coci_hpc.checkpoint.transaction.SaveTransaction` (like
torch.distributed.checkpoint's ``StorageWriter``: plan -> create -> write -> commit, abort on
failure), and only these calls reach the backend. The sync save
(:func:`~coci_hpc.checkpoint.transaction.save`), the async save
(:class:`~coci_hpc.checkpoint.twophase.TwoPhaseSaver`: plan and create in ``start``, write in a
thread, commit stepped by ``poll``), the async retry (``CheckpointManager._async_failed``) and
the survivors' saves of both tiers (:func:`~coci_hpc.checkpoint.transaction.save_whole`, one
process) drive it; which rank makes each call::

    0. before_save     RANK 0, then bcast (``CheckpointManager._before_save``): lock still held;
                       from the step catalog (:mod:`~coci_hpc.checkpoint.catalog`, the root
                       listed once per manager): rollback (newer steps -> abandoned/), duplicate
                       or older step, partial leftovers removed.
    1. plan            ALL ranks: one allreduce says whether any rank's leaves changed since the
                       last save; only then rank 0 gathers the descriptions, builds the
                       :class:`~coci_hpc.checkpoint.layout.Layout` and scatters each rank its
                       own pieces (:mod:`~coci_hpc.checkpoint.coordinator`). (The survivors'
                       save: ``plan_whole``, every rank's pieces known to one process.)
    2. create          ALL ranks: RANK 0's catalog creates the step directory (Lustre
                       striping), agreed by all; ``writer.create``: rank 0 creates the file and
                       every dataset, agreed by all; it scatters each rank its datasets' offsets
                       (nothing when unchanged).
    3. write           EACH rank its own pieces: ``writer.write`` (collective when
                       ``collective_write``: every rank calls it) or ``writer.write_independent``
                       (no MPI: the async save's background thread, the async retry, the
                       survivors' save).
    4. commit          ALL ranks: agree every rank wrote (a MIN-allreduce), gather the commit
                       messages (CRCs, changed skeletons) on rank 0, which seals the step
                       (the manifest through ``catalog.write_manifest``: temp, fsync, rename,
                       fsync dir, in a thread when stepped; then ``catalog.retain(keep)``),
                       then agree on the outcome (a MIN-allreduce). One implementation:
                       ``Commit.run()`` blocks (the sync save), ``Commit.step()`` moves it on
                       at each ``poll()``, each non-blocking collective completed two calls
                       after it started (the async save).
    abort              ALL ranks, on failure: ``SaveTransaction.abort``, the one discard
                       (rank 0's catalog removes the directory);
                       a full disk goes to the one no-space policy
                       (``CheckpointManager._with_space``: raise a clear error, or with
                       on_no_space="retire_oldest" ``catalog.free_space`` and run the
                       transaction once more; an async save retries from its snapshot:
                       ``create(again=True)`` then 3-4).

(The one-process save writes with ``write_independent`` and, as its commit, reads every piece
back against its CRC before it seals: ``SaveTransaction.commit_whole``.)

File-system metadata operations of a save (rank 0 only; counted by
:func:`~coci_hpc.checkpoint.catalog.metadata_ops`): no listing after the first save, one step
directory and one data file created, the manifest created and renamed, and per retired step
one unlink and one rename: independent of the steps kept and of the number of ranks.

Fault injection for tests wraps a writer (``tests/faults/faulty.py``): it pauses or fails in
these calls; nothing in the transaction reads fault knobs.

Loading (:func:`~coci_hpc.checkpoint.load.load`): every rank opens the files read-only,
checks the manifest against its state, then (1) checks the CRC of every shard it will read,
each shard once per node, through two small reused buffers, and (2) only when every rank's
checks passed, copies the checked bytes into the state's own tensors.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from coci_hpc.checkpoint.layout import DatasetSpec
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.rawio import WriteItem


class StorageWriter(Protocol):
    name: str                 # the manifest's "backend"
    collective_write: bool    # ``write`` is collective: every rank must call it

    def create(self, directory: Path, datasets: Sequence[DatasetSpec] | None, tuning: IOTuning
               ) -> dict[int, int]:
        """ALL ranks, collective: rank 0 creates the data file and ``datasets`` (given on rank 0
        only) and returns {index: offset}; the other ranks get {}."""
        ...

    def write(self, path: Path, items: Sequence[WriteItem], tuning: IOTuning) -> list[int]:
        """EACH rank (ALL ranks when ``collective_write``): write this rank's items and fsync;
        return their CRC-32Cs."""
        ...

    def write_independent(self, path: Path, items: Sequence[WriteItem], tuning: IOTuning, *,
                          direct: bool = False) -> list[int]:
        """EACH rank, no MPI (safe from a background thread): ``pwrite`` the items and fsync;
        return their CRC-32Cs. ``direct``: whole aligned pages with O_DIRECT."""
        ...
