"""The storage protocol: how the checkpoint engine talks to a file backend.

Call sequence for one save, and which rank makes each call (like torch.distributed.checkpoint's
``StorageWriter``)::

    1. layout          ALL ranks, main thread (:mod:`~coci_hpc.checkpoint.coordinator`): one
                       allreduce says whether any rank's leaves changed since the last save;
                       only then rank 0 gathers the descriptions, builds the
                       :class:`~coci_hpc.checkpoint.layout.Layout` and scatters each rank its
                       own pieces. Unchanged state reuses each rank's cached pieces.
    2. writer.create   ALL ranks, main thread, collective: make the step directory (Lustre
                       striping), create the data file and every dataset (with
                       ``collective_create`` every rank, with identical arguments; otherwise
                       rank 0 alone, which then scatters each rank its datasets' offsets).
    3. writer.write    EACH rank writes its own pieces. If ``writer.collective_write`` is true
                       every rank must call it together (main thread only); otherwise it is
                       independent and may run in a background thread (it touches no MPI).
    4. commit          ALL ranks agree on success (one allgather); the COORDINATOR (rank 0)
                       writes the manifest (temp, fsync, rename, fsync dir) and applies
                       retention; a barrier ends the save.

Loading needs no protocol step beyond reading: every rank opens the files read-only on its own.
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
    collective_create: bool

    def create(self, directory: Path, datasets: Sequence[DatasetSpec] | None, tuning: IOTuning
               ) -> dict[int, int]:
        """ALL ranks, collective: create the data file and ``datasets``; return {index: offset}
        of the datasets this rank created (all where ``collective_create``, else rank 0's)."""
        ...

    def write(self, path: Path, items: Sequence[WriteItem], tuning: IOTuning) -> list[int]:
        """Write this rank's items and fsync; return their CRC-32Cs (see ``collective_write``)."""
        ...
