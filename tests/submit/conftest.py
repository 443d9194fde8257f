"""Fake Slurm client commands on PATH: sbatch records every call (and the script it was given)."""
from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

FAKE_SBATCH = """#!/bin/sh
n=$(ls "{rec}" | wc -l)
printf '%s\\n' "$@" > "{rec}/call$n.args"
for last; do :; done
cp "$last" "{rec}/call$n.sh"
echo "Submitted batch job 4242"
"""
FAKE_SINFO = """#!/bin/sh
{body}
"""


@dataclass
class FakeSlurm:
    bin: Path
    calls_dir: Path

    def sbatch_calls(self) -> list[str]:
        """The batch scripts sbatch was given, in order."""
        return [p.read_text() for p in sorted(self.calls_dir.glob("call*.sh"))]

    def sinfo(self, body: str) -> None:
        _script(self.bin / "sinfo", FAKE_SINFO.format(body=body))


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    bin_dir, rec = tmp_path / "fakebin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    rec.mkdir()
    _script(bin_dir / "sbatch", FAKE_SBATCH.format(rec=rec))
    _script(bin_dir / "srun", "#!/bin/sh\nexit 0\n")
    fake = FakeSlurm(bin_dir, rec)
    fake.sinfo("printf 'gpu*\\nurgent\\n'")
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print('hello')\n")
    monkeypatch.chdir(work)
    return fake
