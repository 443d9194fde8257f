"""A coci_hpc error that escapes `python train.py` ends it as the coci-* tools end (issue 26 item 2):
one `train.py: error:` line and a hint, no traceback, the documented exit code (coci_hpc.errors);
any other exception keeps Python's traceback and status 1. A refused start is not the run's end."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from coci_hpc import history
from coci_hpc.errors import CheckpointOtherRun, UsageError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """\
import os, sys, torch, coci_hpc
m = torch.nn.Linear(2, 1)
s = coci_hpc.Session({'model': m}, int(os.environ['STEPS']), ckpt_dir=os.environ['CKPT'], policy='fixed:5')
for step in s.steps():
    s.observe(1.0 / (step + 1))
    if os.environ.get('BOOM') == str(step):
        raise ValueError('bad batch')
"""


def _run(tmp_path: Path, steps: int, *args: str, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                             "PYTHONPATH": str(ROOT), "STEPS": str(steps),
                                             "CKPT": str(tmp_path / "ck"), **env})


def test_refusals_are_one_line_and_their_exit_code(tmp_path: Path) -> None:
    assert _run(tmp_path, 10).returncode == 0
    other = _run(tmp_path, 10, "--lr", "3")            # another run's directory: CheckpointOtherRun
    assert other.returncode == CheckpointOtherRun.exit_code == 5, other.stderr
    lines = other.stderr.strip().splitlines()
    assert "Traceback" not in other.stderr
    assert lines[-2].startswith("train.py: error: checkpoint directory ") and "belongs to another run" in lines[-2]
    assert lines[-1].startswith("train.py: hint: ")

    fewer = _run(tmp_path, 5)                          # total_steps below the latest checkpoint: refused
    assert fewer.returncode == UsageError.exit_code == 2, fewer.stderr
    assert "Traceback" not in fewer.stderr and "train.py: error: total_steps=5 is lower" in fewer.stderr
    h = history.load(tmp_path / "ck", use_sacct=False)
    assert [a.ended for a in h.attempts] == ["completed", "refused"]
    assert h.status == "completed" and h.final_step == 10


def test_other_exceptions_keep_their_traceback(tmp_path: Path) -> None:
    p = _run(tmp_path, 10, BOOM="3")
    assert p.returncode == 1 and "Traceback" in p.stderr and "ValueError: bad batch" in p.stderr
