"""coci-ckpt: --json on every subcommand, --version, a fast --help, list marks a step with a
missing or short data file DAMAGED (never latest), export and import from the command line."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.cli.ckpt import main
from tests.conftest import ROOT, clean_env
from tests.interop.helpers import loaded_reference, same_bits, save_full


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    save_full(root, step=3)
    save_full(root, step=5, seed=2)
    return root


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out)


def test_json_on_list_verify_inspect(ck: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", str(ck), "--json"]) == 0
    doc = _json(capsys)
    assert doc["latest"] == 5 and [s["status"] for s in doc["steps"]] == ["committed", "latest"]
    assert main(["verify", str(ck), "--json"]) == 0
    assert [(s["step"], s["ok"]) for s in _json(capsys)["steps"]] == [(3, True), (5, True)]
    assert main(["inspect", str(ck), "5", "--json"]) == 0
    doc = _json(capsys)
    assert doc["step"] == 5 and any(t["tensor"] == "replicated/model/fc1.weight" for t in doc["tensors"])


@pytest.mark.parametrize("how", ["missing", "short"])
def test_list_marks_missing_or_short_data_damaged_not_latest(ck: Path, how: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    data = cat.step_dir(ck, 5) / mf.DATA_FILE
    if how == "missing":
        data.unlink()
    else:
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    assert main(["list", str(ck), "--json"]) == 7
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["latest"] == 3
    bad = doc["steps"][1]
    assert bad["status"] == "damaged" and ("missing" in bad["problem"] if how == "missing"
                                           else "shorter than" in bad["problem"])
    assert main(["list", str(ck)]) == 7
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "latest" in out.splitlines()[1] and "latest" not in out.splitlines()[2]


def test_version_and_help_do_not_import_torch() -> None:
    code = ("import sys\nfrom coci_hpc.cli.ckpt import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), cwd=ROOT,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("NO-TORCH") and "export" in p.stdout and "coci-ckpt (coci_hpc) " in p.stdout
    assert time.perf_counter() - t0 < 10


def test_export_and_import_from_the_command_line(ck: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    assert main(["export", str(ck), "--step", "3", "--to", "hf", str(out), "--max-shard-size", "3KB",
                 "--json"]) == 0
    doc = _json(capsys)
    assert doc["step"] == 3 and "model.safetensors.index.json" in doc["files"]
    ref = loaded_reference(ck, 3)["model"].state_dict()
    got = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert all(same_bits(got[k], v) for k, v in ref.items())
    assert main(["export", str(ck), "--to", "hf", str(out)]) == 2      # exists: usage error, untouched
    assert "never overwrites" in capsys.readouterr().err
    assert main(["import", str(out), str(tmp_path / "imp"), "--json"]) == 0
    assert _json(capsys)["tensors"] == len(ref)
    assert main(["export", str(tmp_path / "imp"), "--to", "torch", str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert all(same_bits(back[k], v) for k, v in ref.items())


def test_export_of_a_damaged_step_exits_7_and_leaves_nothing(ck: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    d = cat.step_dir(ck, 5)
    t = next(t for t in cat.read_manifest(d)["tensors"] if t["dataset"] == "replicated/model/fc2.bias")
    with open(d / mf.DATA_FILE, "r+b") as f:
        f.seek(t["offset"])
        f.write(b"\x00\x01\x02\x03")
    assert main(["export", str(ck), "--to", "hf", str(tmp_path / "hf")]) == 7
    assert "model.fc2.bias" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_verify_progress_shows_on_a_terminal_only(ck: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from coci_hpc.cli import ckpt

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    for tty, shown in ((Tty(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", tty)
        bar = ckpt._Progress("verifying step 5", after_s=0.0)
        assert ckpt.verify_step(ck, 5, bar) == []
        bar.end()
        text = tty.getvalue()
        assert ("verifying step 5:" in text and "(100%)" in text) is shown, text
