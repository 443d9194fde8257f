"""What a saved state is made of, for every module that collects, plans, writes or loads it: the
wrappers a user puts around values (:class:`PerRank`, :class:`Sharded`), the kinds of leaf
(:class:`LeafKind`), how a tensor's dtype is stored (:func:`storage_dtype`) and how a key becomes
an HDF5 name (:func:`escape_key`).

It imports nothing of the package but the errors and the enum base, so that ``state`` (which collects a state) and
the modules it uses (``dtensor``, ``layout``, ``optim_names``) can all import it without importing
each other back. numpy and torch are imported only when a dtype is looked up, so that the
manifest's checks (which the light CLI commands import) can name the kinds.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from coci_hpc.errors import CheckpointError
from coci_hpc.strenum import StrEnum

if TYPE_CHECKING:
    import numpy as np
    import torch


class LeafKind(StrEnum):
    """How a leaf is held across ranks. A string enum: a kind compares equal to (and is written to
    manifests as) its value, so ``"per_rank"`` in an existing manifest or in code is the same kind."""

    # The manifest's two skeleton sections are named by the kind of the values they hold:
    # REPLICATED (one tree) and PER_RANK (one tree per rank).
    REPLICATED = "replicated"   # identical on every rank, written once
    FROM_RANK0 = "from_rank0"   # replicated, rank 0's value is the authority (module buffers)
    PER_RANK = "per_rank"       # each rank's own (PerRank values, RNG states)
    SHARDED = "sharded"         # split along dim 0 across ranks (Sharded)
    DTENSOR = "dtensor"         # a box of one global tensor per rank (FSDP2, tensor parallel)
    # Formatted as the value ("per_rank"), not "LeafKind.PER_RANK" (StrEnum): names are built with f-strings.


@dataclass(frozen=True)
class PerRank:
    """Marks a state value as different on every rank (stored once per rank)."""

    value: Any


@dataclass
class Sharded:
    """A tensor split along dim 0 across ranks; ``local`` is this rank's rows, in rank order."""

    local: torch.Tensor


# The numpy kinds ever saved (float, signed, unsigned, bool, complex): raw bytes read into an
# object (pointer) array would be memory corruption, never a tensor.
NUMPY_KINDS = "fiubc"


@cache
def torch_dtypes() -> dict[str, tuple[np.dtype, torch.dtype]]:
    """torch dtype name -> (numpy dtype used for the stored bytes, torch dtype to view as on the way
    out). bfloat16, bool and the 8-bit floats have no exact numpy twin of the same meaning, so
    their bytes go out as unsigned integers of their width (the manifest keeps the torch dtype).
    Complex tensors (a Llama's rotary ``freqs_cis`` buffer) are stored as HDF5's complex
    compound, which h5py reads back as numpy complex."""
    import numpy as np
    import torch

    # one byte each; torch names the ones this build has (float8_e8m0fnu came in 2.7)
    bytes8 = {f"torch.{n}": (np.dtype("u1"), torch.uint8) for n in
              ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
               "float4_e2m1fn_x2") if hasattr(torch, n)}
    return {
        "torch.float64": (np.dtype("<f8"), torch.float64),
        "torch.float32": (np.dtype("<f4"), torch.float32),
        "torch.float16": (np.dtype("<f2"), torch.float16),
        "torch.bfloat16": (np.dtype("<u2"), torch.int16),
        "torch.int64": (np.dtype("<i8"), torch.int64),
        "torch.int32": (np.dtype("<i4"), torch.int32),
        "torch.int16": (np.dtype("<i2"), torch.int16),
        "torch.int8": (np.dtype("i1"), torch.int8),
        "torch.uint8": (np.dtype("u1"), torch.uint8),
        "torch.uint16": (np.dtype("<u2"), torch.uint16),
        "torch.uint32": (np.dtype("<u4"), torch.uint32),
        "torch.uint64": (np.dtype("<u8"), torch.uint64),
        "torch.bool": (np.dtype("u1"), torch.uint8),
        "torch.complex64": (np.dtype("<c8"), torch.complex64),
        "torch.complex128": (np.dtype("<c16"), torch.complex128),
        **bytes8,
    }


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a leaf saved as ``dtype`` ("torch.float32", "numpy.int64") is stored in."""
    import numpy as np

    table = torch_dtypes()
    if dtype in table:
        return table[dtype][0]
    if isinstance(dtype, str) and dtype.startswith("numpy."):
        try:
            dt = np.dtype(dtype[len("numpy."):])
        except TypeError:
            dt = None
        if dt is not None and dt.kind in NUMPY_KINDS:
            return dt.newbyteorder("<")
    raise CheckpointError(f"unsupported tensor dtype {dtype!r} in checkpoint",
                          hint="supported: " + ", ".join(sorted(table)) + ", numpy numeric")


def escape_key(key: str) -> str:
    """A key as one HDF5 path component ("/" separates groups; "." and ".." are special)."""
    key = key.replace("%", "%25").replace("/", "%2F")
    return {"": "%00", ".": "%2E", "..": "%2E%2E"}.get(key, key)
