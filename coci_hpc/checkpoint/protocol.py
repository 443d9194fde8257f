"""The storage protocol: how the checkpoint engine talks to a file backend.

One save is one transaction, the same for the sync save, the async save and the async retry
(``CheckpointManager._save_once`` / ``TwoPhaseSaver`` / ``_async_failed``); which rank makes
each call (like torch.distributed.checkpoint's ``StorageWriter``)::

    0. before_save     RANK 0, then bcast: lock still held; from the step catalog
                       (:mod:`~coci_hpc.checkpoint.catalog`, the root listed once per manager):
                       rollback (newer steps -> abandoned/), duplicate or older step, partial
                       leftovers removed.
    1. prepare         ALL ranks (:func:`~coci_hpc.checkpoint.engine.prepare`):
       a. layout         one allreduce says whether any rank's leaves changed since the last
                         save; only then rank 0 gathers the descriptions, builds the
                         :class:`~coci_hpc.checkpoint.layout.Layout` and scatters each rank
                         its own pieces (:mod:`~coci_hpc.checkpoint.coordinator`).
       b. catalog.create RANK 0: the step directory (Lustre striping), agreed by all.
       c. writer.create  RANK 0 creates the file and every dataset (serial h5py), agreed by
                         all; it scatters each rank its datasets' offsets (nothing when unchanged).
    2. write           EACH rank its own pieces (``writer.write`` collective when
                       ``collective_write``, else pwrite, possibly in a background thread that
                       touches no MPI).
    3. commit          ALL ranks agree on success (one gather); RANK 0 writes the manifest
                       (``catalog.commit``: temp, fsync, rename, fsync dir), then
                       ``catalog.retain(keep)``; the removed steps are broadcast. The async
                       save makes the same moves with non-blocking collectives, one per
                       ``poll()`` (``TwoPhaseSaver._settle``: all written? -> gather ->
                       outcome); a failure there is agreed on by this blocking path.
    on failure         ALL ranks: ``engine.discard`` (rank 0's catalog removes the directory);
                       a full disk goes to the one no-space policy (``_with_space``: raise a
                       clear error, or with on_no_space="retire_oldest" ``catalog.free_space``
                       and run the transaction once more; an async save retries from its
                       snapshot: ``engine.recreate`` then 2-3).

File-system metadata operations of a save (rank 0 only; counted by
:func:`~coci_hpc.checkpoint.catalog.metadata_ops`): no listing after the first save, one step
directory and one data file created, the manifest created and renamed, and per retired step
one unlink and one rename: independent of the steps kept and of the number of ranks.

Loading (:func:`~coci_hpc.checkpoint.engine.load`): every rank opens the files read-only,
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
    name: str
    collective_write: bool

    def create(self, directory: Path, datasets: Sequence[DatasetSpec] | None, tuning: IOTuning
               ) -> dict[int, int]:
        """ALL ranks, collective: rank 0 creates the data file and ``datasets`` (given on rank 0
        only) and returns {index: offset}; the other ranks get {}."""
        ...

    def write(self, path: Path, items: Sequence[WriteItem], tuning: IOTuning) -> list[int]:
        """Write this rank's items and fsync; return their CRC-32Cs (see ``collective_write``)."""
        ...
