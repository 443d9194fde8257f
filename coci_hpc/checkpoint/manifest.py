"""The checkpoint manifest, pure format: build it, seal and write it, read and validate it.

A step directory holds the tensors' file(s) (``data.h5``, written first) and ``manifest.json``
(written last, durably: :func:`coci_hpc.durable.write_atomic`); the manifest's presence is what
makes a checkpoint committed. Where step directories live, how they are named, listed, retired
and discarded is the step catalog's (:mod:`~coci_hpc.checkpoint.catalog`), not this module's.

The manifest carries a CRC-32C of its own bytes (format 2, see
:mod:`~coci_hpc.checkpoint.integrity`); format-1 manifests (zlib CRC-32, no own checksum) are
still read. Files are created with the mode of their step directory minus the execute bits
(0600 under the default 0700 directories; see :mod:`~coci_hpc.checkpoint.perms`).
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from coci_hpc import durable
from coci_hpc.checkpoint import integrity, perms
from coci_hpc.checkpoint.leaves import LeafKind
from coci_hpc.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound

FORMAT = "coci-ckpt"
FORMAT_VERSION = 4                # 4: one "shards" entry per DTensor box ("box"), not per byte run
READABLE_VERSIONS = (1, 2, 3, 4)  # 3: per-rank leaves packed, one dataset per leaf with its "parts"
#                                   2: CRC-32C, one dataset per rank and per-rank leaf (rank00003/...)
#                                1: zlib CRC-32 shards ("crc32"), no own checksum
MAX_DEPTH = 64              # nesting of a manifest's arrays and objects: deeper is damage, not training state
MAX_NDIM = 32               # HDF5's own limit on dataset rank
MANIFEST = "manifest.json"
DATA_FILE = "data.h5"


def build(*, step: int, world_size: int, tensors: list[dict[str, Any]], shards: list[dict[str, Any]],
          skeletons: dict[str, Any], files: list[str], backend: str, extra: dict[str, Any] | None = None,
          ) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "world_size": int(world_size),
        "wall_time": time.time(),
        "backend": backend,
        "checksum": integrity.CHECKSUM,
        "files": files,
        "tensors": tensors,
        "shards": shards,
        "skeletons": skeletons,
        **(extra or {}),
    }


def commit(directory: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    """Seal the manifest with its own checksum and write it durably (:func:`coci_hpc.durable.write_atomic`:
    temp name, fsync, rename, fsync of the directory). Its mode follows the step directory's (not the umask)."""
    directory = Path(directory)
    data = json.dumps(integrity.seal(manifest), separators=(",", ":")).encode()
    mode = perms.file_mode(os.stat(directory).st_mode)  # the step directory's, minus x
    return durable.write_atomic(directory / MANIFEST, data, mode=mode)


def read(directory: str | os.PathLike, *, step: int | None = None) -> dict[str, Any]:
    """The validated manifest of a committed checkpoint; CheckpointCorrupt names what is wrong.

    ``step``: the step the manifest must say (the step catalog passes the one its directory's
    name says, :func:`~coci_hpc.checkpoint.catalog.read_manifest`); None: not checked.

    Format-1 manifests come back with their shard checksums under ``"crc"`` as well, so readers
    use ``m["checksum"]`` (the algorithm) and ``shard["crc"]`` whatever the format.
    """
    path = Path(directory) / MANIFEST
    if path.is_symlink():
        raise CheckpointCorrupt(f"{path} is a symbolic link", hint="a checkpoint's files are never "
                                "links; load an older step (coci-ckpt list DIR)")
    if not path.is_file():
        raise CheckpointNotFound(f"{directory} has no {MANIFEST}: it is not a committed checkpoint",
                                 hint="use `coci-ckpt list DIR` to see the committed steps")
    try:
        raw = path.read_bytes()
        if not raw.strip():
            raise ValueError("the file is empty")
        m = json.loads(raw)
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
        raise CheckpointCorrupt(f"{path}: manifest does not parse: {str(exc)[:200]}",
                                hint="load an older step; this one is damaged") from exc
    if not isinstance(m, dict) or m.get("format") != FORMAT or not _is_int(m.get("format_version")):
        raise CheckpointCorrupt(f"{path}: not a coci checkpoint manifest",
                                hint="point at a directory written by coci_hpc")
    if m["format_version"] > FORMAT_VERSION:
        raise CheckpointCorrupt(f"{path}: format version {m['format_version']} is newer than this "
                                f"coci_hpc understands ({FORMAT_VERSION})", hint="upgrade coci_hpc")
    problem = (f"format version {m['format_version']} was never written"
               if m["format_version"] not in READABLE_VERSIONS else None)
    if problem is None and _depth(raw) > MAX_DEPTH:
        problem = f"it is nested deeper than {MAX_DEPTH} levels"
    if problem is None and m["format_version"] >= 2:
        problem = integrity.seal_problem(m)
    problem = problem or _schema_problem(m)
    if problem is None and step is not None and step != m["step"]:
        problem = f"it says step {m['step']} but lives in {Path(directory).name}"
    if problem:
        raise CheckpointCorrupt(f"{path}: manifest is damaged or was edited: {problem}",
                                hint="load an older step (coci-ckpt list DIR); this one is damaged")
    key = integrity.SHARD_KEY[m["checksum"]]
    for sh in m["shards"]:
        sh["crc"] = sh[key]
    return m


def _is_int(x: Any, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _is_file_name(x: Any) -> bool:
    return isinstance(x, str) and x not in ("", ".", "..") and "/" not in x and "\\" not in x


_KINDS = (LeafKind.REPLICATED, LeafKind.PER_RANK, LeafKind.SHARDED, LeafKind.DTENSOR)


_STRING = re.compile(rb'"[^"]*"')  # a JSON string once its escaped quotes and backslashes are gone
_ONE_KIND = bytes.maketrans(b"{}", b"[]")
_NOT_QUOTE_OR_BRACKET = bytes(c for c in range(256) if c not in b'"[]{}')


def _depth(raw: bytes) -> int:
    """Nesting depth of the arrays and objects of JSON text ``raw`` that parsed, counted on the
    text, up to just past MAX_DEPTH: escaped backslashes and quotes go first (pairs from the
    left, as JSON pairs them), then everything but quotes and brackets, then the strings; each
    pass then removes the innermost pairs. Walking the parsed objects instead took 2.5 ms of the
    8 ms a 1 GB FSDP2 state's 38 KB manifest took to read (issue 33, the load's open)."""
    s = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(_ONE_KIND, _NOT_QUOTE_OR_BRACKET)
    s = _STRING.sub(b"", s)
    depth = 0
    while s and depth <= MAX_DEPTH:
        s = s.replace(b"[]", b"")  # not rescanned: one level per pass
        depth += 1
    return depth


def _is_dataset_path(x: Any) -> bool:
    """An HDF5 path inside the file as coci writes them: no empty, "." or ".." components."""
    return isinstance(x, str) and 0 < len(x) < 4096 and all(
        part not in ("", ".", "..") for part in x.lstrip("/").split("/")) and "\0" not in x


def _itemsize(dtype: Any) -> int | None:
    from coci_hpc.checkpoint.leaves import storage_dtype  # leaves imports numpy: only when reading

    try:
        return storage_dtype(dtype).itemsize
    except CheckpointError:
        return None


def _schema_problem(m: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a parsed manifest that readers rely on (None: fine)."""
    if not _is_int(m.get("step")):
        return "'step' is not a non-negative integer"
    if not _is_int(m.get("world_size"), 1):
        return "'world_size' is not a positive integer"
    if isinstance(m.get("wall_time"), bool) or not isinstance(m.get("wall_time"), (int, float)) \
            or not math.isfinite(m["wall_time"]) or not 0 <= m["wall_time"] < 1e11:
        return "'wall_time' is not a finite time stamp"
    if m.get("checksum") not in integrity.SHARD_KEY or \
            (m["format_version"] >= 2) != (m["checksum"] == integrity.CHECKSUM):
        return f"'checksum' names no algorithm of format {m['format_version']}"
    if not isinstance(m.get("backend"), str):
        return "'backend' is not a string"
    files = m.get("files")
    if not isinstance(files, list) or not all(_is_file_name(f) for f in files):
        return "'files' is not a list of file names inside the checkpoint directory"
    skel = m.get("skeletons")
    if not isinstance(skel, dict) or not isinstance(skel.get(LeafKind.REPLICATED), dict) \
            or not isinstance(skel.get(LeafKind.PER_RANK), dict):
        return "'skeletons' lacks its 'replicated' and 'per_rank' sections"
    tensors, shards = m.get("tensors"), m.get("shards")
    if not isinstance(tensors, list) or not isinstance(shards, list):
        return "'tensors' or 'shards' is not a list"
    sizes: dict[tuple[str, str], int] = {}
    dtensors: dict[tuple[str, str], tuple[dict[str, Any], int, set[Any]]] = {}  # (entry, itemsize, boxes)
    for i, t in enumerate(tensors):
        if not isinstance(t, dict):
            return f"tensors[{i}] is not an object"
        if not all(isinstance(t.get(k), str) for k in ("name", "dataset", "dtype")) \
                or not _is_dataset_path(t.get("dataset")) \
                or t.get("file") not in files or t.get("kind") not in _KINDS \
                or not isinstance(t.get("shape"), list) or not all(_is_int(x) for x in t["shape"]) \
                or not _is_int(t.get("nbytes")) or not (t.get("rank") is None or _is_int(t.get("rank"))):
            return f"tensors[{i}] ({t.get('name')!r}) has a missing or invalid field"
        packed = t["kind"] == LeafKind.PER_RANK and t["rank"] is None  # format 3: all ranks in one dataset
        itemsize = _itemsize(t["dtype"])
        if itemsize is None:
            return f"tensors[{i}] ({t['name']!r}) has dtype {t['dtype']!r}, which is never stored"
        if t["kind"] == LeafKind.DTENSOR and _boxes_problem(t):
            return f"tensors[{i}] ({t['name']!r}) {_boxes_problem(t)}"
        if packed and _parts_problem(t, itemsize, m["world_size"]):
            return f"tensors[{i}] ({t['name']!r}) {_parts_problem(t, itemsize, m['world_size'])}"
        if len(t["shape"]) > MAX_NDIM or math.prod(t["shape"] or [1]) * itemsize != t["nbytes"]:
            return (f"tensors[{i}] ({t['name']!r}) has shape {t['shape'][:MAX_NDIM]} of {t['dtype']} "
                    f"but says it holds {t['nbytes']} bytes")
        if (t["file"], t["dataset"]) in sizes:
            return f"tensors[{i}] ({t['name']!r}) names dataset {t['dataset']!r} a second time"
        sizes[(t["file"], t["dataset"])] = t["nbytes"]
        if t["kind"] == LeafKind.DTENSOR:
            dtensors[(t["file"], t["dataset"])] = (t, itemsize, {_box_key(b) for b in t["boxes"]})
    crc_key = integrity.SHARD_KEY[m["checksum"]]
    box_runs_of: dict[int, list[tuple[int, int]]] = {}  # id(shard) -> its runs: computed once
    for i, sh in enumerate(shards):
        if not isinstance(sh, dict) or not all(_is_int(sh.get(k)) for k in ("rank", "start", "stop", crc_key)) \
                or sh[crc_key] > 0xFFFFFFFF:
            return f"shards[{i}] has a missing or invalid field"
        key = (sh.get("file"), sh.get("dataset"))
        if key not in sizes:
            return f"shards[{i}] names {key[0]}:{key[1]}, which is not a tensor of this manifest"
        if not sh["start"] <= sh["stop"] <= sizes[key]:
            return (f"shards[{i}] covers bytes [{sh['start']}, {sh['stop']}) outside {key[1]!r} "
                    f"({sizes[key]} bytes)")
        if "box" in sh:
            problem = _box_shard_problem(sh, dtensors.get(key), m["format_version"], box_runs_of)
            if problem:
                return f"shards[{i}] {problem}"
    # Every byte of every tensor is under exactly one shard checksum: no unchecked bytes.
    ranges: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for sh in shards:
        key = (sh["file"], sh["dataset"])
        if "box" in sh:  # the box's runs (checked above to lie inside [start, stop))
            ranges.setdefault(key, []).extend((a, a + n) for a, n in box_runs_of[id(sh)])
        elif sh["stop"] > sh["start"]:
            ranges.setdefault(key, []).append((sh["start"], sh["stop"]))
    for key, size in sizes.items():
        pos = 0
        for a, b in sorted(ranges.get(key, [])):
            pos = b if a == pos else -1
        if pos != size:
            return f"the shards of {key[1]!r} do not cover its {size} bytes exactly once"
    return None


def box_runs(shape: list[int], box: list[list[int]], itemsize: int) -> list[tuple[int, int]]:
    """(first byte, bytes) of each contiguous run of a format-4 box shard in its dataset, in the
    local shard's C order: the order its CRC covers them in."""
    from coci_hpc.checkpoint.dtensor import runs  # dtensor imports torch: only when reading

    return [(a, n) for a, _, n in runs(shape, (tuple(box[0]), tuple(box[1])), itemsize)]


def shard_nbytes(sh: dict[str, Any], tensor: dict[str, Any]) -> int:
    """Bytes a shard's checksum covers (a box shard: its box, not the extent of its runs)."""
    if "box" not in sh:
        return int(sh["stop"] - sh["start"])
    return math.prod(sh["box"][1]) * (_itemsize(tensor["dtype"]) or 0)


def _box_key(b: list[Any]) -> tuple[Any, ...]:
    return (b[0], tuple(b[1]), tuple(b[2]))


def _box_shard_problem(sh: dict[str, Any], tensor: tuple[dict[str, Any], int, set[Any]] | None,
                       version: int, runs_of: dict[int, list[tuple[int, int]]]) -> str | None:
    """What is wrong with a box shard (format 4): one of its DTensor's boxes, written by the rank
    the tensor's "boxes" name, whose runs begin at ``start`` and end at ``stop``; its runs go
    into ``runs_of`` under ``id(sh)`` when nothing is."""
    if version < 4 or tensor is None:
        return "is a box shard of a tensor that is not a DTensor of a format-4 manifest"
    t, itemsize, boxes = tensor
    box = sh["box"]
    if not (isinstance(box, list) and len(box) == 2 and all(
            isinstance(x, list) and len(x) == len(t["shape"]) and all(_is_int(v) for v in x) for x in box)):
        return "has a malformed 'box'"
    if _box_key([sh["rank"], *box]) not in boxes:
        return f"names a box of rank {sh['rank']} that {t['name']!r} does not list"
    rs = box_runs(t["shape"], box, itemsize)
    if not rs or (sh["start"], sh["stop"]) != (rs[0][0], rs[-1][0] + rs[-1][1]):
        return f"says bytes [{sh['start']}, {sh['stop']}) but its box spans others"
    runs_of[id(sh)] = rs
    return None


def _boxes_problem(t: dict[str, Any]) -> str | None:
    """What is wrong with the "boxes" of a DTensor tensor: [writer rank, global offsets, local
    shape] each, inside the global shape (that they cover it exactly once is the shards' check)."""
    boxes, shape = t.get("boxes"), t["shape"]
    if not isinstance(boxes, list):
        return "is a DTensor but has no valid 'boxes' list"
    for b in boxes:
        if not (isinstance(b, list) and len(b) == 3 and _is_int(b[0]) and all(
                isinstance(x, list) and len(x) == len(shape) and all(_is_int(v) for v in x) for x in b[1:])):
            return "has a malformed entry in 'boxes'"
        if any(o + n > g for o, n, g in zip(b[1], b[2], shape)):
            return f"has a box of rank {b[0]} outside its shape"
    return None


def _parts_problem(t: dict[str, Any], itemsize: int, world: int) -> str | None:
    """What is wrong with the "parts" of a packed per-rank tensor (format 3): each saving rank's
    [rank, start byte, shape, bytes], inside the dataset, not overlapping, one per rank."""
    parts = t.get("parts")
    if not isinstance(parts, list) or len(parts) > world:
        return "is per-rank but has no valid 'parts' list"
    ranks, pos = set(), 0
    for p in parts:
        if not (isinstance(p, list) and len(p) == 4 and _is_int(p[0]) and _is_int(p[1]) and _is_int(p[3])
                and isinstance(p[2], list) and len(p[2]) <= MAX_NDIM and all(_is_int(x) for x in p[2])):
            return "has a malformed entry in 'parts'"
        if p[0] >= world or p[0] in ranks or p[1] < pos or p[1] + p[3] > t["nbytes"] \
                or math.prod(p[2] or [1]) * itemsize != p[3]:
            return f"has a part for rank {p[0]} that does not fit the dataset"
        ranks.add(p[0])
        pos = p[1] + p[3]
    return None
