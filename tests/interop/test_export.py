"""export(): hf / torch / dcp read back by their own libraries, bit-identical to CheckpointManager.load;
shard cutting and the index; names, renames and dtypes; damage, truncation and a full disk
leave nothing that looks complete."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.errors import CheckpointCorrupt, CheckpointError, UsageError
from coci_hpc.interop import export as export_mod
from coci_hpc.interop.export import export, parse_size
from tests.interop.helpers import loaded_reference, same_bits, save_full


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    save_full(root, step=3)
    return root


def _model_ref(root: Path) -> dict[str, torch.Tensor]:
    return loaded_reference(root, 3)["model"].state_dict()


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_hf_single_file_is_bit_identical_to_load(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    r = export(ck, out, to="hf")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"] and r.files == ["model.safetensors"]
    got = load_file(out / "model.safetensors")
    ref = _model_ref(ck)
    assert list(got) != [] and set(got) == set(ref)
    for k, v in ref.items():
        assert same_bits(got[k], v), k
    assert r.step == 3 and _leftovers(tmp_path) == []


def test_hf_shards_are_cut_at_the_limit_and_indexed(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export(ck, out, to="hf", max_shard_size=3000)   # fc1.weight is 8 KiB: alone in its file
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    k = len(files)
    assert k >= 3 and files == [f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]
    ref = _model_ref(ck)
    assert set(index["weight_map"]) == set(ref)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ref.values())
    seen: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(out / f)
        assert all(index["weight_map"][n] == f for n in part)
        size = sum(v.numel() * v.element_size() for v in part.values())
        assert size <= 3000 or len(part) == 1      # over the limit only a lone tensor larger than it
        seen.update(part)
    for name, v in ref.items():
        assert same_bits(seen[name], v), name


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("256MB") == 256 * 10**6
    assert parse_size("1MiB") == 2**20 and parse_size(1234) == 1234
    with pytest.raises(UsageError):
        parse_size("lots")


def test_torch_file_loads_weights_only_and_matches(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    export(ck, out, to="torch")
    got = torch.load(out, weights_only=True)
    ref = _model_ref(ck)
    assert set(got) == set(ref) and all(same_bits(got[k], v) for k, v in ref.items())
    net = loaded_reference(ck, 3)["model"]
    net.load_state_dict(got)   # straight into the model


def test_torch_with_optimizer_has_the_optimizer_state(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "all.pt"
    export(ck, out, to="torch", with_optimizer=True)
    got = torch.load(out, weights_only=True)
    ref = loaded_reference(ck, 3)
    assert set(got["model"]) == set(ref["model"].state_dict())
    opt_ref = ref["optimizer"].state_dict()
    assert got["optimizer"]["param_groups"][0]["lr"] == opt_ref["param_groups"][0]["lr"]
    names = [n for n, _ in ref["model"].named_parameters()]   # the optimizer's state is keyed by name
    assert got["optimizer"]["param_groups"][0]["params"] == names
    for pid, st in opt_ref["state"].items():
        assert same_bits(got["optimizer"]["state"][names[pid]]["exp_avg"], st["exp_avg"])


def test_hf_with_optimizer_under_its_prefix(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export(ck, out, to="hf", with_optimizer=True)
    got = load_file(out / "model.safetensors")
    assert "fc1.weight" in got and "optimizer.state.fc1.weight.exp_avg" in got
    ref = loaded_reference(ck, 3)
    first = next(n for n, _ in ref["model"].named_parameters())
    assert first == "fc1.weight"
    assert same_bits(got["optimizer.state.fc1.weight.exp_avg"], ref["optimizer"].state_dict()["state"][0]["exp_avg"])


def test_dcp_directory_loads_with_dcp(ck: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    export(ck, out, to="dcp")
    ref = _model_ref(ck)
    target = {k: torch.zeros_like(v) for k, v in ref.items()}
    dcp.load(target, checkpoint_id=str(out), no_dist=True)
    assert all(same_bits(target[k], v) for k, v in ref.items())


def test_dtype_casts_floating_weights_only(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf16"
    export(ck, out, to="hf", dtype="bf16")
    got = load_file(out / "model.safetensors")
    ref = _model_ref(ck)
    assert got["fc1.weight"].dtype == torch.bfloat16
    assert torch.equal(got["fc1.weight"], ref["fc1.weight"].to(torch.bfloat16))
    assert same_bits(got["count"], ref["count"]) and same_bits(got["mask"], ref["mask"])


def test_wrapper_prefixes_cleaned_and_renames_applied(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    w = torch.randn(3, 4)
    sd = {"module._orig_mod.layers.0._fsdp_wrapped_module.w": w,
          "module.layers.1._checkpoint_wrapped_module.w": w + 1}
    mgr = CheckpointManager(root)
    mgr.save(1, {"model": sd})
    mgr.close()
    export(root, tmp_path / "a", to="hf")
    assert sorted(load_file(tmp_path / "a" / "model.safetensors")) == ["layers.0.w", "layers.1.w"]
    export(root, tmp_path / "b", to="hf", rename=[r"^layers\.=model.layers.", r"\.w$=.weight"])
    got = load_file(tmp_path / "b" / "model.safetensors")
    assert sorted(got) == ["model.layers.0.weight", "model.layers.1.weight"]
    assert same_bits(got["model.layers.0.weight"], w)
    with pytest.raises(UsageError, match="both be named"):
        export(root, tmp_path / "c", to="hf", rename=[r"\d=N"])
    assert not (tmp_path / "c").exists()


def test_model_key_and_unknown_key(ck: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="has no state 'net'.*model"):
        export(ck, tmp_path / "x", to="hf", model_key="net")
    assert not (tmp_path / "x").exists()
    export(ck, tmp_path / "ex", to="torch", model_key="extras")   # any replicated state value
    assert set(torch.load(tmp_path / "ex", weights_only=True)) == {"arr", "emb"}


def test_existing_output_is_never_overwritten(ck: Path, tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep").write_text("mine")
    with pytest.raises(UsageError, match="never overwrites"):
        export(ck, tmp_path / "hf", to="hf")
    assert (tmp_path / "hf" / "keep").read_text() == "mine"


def _damage(root: Path, step: int, dataset: str, truncate: bool = False) -> None:
    d = cat.step_dir(root, step)
    m = cat.read_manifest(d)
    t = next(t for t in m["tensors"] if t["dataset"] == dataset)
    with open(d / mf.DATA_FILE, "r+b") as f:
        if truncate:
            f.truncate(t["offset"] + 16)
        else:
            f.seek(t["offset"] + 8)
            b = f.read(1)
            f.seek(t["offset"] + 8)
            f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("to", ["hf", "torch", "dcp"])
def test_damaged_checkpoint_fails_naming_the_tensor_and_leaves_nothing(ck: Path, tmp_path: Path, to: str) -> None:
    _damage(ck, 3, "replicated/model/fc2.weight")
    out = tmp_path / "out"
    with pytest.raises(CheckpointCorrupt, match=r"model\.fc2\.weight.*fails its checksum"):
        export(ck, out, to=to, max_shard_size=1000)
    assert not out.exists() and _leftovers(tmp_path) == []


def test_truncated_checkpoint_is_refused_with_no_index(ck: Path, tmp_path: Path) -> None:
    _damage(ck, 3, "replicated/model/fc2.weight", truncate=True)
    out = tmp_path / "hf"
    with pytest.raises(CheckpointCorrupt):
        export(ck, out, to="hf", max_shard_size=1000)
    assert not out.exists() and _leftovers(tmp_path) == []
    assert not list(tmp_path.rglob("model.safetensors.index.json"))


def test_full_disk_midway_leaves_nothing_that_looks_complete(ck: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct writer (tensors as stored): the disk fills while the 2nd shard file is written."""
    real = export_mod.pwrite_all
    files: list[int] = []

    def filling(fd: int, buf, offset: int) -> None:
        if offset == 0:
            files.append(fd)                       # a new file's header
        if len(files) == 2 and offset > 0:         # the disk fills in the 2nd shard's data
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, buf, offset)

    from coci_hpc.checkpoint import rawio

    monkeypatch.setattr(export_mod, "pwrite_all", filling)  # the header
    monkeypatch.setattr(rawio, "pwrite_all", filling)       # the data (rawio.pwrite_pages)
    out = tmp_path / "hf"
    with pytest.raises(CheckpointError, match="No space left.*nothing was left"):
        export(ck, out, to="hf", max_shard_size=1000)
    assert len(files) == 2
    assert not out.exists() and _leftovers(tmp_path) == []
    assert not list(tmp_path.rglob("*.safetensors*"))


def test_full_disk_midway_with_a_cast_leaves_nothing_that_looks_complete(ck: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A cast (--dtype) goes through safetensors' own writer: the same on a full disk."""
    real = export_mod._write_safetensors
    calls = []

    def filling(tensors: dict, path: Path) -> None:   # the disk fills while the 2nd shard is written
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(tensors, path)

    monkeypatch.setattr(export_mod, "_write_safetensors", filling)
    out = tmp_path / "hf"
    with pytest.raises(CheckpointError, match="No space left.*nothing was left"):
        export(ck, out, to="hf", max_shard_size=1000, dtype="bf16")
    assert len(calls) == 2
    assert not out.exists() and _leftovers(tmp_path) == []
    assert not list(tmp_path.rglob("*.safetensors*"))


@pytest.mark.parametrize("bounce", [None, 64, 8192], ids=["whole-tensors", "64-byte-pieces", "two-page-windows"])
def test_the_direct_writer_writes_what_safetensors_writes(ck: Path, tmp_path: Path, bounce: int | None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard files written straight from the checkpoint load with safetensors into the same
    tensors, names, dtypes and metadata as files written by ``safetensors.torch.save_file``;
    also when every tensor is read in many pieces through the two buffers in turn (the next
    piece read while the last is written)."""
    from safetensors import safe_open

    from coci_hpc.interop.source import CheckpointSource

    if bounce is not None:
        monkeypatch.setattr(export_mod, "_BOUNCE_MAX", bounce)
    out = tmp_path / "hf"
    export(ck, out, to="hf", max_shard_size=1000)
    with CheckpointSource(ck) as src:
        want = {e.path: src.read(e) for e in src.model()}
    got: dict = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
        got.update(load_file(str(f)))
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    # whole-page buffers: the data starts on a page (its pages written with O_DIRECT)
    for f in out.glob("*.safetensors"):
        data_at = 8 + int.from_bytes(f.read_bytes()[:8], "little")
        assert (data_at % 4096 == 0) == (bounce != 64), (f.name, data_at)


def test_direct_writes_refused_midway_go_through_the_page_cache(ck: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that opens O_DIRECT but refuses the writes (EINVAL): the export falls back to
    buffered writes for the rest and the files are what they should be."""
    from coci_hpc.interop.source import CheckpointSource

    monkeypatch.setattr(export_mod, "_BOUNCE_MAX", 8192)
    from coci_hpc.checkpoint import rawio

    real_open, real_write = export_mod.open_direct, rawio.pwrite_all
    direct: set[int] = set()
    refused: list[int] = []

    def opening(path):  # type: ignore[no-untyped-def]
        fd = real_open(path)
        direct.clear()   # descriptor numbers are reused from file to file
        if fd is not None:
            direct.add(fd)
        return fd

    def writing(fd, buf, offset):  # type: ignore[no-untyped-def]
        if fd in direct:
            refused.append(offset)
            direct.discard(fd)   # the export closes it now
            raise OSError(errno.EINVAL, "Invalid argument")
        real_write(fd, buf, offset)

    monkeypatch.setattr(export_mod, "open_direct", opening)
    monkeypatch.setattr(rawio, "pwrite_all", writing)
    out = tmp_path / "hf"
    export(ck, out, to="hf", max_shard_size=1000)
    assert refused, "no O_DIRECT write was tried"
    with CheckpointSource(ck) as src:
        want = {e.path: src.read(e) for e in src.model()}
    got: dict = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(str(f)))
    assert set(got) == set(want) and all(torch.equal(got[k], t) for k, t in want.items())


def test_a_failed_background_fsync_fails_the_export_and_leaves_nothing(ck: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The shards' fsyncs run in a helper thread beside the next shard's read: an I/O error
    there (writeback after the write call returned) still fails the export, with no index."""
    real = export_mod.fsync_file
    synced: list[str] = []

    def failing(path: Path) -> None:
        synced.append(Path(path).name)
        if len(synced) == 1:
            raise OSError(errno.EIO, "Input/output error", str(path))
        real(path)

    monkeypatch.setattr(export_mod, "fsync_file", failing)
    out = tmp_path / "hf"
    with pytest.raises(CheckpointError, match="Input/output error"):
        export(ck, out, to="hf", max_shard_size=1000)
    assert synced and synced[0].startswith("model-00001-of-")
    assert not out.exists() and _leftovers(tmp_path) == []
    assert not list(tmp_path.rglob("model.safetensors.index.json"))


def test_large_tensors_read_into_their_own_mapping_are_bit_identical(tmp_path: Path) -> None:
    from coci_hpc.interop.source import CheckpointSource

    g = torch.Generator().manual_seed(5)
    sd = {"big": torch.randn(1024, 600, generator=g),                        # 2.4 MB: mapped read
          "bigbf": torch.randn(800, 1000, generator=g).to(torch.bfloat16),   # 1.6 MB bf16
          "flags": torch.rand(2_000_000, generator=g) > 0.5}                 # 2 MB bool
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(1, {"model": sd})
    mgr.close()
    export(tmp_path / "ck", tmp_path / "hf", to="hf", max_shard_size="3MB")
    got = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert all(same_bits(got[k], v) for k, v in sd.items())
    with CheckpointSource(tmp_path / "ck") as src:
        e = next(e for e in src.model() if e.path == "big")
        assert same_bits(src.read_box(e, (100, 0), (900, 600)), sd["big"][100:1000])


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 3 MiB filesystem (tmpfs); skipped where this process may not mount one."""
    import shutil
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("to", ["hf", "torch", "dcp"])
def test_real_full_disk_leaves_nothing(tmp_path: Path, small_disk: Path, to: str) -> None:
    g = torch.Generator().manual_seed(3)
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(1, {"model": {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(6)}})   # 6 MiB
    mgr.close()
    with pytest.raises(CheckpointError, match="nothing was left") as e:
        export(tmp_path / "ck", small_disk / "out", to=to, max_shard_size="1MB")
    assert "free space" in (e.value.hint or "")
    assert list(small_disk.iterdir()) == []


@pytest.mark.parametrize("step", [1, 7, 64, 1000])
def test_windows_cover_every_byte_once_in_order(step: int) -> None:
    """The writer's windows (one sweep over the tensors) hand out every byte of every tensor
    exactly once, at its place in the file, empty tensors included."""
    import random
    from itertools import accumulate

    from coci_hpc.interop.source import Entry

    rng = random.Random(step)
    members = [(f"t{i}", Entry("model", f"t{i}", {"nbytes": rng.choice([0, 1, 5, 63, 64, 200, 3000])}))
               for i in range(60)]
    first = 37
    got: dict[str, list[tuple[int, int]]] = {}
    prev_end = first
    for w, n, segs in export_mod._windows(members, first, step):
        assert w == prev_end and 0 < n <= step
        prev_end = w + n
        at = 0
        for e, lo, k, buf_at in segs:
            assert buf_at == at and k > 0  # segments fill the window back to back
            at += k
            got.setdefault(e.path, []).append((lo, k))
        assert at == n
    at = first
    for name, e in members:
        runs = got.get(e.path, [])
        assert sum(k for _, k in runs) == e.nbytes, name
        assert [lo for lo, _ in runs] == list(accumulate([k for _, k in runs], initial=0))[:-1]
        at += e.nbytes
    assert prev_end == at
