"""kill -9 at random moments during sync and async saves, on 1 and 2 ranks, of one rank and of
the whole job (issue 8's fault-injection suite). Each configuration runs a chain: start
``examples/train_resumable.py`` (resuming by itself), kill it, start again, ... then let the last
run finish. Every restart must resume from the newest committed checkpoint (read before it
starts) without any "damaged" warning, and the final parameters must be bit-exactly those of an
uninterrupted run. Figures: kills tried, bad restores (must be 0), kills that hit a save.

Half the kill moments are uniform over the run, half fall 0-10 ms after a new (uncommitted)
step directory appears, i.e. inside a save. ``COCI_FAULT_KILLS`` sets the kills per
configuration (default 8: 32 in all).
"""
from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

import pytest

from coci_hpc.checkpoint import catalog as cat
from tests.conftest import PARAM_HASH_RE
from tests.faults import jobs

pytestmark = pytest.mark.timeout(600)

KILLS = int(os.environ.get("COCI_FAULT_KILLS", "8"))
ARGS = ["--steps", "600", "--ckpt-every", "20", "--keep", "2", "--hidden", "256", "--step-sleep", "0.004"]
_REFERENCE: dict[int, str] = {}


def _hash(out: str) -> str | None:
    """The hash a killed run may not have printed (None), unlike tests.conftest.reference_hash."""
    m = PARAM_HASH_RE.search(out)
    return m.group(1) if m else None


def uninterrupted_hash(ranks: int, tmp: Path) -> str:
    """PARAM_HASH of an uninterrupted run (sync saves; saving never changes training)."""
    if ranks not in _REFERENCE:
        rc, out, err = jobs.start(ranks, tmp / f"reference{ranks}", *ARGS).finish(timeout=300)
        assert rc == 0 and _hash(out), out + err
        _REFERENCE[ranks] = _hash(out)  # type: ignore[assignment]
    return _REFERENCE[ranks]


def _wait_for_a_save(root: Path, timeout: float = 3.0) -> bool:
    """Return once a step directory newer than the newest commit exists (a save is under way)."""
    newest = cat.latest_step(root) or -1
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c.step > newest and not c.committed for c in cat.scan(root)):
            return True
        time.sleep(0.001)
    return False


def _resumed_from(out: str) -> int | None:
    m = re.search(r"^resumed from step (\d+) ", out, re.M)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("ranks,use_async", [(1, False), (1, True), (2, False), (2, True)],
                         ids=["1rank-sync", "1rank-async", "2ranks-sync", "2ranks-async"])
def test_kill9_during_saves_then_resume_is_bit_exact(ranks, use_async, tmp_path, tmp_path_factory,
                                                     record_figure):
    want = uninterrupted_hash(ranks, tmp_path_factory.getbasetemp())
    rng = random.Random(f"coci-kills-{ranks}-{use_async}")  # reproducible moments
    root = tmp_path / "ckpt"
    args = [*ARGS, *(["--async"] if use_async else [])]
    bad: list[str] = []
    tried = in_save = one_rank = 0
    for k in range(KILLS):
        newest = cat.latest_step(root)
        job = jobs.start(ranks, root, *args)
        if job.wait_line("saved step", timeout=120) is None:
            out, err = job.output()
            bad.append(f"launch {k}: no save before the run ended: {out[-500:]} {err[-1500:]}")
            continue
        if k % 2:
            hit = _wait_for_a_save(root)
            time.sleep(rng.uniform(0, 0.010))
        else:
            hit = False
            time.sleep(rng.uniform(0, 0.25))
        only = rng.randrange(ranks) if ranks > 1 and k % 4 >= 2 else None
        alive = job.proc.poll() is None
        job.kill(only_rank=only)
        out, err = job.output()
        if alive:
            tried += 1
            in_save += hit
            one_rank += only is not None
        if _resumed_from(out) != newest:
            bad.append(f"launch {k}: resumed from {_resumed_from(out)}, newest committed was {newest}")
        if "damaged" in err:
            bad.append(f"launch {k}: a damaged checkpoint after a kill: {err[-1500:]}")
    newest = cat.latest_step(root)
    rc, out, err = jobs.start(ranks, root, *args).finish(timeout=300)
    if rc != 0 or _resumed_from(out) != newest or "damaged" in err:
        bad.append(f"final run: rc {rc}, resumed from {_resumed_from(out)} (newest {newest}): {err[-1500:]}")
    if _hash(out) != want:
        bad.append(f"final parameters differ from the uninterrupted run ({_hash(out)} != {want})")
    record_figure(f"kill -9, {ranks} rank(s), {'async' if use_async else 'sync'}", kills=tried,
                  during_save=in_save, one_rank_only=one_rank, bad_restores=len(bad))
    assert not bad, "\n".join(bad)
    assert tried >= KILLS - 1  # the chain really killed running jobs
