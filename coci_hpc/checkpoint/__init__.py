"""Sharded parallel-HDF5 checkpoints: atomic commit, resharding, two-phase async save.

(``ResumableSampler`` is data loading: :mod:`coci_hpc.runtime.data`. Nothing here imports
:mod:`coci_hpc.runtime`, which builds on this package.)
"""
from coci_hpc.checkpoint.api import CheckpointManager, LoadResult
from coci_hpc.checkpoint.lustre import LustrePolicy
from coci_hpc.checkpoint.state import PerRank, Sharded

__all__ = ["CheckpointManager", "LoadResult", "LustrePolicy", "PerRank", "Sharded"]
