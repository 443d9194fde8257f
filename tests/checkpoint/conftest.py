"""Fixtures for checkpoint tests that run the same under plain pytest, `mpiexec -n 1` and `-n 2`."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.conftest import ROOT, clean_env, run_ranks  # noqa: F401  (re-exported for the tests here)

FAKES = Path(__file__).resolve().parent / "fakes"
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture
def group() -> Iterator[None]:
    """A real one-rank gloo process group (FSDP1, FSDP2 and ZeRO need one); an existing one is
    used as it is."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
