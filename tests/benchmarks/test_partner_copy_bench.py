"""benchmarks/partner_copy_bench.py still runs end to end (2 ranks, a few steps): it drives the
survivors' Survival directly, so a change to that API breaks it where no other test looks (a
rename of ``remove_hooks`` to ``close`` did, 2026-11-29)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_the_partner_copy_benchmark_runs_and_reports_every_mode() -> None:
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "partner_copy_bench.py"), "--steps", "150",
                        "--rounds", "1"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    report = json.loads(p.stdout[p.stdout.index("{"):p.stdout.rindex("}") + 1])
    assert set(report["ratio"]) == {"optimizer", "forward"}
    assert all(0 < r <= 1.5 for r in report["ratio"].values()), report["ratio"]
