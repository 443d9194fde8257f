"""What every coci-* tool shares (issue 26, items 2, 6, 12): --version, one error line instead of a
traceback (a bad plot name, a closed pipe), one exit code for a missing directory, one plot flag
that writes where it says."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coci_hpc.cli import common, plan, status

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _events(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    recs = [{"v": 1, "event": "attempt_start", "wall": 1.7e9, "attempt": 1, "job_id": None, "nodes": [],
             "ranks": 1, "prev_end": {"reason": "none", "source": "none", "detail": "first attempt"},
             "resumed_step": None, "steps_lost": None},
            {"v": 1, "event": "losses", "wall": 1.7e9 + 5, "attempt": 1, "job_id": None,
             "steps": list(range(1, 2001)), "values": [1.0 / s for s in range(1, 2001)]},
            {"v": 1, "event": "end", "wall": 1.7e9 + 6, "attempt": 1, "job_id": None, "step": 2000,
             "status": "completed", "message": ""}]
    (d / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


@pytest.mark.parametrize("module", ["coci_hpc.cli.status", "coci_hpc.cli.plan", "coci_hpc.cli.submit",
                                    "coci_hpc.cli.ckpt"])
def test_every_tool_has_version(module: str) -> None:
    p = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True,
                       env=ENV, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith(common.version()) and "coci_hpc" in p.stdout


@pytest.mark.parametrize("main,argv", [
    (status.main, ["{d}", "--plot", "{d}/out.txt"]),
    (status.main, ["{d}", "--png", "{d}/out.txt"]),                 # the old name, same check
    (plan.main, ["--mtbf-hours", "4", "--plot", "{d}/x.txt"]),
])
def test_a_plot_name_that_is_no_image_is_one_error_line(main, argv, tmp_path: Path, capsys) -> None:
    d = _events(tmp_path / "run")
    assert main([a.format(d=d) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "error: cannot write a plot to" in err and "'.txt' is not an image format" in err
    assert "Traceback" not in err and "hint: name the file with one of .png, .pdf, .svg" in err
    assert not list(d.glob("out*")) and not list(d.glob("x*"))


def test_plot_goes_where_it_says(tmp_path: Path, capsys) -> None:
    d = _events(tmp_path / "run")
    # a name without a suffix: name.png, and the printed path is that file
    assert status.main([str(d), "--no-sacct", "--plot", str(tmp_path / "name")]) == 0
    out = capsys.readouterr().out
    assert f"loss plot: {tmp_path / 'name.png'}" in out and (tmp_path / "name.png").stat().st_size > 1000
    # a directory: history.png inside it, not DIR.png beside it
    pics = tmp_path / "pics"
    pics.mkdir()
    assert status.main([str(d), "--no-sacct", "--plot", str(pics)]) == 0
    assert f"loss plot: {pics / 'history.png'}" in capsys.readouterr().out
    assert (pics / "history.png").is_file() and not (tmp_path / "pics.png").exists()
    # coci-plan says where it wrote, in the table's output and in its JSON
    assert plan.main(["--mtbf-hours", "4", "--ckpt-cost", "5", "--horizon", "2h", "--plot", str(pics)]) == 0
    assert f"plot: {pics / 'plan.png'}" in capsys.readouterr().out and (pics / "plan.png").is_file()
    assert plan.main(["--mtbf-hours", "4", "--ckpt-cost", "5", "--horizon", "2h", "--json",
                      "--plot", str(tmp_path / "p.svg")]) == 0
    o = capsys.readouterr()
    assert json.loads(o.out)["plot"] == str(tmp_path / "p.svg") and str(tmp_path / "p.svg") in o.err
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")


def test_png_is_a_deprecated_alias_of_plot(tmp_path: Path, capsys) -> None:
    d = _events(tmp_path / "run")
    assert status.main([str(d), "--no-sacct", "--png", str(tmp_path / "h.png")]) == 0
    o = capsys.readouterr()
    assert (tmp_path / "h.png").is_file() and "--png is deprecated, use --plot" in o.err


def test_status_writes_nothing_unless_asked(tmp_path: Path, capsys) -> None:
    d = _events(tmp_path / "run")
    before = sorted(p.name for p in d.iterdir())
    assert status.main([str(d), "--no-sacct"]) == 0
    assert sorted(p.name for p in d.iterdir()) == before       # no history.png in the run's directory
    assert "loss plot" not in capsys.readouterr().out


def test_missing_directory_is_one_code_everywhere(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nope"
    assert status.main([str(missing), "--no-sacct"]) == 6
    err = capsys.readouterr().err
    assert f"coci-status: error: checkpoint directory {missing} does not exist" in err
    with pytest.raises(common.CheckpointNotFound) as e:
        common.require_dir(missing)
    assert e.value.exit_code == 6


@pytest.mark.parametrize("argv", [
    ["coci_hpc.cli.status", "{d}", "--json", "--no-sacct"],
    ["coci_hpc.cli.plan", "--mtbf-hours", "4", "--ckpt-cost", "0.5", "--horizon", "3d", "--json"],
])
def test_a_closed_pipe_is_no_traceback(argv, tmp_path: Path) -> None:
    d = _events(tmp_path / "run")
    cmd = [sys.executable, "-m"] + [a.format(d=d) for a in argv]
    # `| head -c 200`: the reader leaves after 200 bytes, long before the JSON ends
    p = subprocess.run(" ".join(cmd) + " | head -c 200 >/dev/null; echo \"rc=${PIPESTATUS[0]}\"",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, env=ENV,
                       timeout=300)
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr
    assert p.stdout.strip() in ("rc=0", f"rc={common.EXIT_PIPE}"), p.stdout


def test_json_convention_has_no_nan() -> None:
    import io
    from contextlib import redirect_stdout

    import numpy as np
    buf = io.StringIO()
    with redirect_stdout(buf):
        common.print_json({"a": float("nan"), "b": [np.float64(1.5), float("inf")], "c": np.int64(3)})
    assert json.loads(buf.getvalue()) == {"a": None, "b": [1.5, None], "c": 3}


# -- item 14: quick --help, progress on a terminal --------------------------------------------------
@pytest.mark.parametrize("module,argv,allowed", [
    ("coci_hpc.cli.status", ["--help"], ()),
    ("coci_hpc.cli.status", ["--version"], ()),
    ("coci_hpc.cli.plan", ["--version"], ()),
    ("coci_hpc.cli.plan", ["--help"], ("numpy",)),     # the policy names' module; no scipy, no torch
])
def test_help_and_version_import_nothing_heavy(module: str, argv: list[str], allowed: tuple[str, ...]) -> None:
    code = ("import sys, runpy\n"
            f"sys.argv = ['x', *{argv!r}]\n"
            "try:\n"
            f"    runpy.run_module({module!r}, run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'numpy', 'scipy', 'matplotlib', 'h5py') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stderr
    heavy = eval(p.stdout.split("HEAVY", 1)[1])
    assert set(heavy) <= set(allowed), heavy


def test_progress_only_on_a_terminal_and_only_when_slow(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import time
    monkeypatch.setattr(common, "on_terminal", lambda: True)
    with common.progress("coci-x", "verifying step 40", after_s=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert "coci-x: verifying step 40 ...\n" in err and re.search(r"coci-x: verifying step 40: \d+\.\d s\n", err)
    with common.progress("coci-x", "quick", after_s=5.0):
        pass
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(common, "on_terminal", lambda: False)   # a log file or a pipe: nothing
    with common.progress("coci-x", "slow", after_s=0.01):
        time.sleep(0.1)
    assert capsys.readouterr().err == ""
