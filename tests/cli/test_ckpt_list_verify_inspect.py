"""coci-ckpt list / verify / inspect, including a corrupted shard."""
from __future__ import annotations

import subprocess
import sys

import pytest

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.cli.ckpt import main
from tests.checkpoint.helpers import full_state
from tests.conftest import ROOT, clean_env


@pytest.fixture
def ckdir(tmp_path):
    mgr = CheckpointManager(tmp_path, comm=None, keep=3)
    mgr.save(5, full_state(1))
    mgr.save(9, full_state(2))
    cat.step_dir(tmp_path, 12).mkdir()  # an uncommitted leftover
    return tmp_path


def test_list_shows_committed_latest_and_uncommitted(ckdir, capsys):
    assert main(["list", str(ckdir)]) == 0
    out = capsys.readouterr().out
    assert "latest" in out and "committed" in out and "UNCOMMITTED" in out
    assert [ln.split()[0] for ln in out.splitlines()[1:]] == ["5", "9", "12"]


def test_verify_ok_then_corruption_is_named_with_nonzero_exit(ckdir, capsys):
    assert main(["verify", str(ckdir)]) == 0
    assert "step 9: OK" in capsys.readouterr().out
    m = cat.read_manifest(cat.step_dir(ckdir, 9))
    t = next(t for t in m["tensors"] if t["dataset"] == "replicated/optimizer/state/fc1.weight/exp_avg")
    with open(cat.step_dir(ckdir, 9) / mf.DATA_FILE, "r+b") as f:
        f.seek(t["offset"] + 4)
        f.write(b"\xde\xad\xbe\xef")
    rc = main(["verify", str(ckdir), "9"])
    cap = capsys.readouterr()
    assert rc == 7
    assert "replicated/optimizer/state/fc1.weight/exp_avg" in cap.out and "written by rank 0" in cap.out
    assert "coci-ckpt: error: 1 bad shard" in cap.err
    assert main(["verify", str(ckdir), "5"]) == 0


def test_verify_reports_a_truncated_file(ckdir, capsys):
    path = cat.step_dir(ckdir, 5) / mf.DATA_FILE
    path.write_bytes(path.read_bytes()[:4096])
    assert main(["verify", str(ckdir), "5"]) == 7
    assert "CORRUPT" in capsys.readouterr().out


def test_inspect_lists_tensors_dtypes_bytes_ranks(ckdir, capsys):
    assert main(["inspect", str(ckdir), "9"]) == 0
    out = capsys.readouterr().out
    assert "world_size 1" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("replicated/model/bf16 "))
    assert "torch.bfloat16" in line and "3x5" in line and " 30 " in line and line.endswith(" 0")
    assert any(ln.startswith("per_rank/__rng__/torch") for ln in out.splitlines())


def test_cli_errors_have_exit_codes_and_run_as_module(tmp_path):
    p = subprocess.run([sys.executable, "-m", "coci_hpc.cli.ckpt", "inspect", str(tmp_path), "3"],
                       capture_output=True, text=True, cwd=ROOT, env=clean_env())
    assert p.returncode == 6 and "no manifest.json" in p.stderr and "hint" in p.stderr
    assert main(["list", str(tmp_path / "nope")]) == 6
