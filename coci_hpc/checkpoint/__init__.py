"""Sharded parallel-HDF5 checkpoints: atomic commit, resharding, two-phase async save."""
from coci_hpc.checkpoint.api import CheckpointManager, LoadResult
from coci_hpc.checkpoint.lustre import LustrePolicy
from coci_hpc.checkpoint.state import PerRank, Sharded

__all__ = ["CheckpointManager", "LoadResult", "LustrePolicy", "PerRank", "ResumableSampler", "Sharded"]


def __getattr__(name: str) -> object:
    # Compatibility: ResumableSampler moved to coci_hpc.runtime.data (it is data loading, not I/O);
    # imported lazily because that module imports this package's state module.
    if name == "ResumableSampler":
        from coci_hpc.runtime.data import ResumableSampler
        return ResumableSampler
    raise AttributeError(f"module 'coci_hpc.checkpoint' has no attribute {name!r}")
