"""rawio.stream_copy: the load's copies into the state with streaming stores (coci_hpc/_stream.c),
byte for byte what ``numpy.copyto`` gives, at every alignment and length, and the fallback."""
from __future__ import annotations

import mmap
import platform

import numpy as np
import pytest

from coci_hpc.checkpoint import rawio
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
