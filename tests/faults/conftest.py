"""Fixtures for the fault-injection suite: figures (kills tried, bad restores, corruptions,
undetected, ...) collected by the tests and printed as one table at the end of the pytest run, so
CI output shows them next to the pass/fail lines.

Usage in a test::

    def test_kills(record_figure):
        ...
        record_figure("kill -9, 2 ranks, async", tried=8, bad_restores=0)

Figures with the same name add up (so a parametrised test can report per case and the table
shows the totals); each row keeps its keys in the order first seen. The table itself is printed by
tests/conftest.py (tests/faults/figures.py), which pytest-xdist's controller loads, and which
gathers the figures of every worker.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from coci_hpc.checkpoint import CheckpointManager
from tests.checkpoint.helpers import full_state
from tests.faults import figures


@pytest.fixture
def record_figure() -> Callable[..., None]:
    """``record_figure(name, **numbers)``: add figures to the suite's summary table."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")

    def record(name: str, **values: int | float | str) -> None:
        if rank == "0":  # under mpiexec -n 2 both ranks run the test: count it once
            figures.add(name, **values)

    return record


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """Committed steps 1 and 2 of the full test state; each test module damages its own copy."""
    root = tmp_path_factory.mktemp("pristine")
    mgr = CheckpointManager(root, comm=None, keep=3)
    mgr.save(1, full_state(1))
    mgr.save(2, full_state(2))
    mgr.close()
    return root
