"""A restart lists the checkpoint root once (issue 22): from ``Session(...)`` to the first step,
every question about the root (the latest committed step, the steps to fall back to, torn
survivors' saves, their staging to sweep, partial leftovers) is answered from the step catalog's
one listing, and ``events.jsonl`` is parsed once."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.runtime import events
from coci_hpc.runtime import survivors as sv
from coci_hpc.session import Session

pytestmark = pytest.mark.timeout(300)


def _state() -> tuple[dict[str, Any], Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> torch.Tensor:
        loss = model(torch.ones(3, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    return {"model": model, "optimizer": opt}, step


def _listings_of(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every directory listing of ``root`` (os.scandir, os.listdir, Path.iterdir, glob), whoever
    makes it: the calls are recorded with the path they list."""
    seen: list[str] = []
    real_root = os.path.realpath(root)
    real_scandir, real_listdir = os.scandir, os.listdir

    def note(path: Any, how: str) -> None:
        if isinstance(path, int):   # a directory fd (rmtree inside a tree): never the root's listing
            return
        if os.path.realpath(os.fspath(path)) == real_root:
            seen.append(how)

    def scandir(path: Any = ".") -> Any:
        note(path, "scandir")
        return real_scandir(path)

    def listdir(path: Any = ".") -> list[str]:
        note(path, "listdir")
        return real_listdir(path)

    monkeypatch.setattr(os, "scandir", scandir)   # also what glob and Path.glob list with
    monkeypatch.setattr(os, "listdir", listdir)   # also what Path.iterdir lists with
    return seen


def test_a_restart_lists_the_root_once_and_parses_the_event_log_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ck"
    state, train = _state()
    s = Session(state, 4, ckpt_dir=root, policy="fixed:2", environ={})
    for _ in s.steps():
        s.observe(train())
    assert cat.committed_steps(root)[-1] == 4
    # What a crashed attempt leaves behind, for the restart to find in its one listing: a
    # survivors' save killed before its manifest (staging + data without manifest) and the
    # partial directory of a regular save.
    sv.staging_dir(root, 5).mkdir()
    (sv.staging_dir(root, 5) / "claim").touch()
    cat.step_dir(root, 5).mkdir()
    cat.step_dir(root, 7).mkdir()

    seen = _listings_of(root, monkeypatch)
    parsed: list[str] = []
    real_counted = events.read_events_counted

    def counted(path: Any) -> Any:
        parsed.append(os.fspath(path))
        return real_counted(path)

    monkeypatch.setattr(events, "read_events_counted", counted)
    state, train = _state()
    s = Session(state, 8, ckpt_dir=root, policy="fixed:2", environ={})
    it = s.steps()
    assert next(it) == 4                                   # resumed from the newest committed step
    assert seen == ["scandir"], f"the restart listed the root {len(seen)} times: {seen}"
    assert len(parsed) == 1, f"events.jsonl parsed {len(parsed)} times before the first step"
    start = [e for e in events.read_events(root / events.FILENAME) if e["event"] == "attempt_start"][-1]
    assert start["torn_survivors_saves"] == [5]            # found in that one listing
    assert not sv.staging_dir(root, 5).exists()            # and swept from it
    s.observe(train())
    for _ in it:
        s.observe(train())
    assert cat.committed_steps(root)[-1] == 8
    assert not cat.step_dir(root, 5).exists() and not cat.step_dir(root, 7).exists()  # leftovers went
