"""Damaged checkpoints: every kind of damage is named by `verify`, and a restart falls back to the
previous committed checkpoint with a loud warning, never loading bad data (issue 8, defects 7-9).

Each case copies a pristine root holding steps 1 and 2, damages step 2, then checks
* ``coci-ckpt verify`` exits 7 (CheckpointCorrupt) for step 2 and 0 for step 1;
* ``load_latest`` loads step 1 (bit-exact), warns on stderr naming step 2 and the problem;
* ``load(2)`` raises CheckpointCorrupt.
Figures: corruptions tried, undetected (a wrong result loaded, or verify passing: must be 0).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.integrity import seal
from coci_hpc.cli.ckpt import main as ckpt_main
from coci_hpc.errors import CheckpointCorrupt
from tests.checkpoint.helpers import canonical, empty_state, full_state

pytestmark = pytest.mark.timeout(300)



def _manifest(root: Path) -> dict:
    return json.loads((cat.step_dir(root, 2) / mf.MANIFEST).read_text())


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _data_cases(pristine: Path) -> dict[str, Callable[[Path], None]]:
    """A flipped byte in every shard (first, middle and last byte), truncations, deletion."""
    m = _manifest(pristine)
    offsets = {t["dataset"]: t["offset"] for t in m["tensors"]}
    cases: dict[str, Callable[[Path], None]] = {}
    for sh in m["shards"]:
        for where, pos in (("first", sh["start"]), ("last", sh["stop"] - 1)):
            off = offsets[sh["dataset"]] + pos
            cases[f"flip {where} byte of {sh['dataset']}"] = \
                lambda root, off=off: _flip(cat.step_dir(root, 2) / mf.DATA_FILE, off)
    data_size = (pristine / "step_000000002" / mf.DATA_FILE).stat().st_size
    for keep in (0, 512, 4096, data_size // 2, data_size - 1):
        cases[f"truncate data.h5 to {keep} bytes"] = \
            lambda root, keep=keep: os.truncate(cat.step_dir(root, 2) / mf.DATA_FILE, keep)
    cases["delete data.h5"] = lambda root: (cat.step_dir(root, 2) / mf.DATA_FILE).unlink()
    for off in (0, 3, 8, 9, 40):  # the HDF5 signature, version bytes, base/EOF addresses
        cases[f"damage the HDF5 superblock at byte {off}"] = \
            lambda root, off=off: _flip(cat.step_dir(root, 2) / mf.DATA_FILE, off)
    return cases


def _edit(path: Path, fn: Callable[[dict], object]) -> None:
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m, separators=(",", ":")))


def _manifest_cases() -> dict[str, Callable[[Path], None]]:
    """A damaged manifest: truncated, empty, garbage, one-digit edits, a flipped byte."""
    def mpath(root: Path) -> Path:
        return cat.step_dir(root, 2) / mf.MANIFEST

    def sampler_pos(m: dict) -> None:
        m["skeletons"]["replicated"]["loader"]["position"] += 1

    def lr(m: dict) -> None:
        m["skeletons"]["replicated"]["optimizer"]["param_groups"][0]["lr"] *= 10

    return {
        "manifest truncated": lambda root: mpath(root).write_bytes(mpath(root).read_bytes()[:200]),
        "manifest empty": lambda root: mpath(root).write_bytes(b""),
        "manifest garbage": lambda root: mpath(root).write_bytes(os.urandom(300)),
        "manifest deeply nested": lambda root: mpath(root).write_text("[" * 100000 + "]" * 100000),
        "manifest edit: step": lambda root: _edit(mpath(root), lambda m: m.update(step=3)),
        "manifest edit: learning rate": lambda root: _edit(mpath(root), lr),
        "manifest edit: sampler position": lambda root: _edit(mpath(root), sampler_pos),
        "manifest edit: NaN wall_time": lambda root: _edit(mpath(root), lambda m: m.update(wall_time=float("nan"))),
        "manifest flipped byte": lambda root: _flip(mpath(root), len(mpath(root).read_bytes()) // 2),
        "manifest is a symlink": lambda root: _symlink_manifest(mpath(root)),
    }


def _symlink_manifest(path: Path) -> None:
    copy = path.parent.parent / "elsewhere.json"
    shutil.copy(path, copy)
    path.unlink()
    path.symlink_to(copy)


def _run_case(pristine: Path, root: Path, damage: Callable[[Path], None], capfd) -> list[str]:
    """Damage step 2 of a fresh copy; return what went wrong (empty: all as required)."""
    shutil.copytree(pristine, root)
    damage(root)
    wrong: list[str] = []
    capfd.readouterr()
    if ckpt_main(["verify", str(root), "2"]) != 7:
        wrong.append("verify did not exit 7")
    if ckpt_main(["verify", str(root), "1"]) != 0:
        wrong.append("verify of the intact step 1 failed")
    capfd.readouterr()
    mgr = CheckpointManager(root, comm=None, keep=3)
    target = empty_state()
    try:
        res = mgr.load_latest(target)
    except Exception as exc:  # noqa: BLE001 - a crash is a failure of this suite
        return wrong + [f"load_latest raised {type(exc).__name__}: {exc}"]
    err = capfd.readouterr().err
    if res.step != 1:
        wrong.append(f"load_latest loaded step {res.step}")
    elif canonical(target) != canonical(full_state(1)):
        wrong.append("load_latest loaded wrong data")
    if "WARNING" not in err or "step 2" not in err:
        wrong.append(f"no loud warning naming step 2 on stderr: {err!r}")
    with pytest.raises(CheckpointCorrupt):
        mgr.load(2, empty_state())
    return wrong


def test_every_damage_of_the_newest_checkpoint_is_named_and_falls_back(pristine, tmp_path, capfd,
                                                                       record_figure, caplog):
    caplog.set_level(logging.WARNING, logger="coci_hpc.checkpoint")
    cases = {**_data_cases(pristine), **_manifest_cases()}
    assert len(cases) >= 40
    failures: dict[str, list[str]] = {}
    for i, (name, damage) in enumerate(cases.items()):
        wrong = _run_case(pristine, tmp_path / f"case{i}", damage, capfd)
        if wrong:
            failures[name] = wrong
    flips = sum(1 for n in cases if n.startswith("flip"))
    record_figure("corruption, 1 rank (every shard, truncation, deletion, superblock, manifest)",
                  tried=len(cases), undetected=len(failures), shard_flips=flips)
    assert not failures, failures
    assert any("damaged and was NOT loaded" in r.getMessage() for r in caplog.records)  # logging too


def test_all_checkpoints_damaged_raises_listing_them(pristine, tmp_path, capfd):
    shutil.copytree(pristine, tmp_path / "r")
    root = tmp_path / "r"
    for step in (1, 2):
        (cat.step_dir(root, step) / mf.MANIFEST).write_text("{")
    target = empty_state()
    before = canonical(target)
    with pytest.raises(CheckpointCorrupt, match=r"every committed checkpoint .* damaged \(2\).*step 2.*step 1"):
        CheckpointManager(root, comm=None).load_latest(target)
    assert canonical(target) == before  # never a silent fresh start, never a half load


def test_a_state_mismatch_is_raised_not_taken_for_damage(pristine, tmp_path):
    """Loading into a different model is the user's error: no fallback, no 'damaged' label."""
    shutil.copytree(pristine, tmp_path / "r")
    with pytest.raises(Exception) as info:
        CheckpointManager(tmp_path / "r", comm=None).load_latest({"model": torch.nn.Linear(3, 3)})
    assert not isinstance(info.value, CheckpointCorrupt)


def test_list_survives_damaged_manifests(pristine, tmp_path, capsys):
    shutil.copytree(pristine, tmp_path / "r")
    root = tmp_path / "r"
    _edit(cat.step_dir(root, 1) / mf.MANIFEST, lambda m: m.update(wall_time=float("nan")))
    (cat.step_dir(root, 2) / mf.MANIFEST).write_text("[" * 100000)
    assert ckpt_main(["list", str(root)]) == 7
    out = capsys.readouterr().out
    assert [ln.split()[:2] for ln in out.splitlines()[1:]] == [["1", "DAMAGED"], ["2", "DAMAGED"]]


def test_format_1_crc32_manifests_still_load(pristine, tmp_path):
    """Checkpoints written before the CRC-32C switch (zlib CRC-32, no own checksum) still load."""
    import zlib

    from coci_hpc.checkpoint.h5read import DatasetReader

    shutil.copytree(pristine, tmp_path / "r")
    root = tmp_path / "r"
    d = cat.step_dir(root, 2)
    m = json.loads((d / mf.MANIFEST).read_text())
    by_ds = {t["dataset"]: t for t in m["tensors"]}
    with DatasetReader(d / mf.DATA_FILE) as r:  # no manifest: raw bytes, no checks
        for sh in m["shards"]:
            sh["crc32"] = zlib.crc32(r.read_bytes(by_ds[sh["dataset"]], sh["start"], sh["stop"]))
            del sh["crc32c"]
    m.pop("manifest_crc32c")
    m.update(format_version=1, checksum="crc32")
    (d / mf.MANIFEST).write_text(json.dumps(m))
    assert ckpt_main(["verify", str(root), "2"]) == 0
    target = empty_state()
    assert CheckpointManager(root, comm=None).load(2, target).step == 2
    assert canonical(target) == canonical(full_state(2))
    _flip(d / mf.DATA_FILE, by_ds[m["shards"][0]["dataset"]]["offset"])
    assert ckpt_main(["verify", str(root), "2"]) == 7


def test_a_resealed_edit_is_still_bound_to_its_directory(pristine, tmp_path):
    """Even with a valid own checksum, a manifest claiming another step is refused."""
    shutil.copytree(pristine, tmp_path / "r")
    path = cat.step_dir(tmp_path / "r", 2) / mf.MANIFEST
    m = json.loads(path.read_text())
    m["step"] = 7
    path.write_text(json.dumps(seal(m)))
    with pytest.raises(CheckpointCorrupt, match="lives in step_000000002"):
        cat.read_manifest(path.parent)


@pytest.mark.mpi
def test_damage_in_one_ranks_shard_makes_every_rank_fall_back_together(tmp_path_factory, record_figure):
    """Under mpiexec -n 2 the damaged shard is one only the last rank reads (its per-rank RNG
    state): every rank must still load the same, previous step (a collective decision)."""
    from coci_hpc.comm import Comm

    comm = Comm.world()
    root = Path(comm.bcast(str(tmp_path_factory.mktemp("mpi")) if comm.rank == 0 else None))
    mgr = CheckpointManager(root, comm=comm, keep=3)
    mgr.save(1, full_state(1, comm.rank, comm.size))
    mgr.save(2, full_state(2, comm.rank, comm.size))
    last = comm.size - 1
    if comm.rank == 0:
        m = _manifest(root)
        # per-rank leaves are packed: one dataset per leaf, each rank's part at its own start
        t, part = next((t, p) for t in m["tensors"] if t["kind"] == "per_rank"
                       for p in t["parts"] if p[0] == last and p[3] > 16)
        _flip(cat.step_dir(root, 2) / mf.DATA_FILE, t["offset"] + part[1] + 7)
    comm.barrier()
    target = empty_state(comm.rank, comm.size)
    res = mgr.load_latest(target)
    steps = comm.allgather(res.step)
    assert steps == [1] * comm.size
    with pytest.raises(CheckpointCorrupt):
        mgr.load(2, empty_state(comm.rank, comm.size))
    record_figure(f"corruption, {comm.size} rank(s), one rank's shard", tried=1,
                  undetected=int(steps != [1] * comm.size))


def test_flipped_bytes_in_hdf5_metadata_never_crash_or_load_wrong_data(pristine, tmp_path, capfd,
                                                                        record_figure):
    """Defect 14: HDF5 metadata damage surfaced as CommError(KeyError). A byte flipped anywhere
    outside the tensors' bytes (superblock, object headers, heaps, B-trees, padding) is either
    harmless (step 2 loads, bit-exact) or detected (step 1 loads, with a warning): never a raw
    error, never wrong data."""
    import random

    m = _manifest(pristine)
    data = cat.step_dir(pristine, 2) / mf.DATA_FILE
    size = data.stat().st_size
    taken = sorted((t["offset"], t["offset"] + t["nbytes"]) for t in m["tensors"] if t["nbytes"])
    rng = random.Random(8)
    spots: list[int] = []
    while len(spots) < 40:
        off = rng.randrange(0, min(size, taken[0][0] if taken else size) or size)
        if not any(a <= off < b for a, b in taken):
            spots.append(off)
    wrong, detected = [], 0
    for i, off in enumerate(spots):
        root = tmp_path / f"meta{i}"
        shutil.copytree(pristine, root)
        _flip(cat.step_dir(root, 2) / mf.DATA_FILE, off)
        rc = ckpt_main(["verify", str(root), "2"])
        target = empty_state()
        try:
            res = CheckpointManager(root, comm=None).load_latest(target)
        except Exception as exc:  # noqa: BLE001 - what this test counts
            wrong.append(f"byte {off}: load_latest raised {type(exc).__name__}: {exc}")
            continue
        if canonical(target) != canonical(full_state(res.step)):
            wrong.append(f"byte {off}: step {res.step} loaded with wrong data")
        if (res.step == 1) != (rc == 7):
            wrong.append(f"byte {off}: verify exit {rc} but load_latest chose step {res.step}")
        detected += res.step == 1
    capfd.readouterr()
    record_figure("HDF5 metadata byte flips (1 rank)", tried=len(spots), detected=detected,
                  harmless=len(spots) - detected - len(wrong), wrong_or_crash=len(wrong))
    assert not wrong, wrong


def test_checked_reads_in_chunks_catch_a_flip_in_any_chunk(pristine, tmp_path, monkeypatch):
    """Large reads are checked chunk by chunk (the CRC of one chunk overlaps the next read):
    with chunks far smaller than a tensor, an intact checkpoint still loads and a flip in the
    first, a middle or the last chunk is caught."""
    from coci_hpc.checkpoint import h5read

    monkeypatch.setattr(h5read, "_READ_CHUNK", 1000)  # not a divisor of anything: odd boundaries
    target = empty_state()
    assert CheckpointManager(pristine, comm=None, lock=False).load(2, target).step == 2
    assert canonical(target) == canonical(full_state(2))
    t = _weight_meta(_manifest(pristine))
    for pos in (0, 999, 1000, t["nbytes"] // 2, t["nbytes"] - 1):
        root = tmp_path / f"chunk{pos}"
        shutil.copytree(pristine, root)
        _flip(cat.step_dir(root, 2) / mf.DATA_FILE, t["offset"] + pos)
        with pytest.raises(CheckpointCorrupt, match="fc1.weight"):
            CheckpointManager(root, comm=None).load(2, empty_state())


def _weight_meta(m: dict) -> dict:
    return next(t for t in m["tensors"] if t["dataset"] == "replicated/model/fc1.weight")


# ------------------------------------------------------------- mapped, streamed loads (#15)
_BIG = 300_000  # a 1.2 MB parameter: many check chunks of 64 KB


def _ptrs(state: dict) -> list[int]:
    opt = state["optimizer"]
    return ([p.data_ptr() for p in state["model"].parameters()] +
            [v.data_ptr() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)])


def _preads(monkeypatch) -> list[int]:
    """The sizes of the reads of the load's check into a buffer (pread)."""
    from coci_hpc.checkpoint import h5read

    calls: list[int] = []
    pread = h5read.pread_into

    def spy(fd: int, buf, offset: int):
        calls.append(buf.nbytes)
        return pread(fd, buf, offset)

    monkeypatch.setattr(h5read, "pread_into", spy)
    return calls


def _big_meta(m: dict) -> dict:
    return next(t for t in m["tensors"] if t["dataset"] == "replicated/model/big")


def _views(monkeypatch) -> list[int]:
    """The sizes of the ranges read or mapped through the file's mapping (the fast path)."""
    from coci_hpc.checkpoint.rawio import FileMap

    calls: list[int] = []
    view, populate = FileMap.view, FileMap.populate

    def spy(self, at: int, n: int):
        calls.append(n)
        return view(self, at, n)

    def spy_populate(self, at: int, n: int):
        calls.append(n)
        return populate(self, at, n)

    monkeypatch.setattr(FileMap, "view", spy)
    monkeypatch.setattr(FileMap, "populate", spy_populate)
    return calls


@pytest.mark.parametrize("mode", ["streamed", "mapped", "unmapped"])
def test_a_flip_in_a_middle_chunk_leaves_the_live_state_untouched(tmp_path, monkeypatch, mode):
    """The load checks every chunk straight over the file's mapping ("mapped", the default) or
    streamed through two reused buffers ("streamed", ``PASS1_MAPPED`` off), then copies
    through the mapping into the state's own tensors ("unmapped": where the file cannot be
    mapped, streamed and copied by pread): a flipped byte in a chunk in the middle of a large
    tensor leaves every live tensor as it was, bytes and buffers."""
    from coci_hpc.checkpoint import h5read
    from coci_hpc.checkpoint.rawio import FileMap

    monkeypatch.setattr(h5read, "_READ_CHUNK", 64 << 10)
    monkeypatch.setattr(h5read, "PASS1_MAPPED", mode == "mapped")
    if mode == "unmapped":
        monkeypatch.setattr(FileMap, "open", classmethod(lambda cls, fd, size: None))
    views = _views(monkeypatch)
    reads = _preads(monkeypatch)
    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(2, full_state(2, big=_BIG))
    target = full_state(5, big=_BIG)
    ptrs = _ptrs(target)
    mgr.load(2, target)
    assert canonical(target) == canonical(full_state(2, big=_BIG))
    assert _ptrs(target) == ptrs
    chunks = 4 * _BIG // (64 << 10)  # whole check chunks of the big tensor
    assert (views.count(64 << 10) >= chunks) == (mode == "mapped")  # checked over the mapping
    assert (reads.count(64 << 10) >= chunks) == (mode != "mapped")  # read into a buffer
    assert bool(views) == (mode != "unmapped")  # the copies went through the mapping

    t = _big_meta(_manifest(tmp_path))
    _flip(cat.step_dir(tmp_path, 2) / mf.DATA_FILE, t["offset"] + t["nbytes"] // 2 + 3)
    target = full_state(5, big=_BIG)
    before, ptrs = canonical(target), _ptrs(target)
    with pytest.raises(CheckpointCorrupt, match="big.*fails its checksum"):
        mgr.load(2, target)
    assert canonical(target) == before
    assert _ptrs(target) == ptrs


@pytest.mark.parametrize("pass1", ["mapped", "streamed"])
def test_a_file_cut_short_under_a_mapped_load_is_reported_not_a_crash(tmp_path, monkeypatch, pass1):
    """A read error under the mapping (here: the file truncated when it is mapped: during the
    check, or after a streamed check) must come back as CheckpointCorrupt with the state
    untouched, never as a SIGBUS that kills the process: every mapped range is populated
    (MADV_POPULATE_READ) before any byte goes into the state."""
    from coci_hpc.checkpoint import h5read
    from coci_hpc.checkpoint.h5read import DatasetReader

    monkeypatch.setattr(h5read, "PASS1_MAPPED", pass1 == "mapped")

    views = _views(monkeypatch)
    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(2, full_state(2, big=_BIG))
    data = cat.step_dir(tmp_path, 2) / mf.DATA_FILE
    t = _big_meta(_manifest(tmp_path))
    mapped = DatasetReader._mapped

    def map_then_cut(self):
        fmap = mapped(self)
        if fmap is not None and data.stat().st_size > t["offset"]:
            os.truncate(data, t["offset"] + t["nbytes"] // 2)
        return fmap

    monkeypatch.setattr(DatasetReader, "_mapped", map_then_cut)
    target = full_state(5, big=_BIG)
    before, ptrs = canonical(target), _ptrs(target)
    with pytest.raises(CheckpointCorrupt, match="reading .*big.* failed"):
        mgr.load(2, target)
    assert views, "the load did not read through the mapping"
    assert canonical(target) == before
    assert _ptrs(target) == ptrs


@pytest.mark.mpi
def test_a_flip_any_rank_checks_leaves_every_ranks_state_untouched(tmp_path_factory, monkeypatch,
                                                                   record_figure):
    """Under mpiexec -n 2 the ranks of a node split the checks (each shard once per node) and
    each copies what the others checked: a flip in the middle of any replicated shard (the
    large tensor's included), whichever rank checks it, makes every rank raise and leaves every
    rank's state as it was."""
    from coci_hpc.checkpoint import h5read
    from coci_hpc.comm import Comm

    monkeypatch.setattr(h5read, "_READ_CHUNK", 64 << 10)
    comm = Comm.world()
    root = Path(comm.bcast(str(tmp_path_factory.mktemp("mpimap")) if comm.rank == 0 else None))
    mgr = CheckpointManager(root, comm=comm, keep=3)
    mgr.save(2, full_state(2, comm.rank, comm.size, big=_BIG))
    m = comm.bcast(_manifest(root) if comm.rank == 0 else None)
    metas = {t["dataset"]: t for t in m["tensors"]}
    shards = [sh for sh in m["shards"] if metas[sh["dataset"]]["kind"] == "replicated"
              and sh["stop"] - sh["start"] >= 64]
    assert any(sh["dataset"] == _big_meta(m)["dataset"] for sh in shards) and len(shards) >= 4
    wrong = 0
    for sh in shards:
        pos = metas[sh["dataset"]]["offset"] + (sh["start"] + sh["stop"]) // 2
        if comm.rank == 0:
            _flip(cat.step_dir(root, 2) / mf.DATA_FILE, pos)
        comm.barrier()
        target = full_state(5, comm.rank, comm.size, big=_BIG)
        before, ptrs = canonical(target), _ptrs(target)
        with pytest.raises(CheckpointCorrupt):
            mgr.load(2, target)
        wrong += int(comm.allreduce_max(float(canonical(target) != before or _ptrs(target) != ptrs)))
        if comm.rank == 0:
            _flip(cat.step_dir(root, 2) / mf.DATA_FILE, pos)  # flipped back: the next shard's turn
        comm.barrier()
    target = full_state(5, comm.rank, comm.size, big=_BIG)
    mgr.load(2, target)
    assert canonical(target) == canonical(full_state(2, comm.rank, comm.size, big=_BIG))
    record_figure(f"flip in a mapped load, {comm.size} rank(s)", tried=len(shards), state_changed=wrong)
    assert wrong == 0
