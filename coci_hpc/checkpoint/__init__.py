"""Sharded parallel-HDF5 checkpoints: atomic commit, resharding, two-phase async save.

(``ResumableSampler`` is data loading: :mod:`coci_hpc.runtime.data`. Nothing here imports
:mod:`coci_hpc.runtime`, which builds on this package.)
"""
from coci_hpc.checkpoint.api import CheckpointManager, LoadResult
from coci_hpc.checkpoint.leaves import PerRank, Sharded
from coci_hpc.checkpoint.lustre import LustrePolicy

__all__ = ["CheckpointManager", "LoadResult", "LustrePolicy", "PerRank", "Sharded"]
