"""Fixtures for the fault-injection suite: figures (kills tried, bad restores, corruptions,
undetected, ...) collected by the tests and printed as one table at the end of the pytest run, so
CI output shows them next to the pass/fail lines.

Usage in a test::

    def test_kills(record_figure):
        ...
        record_figure("kill -9, 2 ranks, async", tried=8, bad_restores=0)

Figures with the same name add up (so a parametrised test can report per case and the table
shows the totals); each row keeps its keys in the order first seen.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from coci_hpc.checkpoint import CheckpointManager
from tests.checkpoint.helpers import full_state

# name -> {key: value}; module-level because pytest_terminal_summary sees the config, not fixtures.
_FIGURES: dict[str, dict[str, int | float | str]] = {}


def _add(name: str, **values: int | float | str) -> None:
    row = _FIGURES.setdefault(name, {})
    for key, value in values.items():
        old = row.get(key)
        if isinstance(value, (int, float)) and isinstance(old, (int, float)) and not isinstance(value, bool):
            row[key] = old + value
        else:
            row[key] = value


@pytest.fixture
def record_figure() -> Callable[..., None]:
    """``record_figure(name, **numbers)``: add figures to the suite's summary table."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")

    def record(name: str, **values: int | float | str) -> None:
        if rank == "0":  # under mpiexec -n 2 both ranks run the test: count it once
            _add(name, **values)

    return record


def format_figures(figures: dict[str, dict[str, int | float | str]]) -> list[str]:
    """The figures as text lines: the scenario, then its figures as ``key=value`` (scenarios
    have different figures, so one column per key would be mostly empty)."""
    if not figures:
        return []
    width = max(len(name) for name in figures)
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    return [f"{name:<{width}}  " + "  ".join(f"{k}={fmt(v)}" for k, v in row.items())
            for name, row in figures.items()]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    lines = format_figures(_FIGURES)
    if not lines:
        return
    terminalreporter.section("fault-injection figures")
    for line in lines:
        terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """Committed steps 1 and 2 of the full test state; each test module damages its own copy."""
    root = tmp_path_factory.mktemp("pristine")
    mgr = CheckpointManager(root, comm=None, keep=3)
    mgr.save(1, full_state(1))
    mgr.save(2, full_state(2))
    mgr.close()
    return root
