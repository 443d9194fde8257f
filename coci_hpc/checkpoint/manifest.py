"""The checkpoint manifest: the JSON file whose presence marks a checkpoint committed.

Layout of a checkpoint root::

    ROOT/step_000000120/data.h5        HDF5 file(s) with the tensors (written first)
    ROOT/step_000000120/manifest.json  written last: temp name, fsync, rename, fsync dir

Only a step directory with ``manifest.json`` counts; "latest" is the committed one with the
highest step. Retention keeps the newest ``keep`` committed checkpoints and deletes older ones
(and uncommitted leftovers older than the newest commit) only after a newer one has committed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coci_hpc.errors import CheckpointCorrupt, CheckpointNotFound

FORMAT = "coci-ckpt"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DATA_FILE = "data.h5"
_STEP_RE = re.compile(r"^step_(\d{9,})$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:09d}"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    committed: bool


def scan(root: str | os.PathLike) -> list[CheckpointInfo]:
    """All step directories under ``root``, oldest first, committed or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir():
            out.append(CheckpointInfo(int(m.group(1)), entry, (entry / MANIFEST).is_file()))
    return sorted(out, key=lambda c: c.step)


def committed_steps(root: str | os.PathLike) -> list[int]:
    return [c.step for c in scan(root) if c.committed]


def latest_step(root: str | os.PathLike) -> int | None:
    steps = committed_steps(root)
    return steps[-1] if steps else None


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build(*, step: int, world_size: int, tensors: dict[str, Any], shards: list[dict[str, Any]],
          skeletons: dict[str, Any], files: list[str], backend: str, extra: dict[str, Any] | None = None,
          ) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "world_size": int(world_size),
        "wall_time": time.time(),
        "backend": backend,
        "checksum": "crc32",
        "files": files,
        "tensors": tensors,
        "shards": shards,
        "skeletons": skeletons,
        **(extra or {}),
    }


def commit(directory: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    """Write the manifest atomically: temp name, fsync, rename, fsync of the directory."""
    directory = Path(directory)
    final = directory / MANIFEST
    tmp = directory / f".{MANIFEST}.tmp.{os.getpid()}"
    data = json.dumps(manifest, separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(directory)
    return final


def read(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointNotFound(f"{directory} has no {MANIFEST}: it is not a committed checkpoint",
                                 hint="use `coci-ckpt list DIR` to see the committed steps")
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"{path}: manifest does not parse: {exc}",
                                hint="load an older step; this one is damaged") from exc
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("format_version"), int):
        raise CheckpointCorrupt(f"{path}: not a coci checkpoint manifest",
                                hint="point at a directory written by coci_hpc")
    if m["format_version"] > FORMAT_VERSION:
        raise CheckpointCorrupt(f"{path}: format version {m['format_version']} is newer than this "
                                f"coci_hpc understands ({FORMAT_VERSION})", hint="upgrade coci_hpc")
    problem = _schema_problem(m)
    if problem:
        raise CheckpointCorrupt(f"{path}: manifest is damaged or was edited: {problem}",
                                hint="load an older step (coci-ckpt list DIR); this one is damaged")
    return m


def _is_int(x: Any, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _is_file_name(x: Any) -> bool:
    return isinstance(x, str) and x not in ("", ".", "..") and "/" not in x and "\\" not in x


_KINDS = ("replicated", "per_rank", "sharded")


def _schema_problem(m: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a parsed manifest that readers rely on (None: fine)."""
    if not _is_int(m.get("step")):
        return "'step' is not a non-negative integer"
    if not _is_int(m.get("world_size"), 1):
        return "'world_size' is not a positive integer"
    if isinstance(m.get("wall_time"), bool) or not isinstance(m.get("wall_time"), (int, float)):
        return "'wall_time' is not a number"
    if not isinstance(m.get("backend"), str):
        return "'backend' is not a string"
    files = m.get("files")
    if not isinstance(files, list) or not all(_is_file_name(f) for f in files):
        return "'files' is not a list of file names inside the checkpoint directory"
    skel = m.get("skeletons")
    if not isinstance(skel, dict) or not isinstance(skel.get("replicated"), dict) \
            or not isinstance(skel.get("per_rank"), dict):
        return "'skeletons' lacks its 'replicated' and 'per_rank' sections"
    tensors, shards = m.get("tensors"), m.get("shards")
    if not isinstance(tensors, list) or not isinstance(shards, list):
        return "'tensors' or 'shards' is not a list"
    sizes: dict[tuple[str, str], int] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, dict):
            return f"tensors[{i}] is not an object"
        if not all(isinstance(t.get(k), str) for k in ("name", "dataset", "dtype")) \
                or t.get("file") not in files or t.get("kind") not in _KINDS \
                or not isinstance(t.get("shape"), list) or not all(_is_int(x) for x in t["shape"]) \
                or not _is_int(t.get("nbytes")) or not (t.get("rank") is None or _is_int(t.get("rank"))):
            return f"tensors[{i}] ({t.get('name')!r}) has a missing or invalid field"
        if t["kind"] == "per_rank" and t["rank"] is None:
            return f"tensors[{i}] ({t['name']!r}) is per-rank but names no rank"
        sizes[(t["file"], t["dataset"])] = t["nbytes"]
    for i, sh in enumerate(shards):
        if not isinstance(sh, dict) or not all(_is_int(sh.get(k)) for k in ("rank", "start", "stop", "crc32")):
            return f"shards[{i}] has a missing or invalid field"
        key = (sh.get("file"), sh.get("dataset"))
        if key not in sizes:
            return f"shards[{i}] names {key[0]}:{key[1]}, which is not a tensor of this manifest"
        if not sh["start"] <= sh["stop"] <= sizes[key]:
            return (f"shards[{i}] covers bytes [{sh['start']}, {sh['stop']}) outside {key[1]!r} "
                    f"({sizes[key]} bytes)")
    return None


def read_step(root: str | os.PathLike, step: int | None) -> dict[str, Any]:
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointNotFound(f"no committed checkpoint under {root}",
                                     hint="save one first, or check the directory")
    return read(step_dir(root, step))


_reaper: threading.Thread | None = None


def _reap(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def wait_for_deletions() -> None:
    if _reaper is not None:
        _reaper.join()


def apply_retention(root: str | os.PathLike, keep: int, *, background: bool = True) -> list[int]:
    """Delete all but the newest ``keep`` committed checkpoints, plus stale uncommitted ones.

    Called only right after a commit, so the newest checkpoint is always a committed one.
    A victim is first made uncommitted (manifest unlinked) and renamed to ``.trash-...``, both
    instant; its data is then removed by a background thread (unlinking GBs takes a while and
    must not stall training). Returns the steps removed.
    """
    global _reaper
    root = Path(root)
    infos = scan(root)
    committed = [c for c in infos if c.committed]
    if not committed:
        return []
    newest = committed[-1].step
    keep_steps = {c.step for c in committed[-max(1, keep):]}
    removed, trash = [], [p for p in root.glob(".trash-*") if p.is_dir()]
    for c in infos:
        stale_partial = not c.committed and c.step < newest
        if (c.committed and c.step not in keep_steps) or stale_partial:
            # Remove the manifest first so a crash midway never leaves a "committed" half.
            (c.path / MANIFEST).unlink(missing_ok=True)
            target = root / f".trash-{c.path.name}-{os.getpid()}-{time.monotonic_ns()}"
            try:
                os.rename(c.path, target)
            except OSError:
                target = c.path
            trash.append(target)
            removed.append(c.step)
    if trash:
        wait_for_deletions()
        if background:
            _reaper = threading.Thread(target=_reap, args=(trash,), name="coci-retention", daemon=True)
            _reaper.start()
        else:
            _reap(trash)
    return removed
