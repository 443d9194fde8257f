"""rawio.stream_copy: the load's copies into the state with streaming stores (coci_hpc/_stream.c),
byte for byte what ``numpy.copyto`` gives, at every alignment and length, and the fallback; and
the same extension's CRC-32C by folding, value for value what the ``crc32c`` library gives."""
from __future__ import annotations

import mmap
import platform

import crc32c as crc32c_lib
import numpy as np
import pytest

from coci_hpc.checkpoint import integrity, rawio
from coci_hpc.checkpoint.rawio import STREAM_MIN, stream_copy


def test_the_extension_is_built_on_x86_64():
    # slurm/setup builds it (pip install -e); optional=True would let a broken build pass silently
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("streaming stores are only written for x86-64")
    assert rawio.STREAM_STORES in ("avx2", "sse2")


@pytest.mark.parametrize("n", [0, 1, 31, 64, 127, 128, 129, 4095, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 77,
                               3 * STREAM_MIN + 4099])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 3), (17, 45), (31, 1)])
def test_every_length_and_alignment_copies_exactly(n, dst_off, src_off):
    rng = np.random.default_rng(n + 7 * dst_off + src_off)
    src_all = rng.integers(0, 256, n + src_off + 64, dtype=np.uint8)
    dst_all = rng.integers(0, 256, n + dst_off + 64, dtype=np.uint8)
    before = dst_all.copy()
    stream_copy(dst_all[dst_off:dst_off + n], src_all[src_off:src_off + n])
    assert np.array_equal(dst_all[dst_off:dst_off + n], src_all[src_off:src_off + n])
    # not a byte around it touched (the head and tail of an unaligned streamed copy)
    assert np.array_equal(dst_all[:dst_off], before[:dst_off])
    assert np.array_equal(dst_all[dst_off + n:], before[dst_off + n:])


@pytest.mark.skipif(rawio._stream is None, reason="coci_hpc._stream not built")
def test_the_extension_copies_straight_from_a_read_only_mapping_and_refuses_other_lengths(tmp_path):
    n = 2 * STREAM_MIN + 5
    data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ) as mm:
        src = np.frombuffer(mm, dtype=np.uint8)
        dst = np.zeros(n, np.uint8)
        rawio._stream.copy(dst, src)
        assert np.array_equal(dst, data)
        with pytest.raises(ValueError, match="bytes into a buffer of"):
            rawio._stream.copy(dst[:-1], src)
        with pytest.raises(TypeError):
            rawio._stream.copy(src, dst)  # the read-only side as destination
        del src


def test_typed_strided_and_unbuilt_copies_fall_back_to_numpy(monkeypatch):
    src = np.arange(STREAM_MIN, dtype=np.float32)
    dst = np.zeros_like(src)
    stream_copy(dst, src)  # a typed array streams as its bytes
    assert np.array_equal(dst, src)
    strided = np.zeros(2 * STREAM_MIN, np.float32)[::2]
    stream_copy(strided, src)  # not contiguous: numpy.copyto
    assert np.array_equal(strided, src)
    monkeypatch.setattr(rawio, "_stream", None)
    dst2 = np.zeros_like(src)
    stream_copy(dst2, src)
    assert np.array_equal(dst2, src)


# --- CRC-32C by folding (coci_hpc/_stream.c: crc32c, copy_crc32c) ----------------------------------

fold = pytest.mark.skipif(integrity.FOLD_CRC32C is None, reason="this CPU has no VPCLMULQDQ")


def _widths() -> list[int]:
    """The fold widths this CPU runs (512 and 256 where it has AVX-512, else 256 or none)."""
    return {"vpclmulqdq": [512, 256], "vpclmulqdq-avx2": [256]}.get(integrity.FOLD_CRC32C or "", [])


@pytest.fixture(params=[512, 256])
def width(request):
    """Each fold width in turn, set in the extension for the test and restored after it."""
    if request.param not in _widths():
        pytest.skip(f"this CPU has no {request.param}-bit fold")
    before = rawio._stream.set_fold(request.param)
    yield request.param
    rawio._stream.set_fold(before)


def test_the_fold_runs_where_the_cpu_has_it():
    # slurm/setup builds the extension; a CPU with the instructions must get the fast checksum
    flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    if platform.machine() not in ("x86_64", "AMD64") or not flags:
        pytest.skip("x86-64 Linux only")
    has = {f: f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl", "vpclmulqdq", "pclmulqdq", "sse4_2",
                                           "avx2")}
    narrow = all(has[f] for f in ("avx2", "vpclmulqdq", "pclmulqdq", "sse4_2"))
    wide = narrow and all(has[f] for f in ("avx512f", "avx512bw", "avx512vl"))
    want = "vpclmulqdq" if wide else "vpclmulqdq-avx2" if narrow else None
    assert integrity.FOLD_CRC32C == want, (integrity.FOLD_CRC32C, want)
    # the plain checksum folds only over 512-bit registers (the library won over 256: integrity.py)
    assert integrity.PLAIN_FOLD == wide


def test_set_fold_switches_widths_and_refuses_one_the_cpu_lacks():
    if rawio._stream is None:
        pytest.skip("coci_hpc._stream not built")
    before = rawio._stream.set_fold(0)
    try:
        assert rawio._stream.CRC is None
        with pytest.raises(RuntimeError, match="crc32c library"):
            rawio._stream.crc32c(b"abc")
        for w in (512, 256):
            if w in _widths():
                assert rawio._stream.set_fold(w) in (0, 512, 256)
                assert rawio._stream.CRC == {512: "vpclmulqdq", 256: "vpclmulqdq-avx2"}[w]
                assert rawio._stream.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
            else:
                with pytest.raises(ValueError, match="does not run on this CPU"):
                    rawio._stream.set_fold(w)
    finally:
        rawio._stream.set_fold(before)


@fold
def test_fold_equals_the_crc32c_library_at_every_length_offset_and_chained_value(width):
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 4096 + 64, dtype=np.uint8)
    values = [0, 0xFFFFFFFF, 0x12345678]
    bad = []
    for n in range(0, 1100):
        for off in (0, 1, 63):
            v = values[n % 3]
            buf = data[off:off + n]
            want = crc32c_lib.crc32c(buf, v)
            if rawio._stream.crc32c(buf, v) != want:
                bad.append(("crc32c", n, off))
            dst_all = rng.integers(0, 256, n + 128, dtype=np.uint8)
            before = dst_all.copy()
            d = int(rng.integers(0, 64))
            if rawio._stream.copy_crc32c(dst_all[d:d + n], buf, v) != want:
                bad.append(("copy_crc32c", n, off))
            if not (np.array_equal(dst_all[d:d + n], buf) and np.array_equal(dst_all[:d], before[:d])
                    and np.array_equal(dst_all[d + n:], before[d + n:])):
                bad.append(("copy", n, off))
    assert not bad, bad[:10]


@fold
def test_fold_over_large_buffers_chunks_and_bit_flips_matches_the_library(width):
    rng = np.random.default_rng(5)
    big = rng.integers(0, 256, 3 * STREAM_MIN + 1234, dtype=np.uint8)
    assert integrity.checksum(big) == crc32c_lib.crc32c(big)
    # chaining over pieces gives the whole's value, as the library's
    assert rawio._stream.crc32c(big[STREAM_MIN:], rawio._stream.crc32c(big[:STREAM_MIN])) == crc32c_lib.crc32c(big)
    dst = np.zeros_like(big)
    assert integrity.copy_checksum(dst, big) == crc32c_lib.crc32c(big) and np.array_equal(dst, big)
    flipped = big.copy()
    flipped[2 * STREAM_MIN + 17] ^= 4      # one bit anywhere changes it
    assert integrity.checksum(flipped) != integrity.checksum(big)
    with pytest.raises(ValueError, match="bytes into a buffer of"):
        rawio._stream.copy_crc32c(dst[:-1], big)
    with pytest.raises(TypeError):
        rawio._stream.copy_crc32c(bytes(16), bytes(16))  # a read-only destination


def test_copy_checksum_declines_what_it_cannot_take_and_copies_nothing(monkeypatch):
    src = np.arange(STREAM_MIN, dtype=np.uint8)
    dst = np.zeros(STREAM_MIN, np.uint8)
    assert integrity.copy_checksum(dst, src, "crc32") is None           # another algorithm
    assert integrity.copy_checksum(dst[:-1], src) is None               # another length
    assert integrity.copy_checksum(np.zeros(2 * STREAM_MIN, np.uint8)[::2], src) is None   # strided
    assert not dst.any()
    monkeypatch.setattr(integrity, "FOLD_CRC32C", None)                 # a CPU without it
    assert integrity.copy_checksum(dst, src) is None and not dst.any()


@fold
def test_an_async_snapshot_checksums_its_host_pieces_in_the_copy_and_the_load_verifies_them(tmp_path, monkeypatch):
    """The persist's checksum thread skips the host pieces whose copy computed their CRC (the
    4 MiB weight), and the checkpoint loads, verified, bit for bit; a damaged byte is still caught."""
    import torch

    from coci_hpc.checkpoint import CheckpointManager
    from coci_hpc.errors import CheckpointCorrupt

    summed: list[int] = []
    real = rawio.checksum

    def spy(buf, kind):
        summed.append(memoryview(buf).nbytes)
        return real(buf, kind)

    monkeypatch.setattr(rawio, "checksum", spy)
    model = torch.nn.Linear(1024, 1024)          # 4 MiB weight, 4 KiB bias
    mgr = CheckpointManager(tmp_path / "ck")
    try:
        assert mgr.save_async(1, {"model": model}) == "started"
        mgr.wait()
    finally:
        mgr.close()
    assert summed and max(summed) < STREAM_MIN, summed   # the weight's CRC came from its copy
    target = torch.nn.Linear(1024, 1024)
    CheckpointManager(tmp_path / "ck").load(1, {"model": target})
    assert torch.equal(target.weight, model.weight) and torch.equal(target.bias, model.bias)
    # the CRC the copy computed is the one the load checks: damage one byte of the weight
    data = next(p for p in (tmp_path / "ck").rglob("*.h5"))
    raw = bytearray(data.read_bytes())
    w = model.weight.detach().numpy().tobytes()
    at = bytes(raw).find(w[:4096])
    assert at >= 0
    raw[at + 100] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorrupt):
        CheckpointManager(tmp_path / "ck").load(1, {"model": torch.nn.Linear(1024, 1024)})
