"""Moved: :class:`ResumableSampler` is data loading and lives in :mod:`coci_hpc.runtime.data`.
This name stays for scripts that import it from here."""
from coci_hpc.runtime.data import ResumableSampler

__all__ = ["ResumableSampler"]
