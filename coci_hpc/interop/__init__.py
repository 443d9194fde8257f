"""Bridges between coci checkpoints and the formats other stacks read and write.

* :mod:`.export`: a committed coci checkpoint to Hugging Face safetensors, ``torch.save`` or a
  torch.distributed.checkpoint (DCP) directory, one tensor at a time, every byte checked
  against its shard's CRC before it is written;
* :mod:`.dcp_reader`: :class:`CociStorageReader`, a DCP ``StorageReader`` over a coci
  checkpoint, so ``dcp.load(state, storage_reader=CociStorageReader(DIR))`` reads it straight
  into any layout (DTensor targets read only their slice);
* :mod:`.pretrained`: load model weights from safetensors / torch.save / DCP into a model
  (DDP replica or FSDP2 shards), as ``Session(..., init_from=PATH)`` and ``coci-ckpt import`` do.

Imported lazily: ``import coci_hpc.interop`` costs nothing until a function is used.
"""
from __future__ import annotations

from typing import Any

__all__ = ["CociStorageReader", "export", "load_pretrained"]


def __getattr__(name: str) -> Any:
    if name == "export":
        from coci_hpc.interop.export import export
        return export
    if name == "CociStorageReader":
        from coci_hpc.interop.dcp_reader import CociStorageReader
        return CociStorageReader
    if name == "load_pretrained":
        from coci_hpc.interop.pretrained import load_pretrained
        return load_pretrained
    raise AttributeError(f"module 'coci_hpc.interop' has no attribute {name!r}")
