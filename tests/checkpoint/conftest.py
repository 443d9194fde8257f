"""Fixtures for checkpoint tests that run the same under plain pytest, `mpiexec -n 1` and `-n 2`."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import ROOT, clean_env, run_ranks  # noqa: F401  (re-exported for the tests here)

FAKES = Path(__file__).resolve().parent / "fakes"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
