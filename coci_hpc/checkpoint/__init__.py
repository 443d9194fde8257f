"""Sharded parallel-HDF5 checkpoints: atomic commit, resharding, two-phase async save."""
from coci_hpc.checkpoint.api import CheckpointManager, LoadResult
from coci_hpc.checkpoint.data import ResumableSampler
from coci_hpc.checkpoint.lustre import LustrePolicy
from coci_hpc.checkpoint.state import PerRank, Sharded

__all__ = ["CheckpointManager", "LoadResult", "LustrePolicy", "PerRank", "ResumableSampler", "Sharded"]
