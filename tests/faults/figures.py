"""The fault-injection suite's figures (kills tried, bad restores, ...): recorded by the tests through
the ``record_figure`` fixture (tests/faults/conftest.py), printed as one table at the end of the
pytest run by tests/conftest.py. Under pytest-xdist each worker records its own; the controller
adds them up (:func:`merge`), so the table is the same as in one process."""
from __future__ import annotations

# name -> {key: value}; module-level because pytest_terminal_summary sees the config, not fixtures.
FIGURES: dict[str, dict[str, int | float | str]] = {}


def add(name: str, **values: int | float | str) -> None:
    """Numbers add up, other values replace; a row keeps its keys in the order first seen."""
    row = FIGURES.setdefault(name, {})
    for key, value in values.items():
        old = row.get(key)
        if isinstance(value, (int, float)) and isinstance(old, (int, float)) and not isinstance(value, bool):
            row[key] = old + value
        else:
            row[key] = value


def merge(other: dict[str, dict[str, int | float | str]]) -> None:
    """Add a worker's figures to these, as if its tests had run here."""
    for name, row in other.items():
        add(name, **row)


def format_figures(figures: dict[str, dict[str, int | float | str]]) -> list[str]:
    """The figures as text lines: the scenario, then its figures as ``key=value`` (scenarios
    have different figures, so one column per key would be mostly empty)."""
    if not figures:
        return []
    width = max(len(name) for name in figures)
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    return [f"{name:<{width}}  " + "  ".join(f"{k}={fmt(v)}" for k, v in row.items())
            for name, row in figures.items()]
