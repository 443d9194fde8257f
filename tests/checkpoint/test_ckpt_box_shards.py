"""Format 4: one manifest shard (one CRC-32C) per DTensor box, not one per byte run.

A column-sharded box (tensor parallel's RowwiseParallel weight, ``Shard(1)``) is one contiguous
byte run per row in the global dataset; format 3 gave each run its own shard entry. Real
processes (``mpiexec -n 1/2 --oversubscribe``, gloo, real ``parallelize_module`` /
``fully_shard``) save and load; full tensors are compared on both sides.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import crc32c
import pytest

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import integrity
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.integrity import Combiner, seal
from coci_hpc.cli.ckpt import main as ckpt_main
from coci_hpc.errors import CheckpointCorrupt
from tests.checkpoint.conftest import SCRIPTS, run_ranks

JOB = str(SCRIPTS / "box_job.py")
FC2 = "replicated/model/fc2.weight"  # RowwiseParallel: Shard(1) of a 6 x 8 weight


def job(n: int, *args: Any) -> dict[str, Any]:
    p = run_ranks(n, JOB, *map(str, args), timeout=180)
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_combiner_matches_the_crc_of_the_concatenation() -> None:
    comb = Combiner()
    # [4096] * 40: past _TABLE_AFTER runs of one length, so both the direct shift and the table
    # fold; each case twice (the shifts and tables are kept for the process); the zero-length
    # and leading parts take the no-shift path (a CRC folded onto nothing).
    for sizes in ([0], [1], [5, 0, 7], [4096] * 9, [4096] * 40, [0, 0, 3], [3, 1 << 16, 11, 1]):
        parts = [os.urandom(n) for n in sizes]
        want = crc32c.crc32c(b"".join(parts))
        for _ in range(2):
            assert comb.fold([(crc32c.crc32c(p), len(p)) for p in parts]) == want
    flipped = bytearray(b"".join(parts))
    flipped[5] ^= 1
    assert crc32c.crc32c(bytes(flipped)) != want


def _rows_of(m: dict[str, Any], dataset: str) -> list[dict[str, Any]]:
    return [s for s in m["shards"] if s["dataset"] == dataset]


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp")
    job(2, "save", root, "tp", 1)
    return root, job(2, "save", root, "tp", 2)


def test_a_column_sharded_box_is_one_shard(tp: tuple[Path, dict[str, Any]]) -> None:
    root, _ = tp
    m = cat.read_step(root, 2)
    assert m["format_version"] == mf.FORMAT_VERSION == 4
    w = next(t for t in m["tensors"] if t["dataset"] == FC2)
    assert w["shape"] == [6, 8]
    shards = _rows_of(m, FC2)
    # two boxes (4 columns each, 6 rows: 6 runs each in the file), one entry each
    assert sorted((s["rank"], tuple(s["box"][0]), tuple(s["box"][1])) for s in shards) == \
        [(0, (0, 0), (6, 4)), (1, (0, 4), (6, 4))]
    # the entry's CRC is that of the local shard's C-order bytes, read here run by run
    data = (cat.step_dir(root, 2) / mf.DATA_FILE).read_bytes()
    for s in shards:
        c = s["box"][0][1]
        local = b"".join(data[w["offset"] + (r * 8 + c) * 4:w["offset"] + (r * 8 + c + 4) * 4] for r in range(6))
        assert crc32c.crc32c(local) == s["crc32c"]
        assert (s["start"], s["stop"]) == (c * 4, (5 * 8 + c + 4) * 4)


def test_tp_loads_bit_exactly_on_tp_fsdp_and_one_plain_process(tp: tuple[Path, dict[str, Any]]) -> None:
    root, saved = tp
    for n, layout in ((2, "tp"), (2, "fsdp"), (1, "plain")):
        loaded = job(n, "load", root, layout)
        assert loaded["step"] == 2
        assert loaded["hashes"] == saved["hashes"], layout


def test_coci_ckpt_verify_checks_box_shards(tp: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = tp
    assert ckpt_main(["verify", str(root), "2"]) == 0


def _flip(root: Path, step: int, dataset: str, col: int, row: int) -> None:
    """Flip one byte of the float32 at [row, col] of ``dataset`` (row > 0: inside a box, not in
    its first run)."""
    m = cat.read_step(root, step)
    w = next(t for t in m["tensors"] if t["dataset"] == dataset)
    at = w["offset"] + (row * w["shape"][1] + col) * 4 + 2
    with open(cat.step_dir(root, step) / mf.DATA_FILE, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))


def test_a_flipped_byte_inside_a_box_is_detected_and_falls_back(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    first = job(2, "save", tmp_path, "tp", 1)
    job(2, "save", tmp_path, "tp", 2)
    _flip(tmp_path, 2, FC2, 5, 3)  # rank 1's box: columns 4..7
    assert ckpt_main(["verify", str(tmp_path), "1"]) == 0
    capsys.readouterr()
    assert ckpt_main(["verify", str(tmp_path), "2"]) == 7  # CheckpointCorrupt's exit code
    assert re.search(r"fc2\.weight' box at \[0, 4\] of shape \[6, 4\].* by rank 1 fails its checksum",
                     capsys.readouterr().out)
    for n, layout in ((2, "tp"), (1, "plain")):
        loaded = job(n, "load", tmp_path, layout)
        assert loaded["step"] == 1
        assert loaded["hashes"] == first["hashes"]


def to_format3(root: Path, step: int) -> int:
    """Rewrite a checkpoint's manifest into format 3, as the store wrote it before boxes: every
    box shard becomes one entry per byte run, each with the CRC-32C of its bytes (read from the
    file), the manifest re-sealed. Returns the number of shard entries."""
    d = cat.step_dir(root, step)
    m = json.loads((d / mf.MANIFEST).read_text())
    metas = {t["dataset"]: t for t in m["tensors"]}
    data = (d / mf.DATA_FILE).read_bytes()
    shards = []
    for s in m["shards"]:
        if "box" not in s:
            shards.append(s)
            continue
        t = metas[s["dataset"]]
        for a, n in mf.box_runs(t["shape"], s["box"], t["nbytes"] // max(1, _numel(t["shape"]))):
            at = t["offset"] + a
            shards.append({"file": s["file"], "dataset": s["dataset"], "rank": s["rank"], "start": a,
                           "stop": a + n, "crc32c": crc32c.crc32c(data[at:at + n])})
    m["shards"] = shards
    m["format_version"] = 3
    (d / mf.MANIFEST).write_text(json.dumps(seal(m)))
    return len(shards)


def _numel(shape: list[int]) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


def test_format3_per_run_checkpoints_still_load_and_verify(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    first = job(2, "save", tmp_path, "tp", 1)
    second = job(2, "save", tmp_path, "tp", 2)
    compact = len(cat.read_step(tmp_path, 2)["shards"])
    for step in (1, 2):
        assert to_format3(tmp_path, step) > compact
    m = cat.read_step(tmp_path, 2)
    assert m["format_version"] == 3 and not any("box" in s for s in m["shards"])
    assert len(_rows_of(m, FC2)) == 12  # one per row of each box
    assert ckpt_main(["verify", str(tmp_path)]) == 0
    for n, layout in ((2, "tp"), (2, "fsdp"), (1, "plain")):
        loaded = job(n, "load", tmp_path, layout)
        assert (loaded["step"], loaded["hashes"]) == (2, second["hashes"]), layout
    # a flipped byte of one run is still caught by that run's CRC, and the load falls back
    _flip(tmp_path, 2, FC2, 0, 4)  # rank 0's run of row 4: bytes [128, 144)
    capsys.readouterr()
    assert ckpt_main(["verify", str(tmp_path), "2"]) == 7
    assert re.search(r"fc2\.weight' bytes \[128, 144\) written by rank 0 fails", capsys.readouterr().out)
    loaded = job(2, "load", tmp_path, "tp")
    assert (loaded["step"], loaded["hashes"]) == (1, first["hashes"])


def _edited(root: Path, step: int, fn: Any) -> None:
    path = cat.step_dir(root, step) / mf.MANIFEST
    m = json.loads(path.read_text())
    fn(next(s for s in m["shards"] if s["dataset"] == FC2 and s["rank"] == 1), m)
    path.write_text(json.dumps(seal(m)))


@pytest.mark.parametrize("edit, problem", [
    (lambda s, m: s["box"][0].__setitem__(1, 3), "does not list"),          # another box
    (lambda s, m: s.update(stop=s["stop"] - 4), "its box spans others"),   # span cut short
    (lambda s, m: s.update(box=[[0, 4]]), "malformed 'box'"),
    (lambda s, m: m.update(format_version=3), "not a DTensor of a format-4 manifest"),
    (lambda s, m: m["shards"].append({**s, "start": 20, "stop": 192, "box": [[0, 5], [6, 3]]}),
     "does not list"),                                                     # a box inside rank 1's
])
def test_edited_box_shards_are_refused(tp: tuple[Path, dict[str, Any]], tmp_path: Path, edit: Any,
                                       problem: str) -> None:
    root, _ = tp
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(root, copy)
    _edited(copy, 2, edit)
    with pytest.raises(CheckpointCorrupt, match=problem):
        cat.read_step(copy, 2)


def test_box_shards_must_cover_the_dataset_once(tp: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """Dropping a box's entry leaves its bytes unchecked: the manifest is refused."""
    root, _ = tp
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(root, copy)
    path = cat.step_dir(copy, 2) / mf.MANIFEST
    m = json.loads(path.read_text())
    m["shards"] = [s for s in m["shards"] if not (s["dataset"] == FC2 and s["rank"] == 1)]
    path.write_text(json.dumps(integrity.seal(m)))
    with pytest.raises(CheckpointCorrupt, match="do not cover"):
        cat.read_step(copy, 2)
