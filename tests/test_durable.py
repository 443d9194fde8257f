"""coci_hpc.durable: the one rule for files replaced atomically (temp name, fsync, rename, fsync
of the directory), checked by watching the system calls it makes and by crashing it midway."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from coci_hpc import durable


@pytest.fixture
def syscalls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Records fsync (of which path), replace and rename, in order."""
    calls: list[tuple[str, str]] = []
    fds: dict[int, str] = {}
    real_open, real_fsync, real_replace, real_rename = os.open, os.fsync, os.replace, os.rename

    def open_(path, flags, mode=0o777, *a, **k):  # type: ignore[no-untyped-def]
        fd = real_open(path, flags, mode, *a, **k)
        fds[fd] = os.fspath(path)
        return fd

    def fsync(fd: int) -> None:
        calls.append(("fsync", fds.get(fd, "?")))
        real_fsync(fd)

    def replace(src, dst):  # type: ignore[no-untyped-def]
        calls.append(("replace", os.fspath(dst)))
        real_replace(src, dst)

    def rename(src, dst):  # type: ignore[no-untyped-def]
        calls.append(("rename", os.fspath(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    return calls


def test_write_atomic_fsyncs_the_file_then_renames_then_fsyncs_the_directory(tmp_path, syscalls):
    target = tmp_path / "state.json"
    target.write_text("old")
    durable.write_atomic(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    kinds = [k for k, _ in syscalls]
    assert kinds == ["fsync", "replace", "fsync"], syscalls
    tmp_name = Path(syscalls[0][1]).name
    assert tmp_name.startswith(".state.json.tmp.") and tmp_name != "state.json"   # hidden temp name
    assert syscalls[1][1] == str(target)
    assert syscalls[2][1] == str(tmp_path)                  # the directory, after the rename
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]   # no temporary file left


def test_the_mode_is_exact_not_masked_by_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        durable.write_atomic(tmp_path / "a", "x", mode=0o640)
        durable.write_atomic(tmp_path / "b", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o600   # 0o666 minus the umask


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "profile.json"
    target.write_text("old")

    def full_disk(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match="No space"):
        durable.write_atomic(target, b"new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


def test_a_short_write_is_never_renamed_into_place(tmp_path, monkeypatch):
    target = tmp_path / "m.json"
    monkeypatch.setattr(os, "write", lambda fd, data: 0)     # what a full disk can return
    with pytest.raises(OSError, match="returned 0"):
        durable.write_atomic(target, b"abc")
    monkeypatch.undo()
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_a_process_killed_mid_write_never_leaves_a_partial_file_under_the_final_name(tmp_path):
    """SIGKILL between the write and the rename (the fsync is made to hang): the final name is
    still the old file; only a hidden temporary name holds the new bytes."""
    target = tmp_path / "cache.json"
    target.write_text("old")
    code = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from coci_hpc import durable
def hang(fd):
    print("writing", flush=True)
    time.sleep(60)
os.fsync = hang
durable.write_atomic({str(target)!r}, b"new" * 1000)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "writing"
    p.kill()
    p.wait()
    assert target.read_text() == "old"
    others = [q.name for q in tmp_path.iterdir() if q.name != "cache.json"]
    assert len(others) == 1 and others[0].startswith(".cache.json" + durable.TMP_MARK), others


def test_rename_durable_fsyncs_the_parent_after_the_rename(tmp_path, syscalls):
    src = tmp_path / ".out.partial"
    src.mkdir()
    durable.rename_durable(src, tmp_path / "out")
    assert syscalls == [("rename", str(tmp_path / "out")), ("fsync", str(tmp_path))]
    assert (tmp_path / "out").is_dir()


def test_every_atomic_replacement_in_the_package_goes_through_durable():
    """No module but durable.py renames or replaces a file by itself (the lock takes its name
    with os.link, and the catalog's retention and rollback rename directories, which are not
    file contents; those are the listed exceptions)."""
    pkg = Path(__file__).resolve().parents[1] / "coci_hpc"
    # spare.py: a retired data file moved to the spare name and into a new step's directory,
    # whose data the save's write fsyncs and whose directory the commit fsyncs
    allowed = {"durable.py", "checkpoint/catalog.py", "checkpoint/lock.py", "checkpoint/spare.py"}
    offenders = []
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg).as_posix()
        if rel in allowed:
            continue
        text = path.read_text()
        if "os.replace(" in text or "os.rename(" in text:
            offenders.append(rel)
    assert offenders == [], offenders
