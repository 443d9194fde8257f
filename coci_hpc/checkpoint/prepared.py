"""One save after its planning: what this rank writes, and where (:class:`Prepared`).

Filled by the transaction's plan and create phases (:mod:`.transaction`), read by its write
and commit phases (:mod:`.commit`).
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.catalog import StepCatalog
from coci_hpc.checkpoint.coordinator import LayoutCache
from coci_hpc.checkpoint.layout import Layout, Piece, RankLayout
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.rawio import WriteItem
from coci_hpc.checkpoint.treecode import Leaf
from coci_hpc.errors import UsageError


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

