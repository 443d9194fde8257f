"""On a machine with CUDA: the state matrix saved from and loaded into the GPU (no fake), the
FSDP2 checkpoint read by a plain CPU process. Skipped without CUDA (marker ``cuda``); the whole
device check is ``bash tests/gpu/run``."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.check import matrix

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run bash tests/gpu/run on a GPU)")]


def test_state_matrix_on_the_gpu(tmp_path: Path) -> None:
    got = matrix("cuda", tmp_path)
    assert got["ok"], got
