"""checkpoint/leaves.py: the leaf kinds are a str enum that reads and writes as the strings the
manifests already hold, and the names that moved there have that one home."""
from __future__ import annotations

import json

import numpy as np
import pytest

from coci_hpc.checkpoint import leaves, state, treecode
from coci_hpc.checkpoint.leaves import LeafKind
from coci_hpc.errors import CheckpointError


def test_leaf_kinds_are_the_manifest_strings() -> None:
    assert [k.value for k in LeafKind] == ["replicated", "from_rank0", "per_rank", "sharded", "dtensor"]
    k = LeafKind.PER_RANK
    assert k == "per_rank" and "per_rank" == k and {"per_rank": 1}[k] == 1 and LeafKind("per_rank") is k
    assert f"{k}/x" == "per_rank/x" and str(k) == "per_rank" and json.dumps({k: k}) == '{"per_rank": "per_rank"}'


def test_moved_names_have_one_home() -> None:
    """The wrapper types are leaves' (and the package's public names); state (which collects a
    state) no longer keeps the old aliases of the dtype table and key escaping (issue 36)."""
    import coci_hpc.checkpoint as pkg

    assert pkg.PerRank is leaves.PerRank and pkg.Sharded is leaves.Sharded
    assert [n for n in ("storage_dtype", "_escape", "_TORCH_DTYPES", "_NUMPY_KINDS") if hasattr(state, n)] == []
    assert treecode._TORCH_DTYPES is leaves.torch_dtypes()


def test_storage_dtype_and_key_escaping() -> None:
    assert leaves.storage_dtype("torch.bfloat16") == np.dtype("<u2")
    assert leaves.storage_dtype("numpy.int32") == np.dtype("<i4")
    with pytest.raises(CheckpointError, match="unsupported tensor dtype 'numpy.object_'"):
        leaves.storage_dtype("numpy.object_")
    assert [leaves.escape_key(k) for k in ("a/b", "%", "", ".", "..")] == ["a%2Fb", "%25", "%00", "%2E", "%2E%2E"]
