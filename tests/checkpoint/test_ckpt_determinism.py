"""Acceptance: K steps + checkpoint + resume in a NEW process == 2K uninterrupted steps (hashes).

Uses examples/train_resumable.py (dropout + shuffled resumable loader, so RNG and loader
position matter), on 1 rank and data-parallel on 2 ranks, with sync and async saves.
"""
from __future__ import annotations

import pytest

from coci_hpc.planner.profile import Profile
from tests.checkpoint.conftest import ROOT, run_ranks
from tests.conftest import reference_hash

pytestmark = pytest.mark.timeout(240)
EXAMPLE = str(ROOT / "examples" / "train_resumable.py")
K = 40


@pytest.mark.parametrize("ranks,mode", [(0, "sync"), (2, "async")])
def test_resumed_run_matches_uninterrupted_run(tmp_path, ranks, mode):
    extra = ["--async"] if mode == "async" else []
    whole = reference_hash(run_ranks(ranks, EXAMPLE, "--steps", str(2 * K), "--ckpt-dir", str(tmp_path / "a"),
                                     "--ckpt-every", str(K), *extra).stdout)
    half = reference_hash(run_ranks(ranks, EXAMPLE, "--steps", str(K), "--ckpt-dir", str(tmp_path / "b"),
                                    "--ckpt-every", str(K), *extra).stdout)
    p = run_ranks(ranks, EXAMPLE, "--steps", str(2 * K), "--ckpt-dir", str(tmp_path / "b"),
                  "--ckpt-every", str(K), "--profile-out", str(tmp_path / "prof.json"), *extra)
    assert f"resumed from step {K}" in p.stdout
    assert half != whole
    assert reference_hash(p.stdout) == whole
    prof = Profile.load(str(tmp_path / "prof.json"))   # the planner's one profile format
    assert prof.steps == list(range(K + 1, 2 * K + 1)) and prof.total_steps == 2 * K
    assert prof.ckpt_cost_s > 0 and prof.step_time_s > 0 and prof.restart_cost_s is None


def test_resume_without_rng_restore_would_differ(tmp_path):
    """Guard that the test above can fail: dropout depends on the RNG the checkpoint restores."""
    import sys

    script = ("import sys, torch; sys.argv=['x','--steps','%d','--ckpt-dir','%s','--ckpt-every','%d'];"
              "import coci_hpc.checkpoint.restore as st; st.restore_rng=lambda s: None;"
              "import runpy; runpy.run_path('%s', run_name='__main__')")
    whole = reference_hash(run_ranks(0, EXAMPLE, "--steps", str(2 * K), "--ckpt-dir", str(tmp_path / "a"),
                                     "--ckpt-every", str(K)).stdout)
    run_ranks(0, EXAMPLE, "--steps", str(K), "--ckpt-dir", str(tmp_path / "b"), "--ckpt-every", str(K))
    p = run_ranks(0, "-c", script % (2 * K, tmp_path / "b", K, EXAMPLE))
    assert reference_hash(p.stdout) != whole
    del sys
