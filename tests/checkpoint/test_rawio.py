"""rawio's page-wise writer (:func:`~coci_hpc.checkpoint.rawio.pwrite_pages`), shared by the
store's posix writer and the export: whole pages through ``O_DIRECT``, the rest buffered; a
refused direct write (EINVAL) goes on buffered, any other error is raised."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from coci_hpc.checkpoint import rawio
from coci_hpc.checkpoint.integrity import checksum
from coci_hpc.checkpoint.rawio import DIRECT_ALIGN, WriteItem, aligned_empty, open_direct, pwrite_pages, write_posix


def _payload(n: int, seed: int) -> np.ndarray:
    buf = aligned_empty(n)
    buf[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return buf


@pytest.mark.parametrize("n,offset", [(3 * DIRECT_ALIGN + 17, 0), (2 * DIRECT_ALIGN, DIRECT_ALIGN),
                                      (DIRECT_ALIGN + 5, 100), (10, 0)])
def test_pages_and_tail_land_where_they_belong(tmp_path, n, offset):
    path = tmp_path / "f"
    path.write_bytes(b"")
    buf = _payload(n, n)
    fd = os.open(path, os.O_WRONLY)
    dfd = open_direct(path)
    try:
        dfd = pwrite_pages(fd, dfd, buf, offset)
    finally:
        os.close(fd)
        if dfd is not None:
            os.close(dfd)
    assert path.read_bytes()[offset:] == buf.tobytes()


def _refusing(monkeypatch, err: int) -> list[int]:
    """Direct descriptors whose writes fail with ``err`` (the buffered one works)."""
    direct: list[int] = []
    real_open, real_write = rawio.open_direct, rawio.pwrite_all

    def opening(path):  # type: ignore[no-untyped-def]
        fd = real_open(path) or os.open(path, os.O_WRONLY)  # a filesystem without O_DIRECT: a stand-in
        direct.append(fd)
        return fd

    def writing(fd, buf, offset):  # type: ignore[no-untyped-def]
        if fd in direct:
            raise OSError(err, os.strerror(err))
        real_write(fd, buf, offset)

    monkeypatch.setattr(rawio, "open_direct", opening)
    monkeypatch.setattr(rawio, "pwrite_all", writing)
    return direct


@pytest.mark.parametrize("err", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_refused_direct_write_goes_on_through_the_page_cache(tmp_path, monkeypatch, err):
    direct = _refusing(monkeypatch, err)
    path = tmp_path / "f"
    path.write_bytes(b"")
    items = [WriteItem(buf=_payload(2 * DIRECT_ALIGN + 3, 1), offset=0),
             WriteItem(buf=_payload(DIRECT_ALIGN, 2), offset=3 * DIRECT_ALIGN)]
    write_posix(path, items, direct=True)
    data = path.read_bytes()
    assert direct, "no direct descriptor was opened"
    assert data[:items[0].buf.nbytes] == items[0].buf.tobytes()
    assert data[3 * DIRECT_ALIGN:] == items[1].buf.tobytes()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_full_disk_or_an_io_error_on_a_direct_write_is_raised(tmp_path, monkeypatch, err):
    """Not retried buffered (until 2026-11-30 the posix writer retried on any OSError: the
    same bytes into the page cache, to fail at the fsync or not at all)."""
    _refusing(monkeypatch, err)
    path = tmp_path / "f"
    path.write_bytes(b"")
    with pytest.raises(OSError) as got:
        write_posix(path, [WriteItem(buf=_payload(2 * DIRECT_ALIGN, 3), offset=0)], direct=True)
    assert got.value.errno == err


def _vmflags(addr: int) -> set[str]:
    """The VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a <= addr < b
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_a_huge_snapshot_buffer_is_2mib_aligned_advised_for_huge_pages_and_not_inherited_by_forks():
    n = 3 * rawio.HUGE_PAGE + 4097
    buf = rawio.aligned_empty(n, huge=True)
    assert buf.nbytes == n and buf.ctypes.data % rawio.HUGE_PAGE == 0 and buf.flags.writeable
    buf[:] = 7
    flags = _vmflags(buf.ctypes.data)
    assert "dc" in flags, flags                        # MADV_DONTFORK: a forked worker has no copy
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read() \
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else "[never]"
    if "[never]" not in thp:
        assert "hg" in flags, flags                    # MADV_HUGEPAGE
    # small or not huge: the plain shared mapping, page-aligned
    small = rawio.aligned_empty(rawio.HUGE_PAGE - 1, huge=True)
    plain = rawio.aligned_empty(n)
    assert small.ctypes.data % rawio.DIRECT_ALIGN == 0 and plain.ctypes.data % rawio.DIRECT_ALIGN == 0
    assert "dc" not in _vmflags(plain.ctypes.data)


def test_direct_writes_from_a_huge_buffer_land_exactly(tmp_path):
    n = 2 * rawio.HUGE_PAGE + 12345
    buf = rawio.aligned_empty(n, huge=True)
    buf[:] = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(b"\0" * (n + 8192))
    crcs = rawio.write_posix(path, [rawio.WriteItem(4096, buf)], direct=True)
    data = path.read_bytes()
    assert data[4096:4096 + n] == buf.tobytes() and crcs == [checksum(buf)]


# ------------------------------------------------ the sync save's staged direct writes (issue 33)
def _unaligned(n: int, seed: int) -> np.ndarray:
    """``n`` random bytes at an address that is not page-aligned (a live tensor's)."""
    whole = np.random.default_rng(seed).integers(0, 256, n + 128, dtype=np.uint8)
    at = -whole.ctypes.data % 64                              # 64-byte aligned, as torch's ...
    if (whole.ctypes.data + at) % DIRECT_ALIGN == 0:
        at += 64                                              # ... but not at a page start
    return whole[at:at + n]


def _counting(monkeypatch) -> dict[str, int]:
    """Bytes written through direct descriptors and through buffered ones."""
    count = {"direct": 0, "buffered": 0}
    real_open, real_write = rawio.open_direct, rawio.pwrite_all
    direct: set[int] = set()

    def opening(path):  # type: ignore[no-untyped-def]
        fd = real_open(path)
        if fd is not None:
            direct.add(fd)
        return fd

    def writing(fd, buf, offset):  # type: ignore[no-untyped-def]
        count["direct" if fd in direct else "buffered"] += buf.nbytes
        real_write(fd, buf, offset)

    monkeypatch.setattr(rawio, "open_direct", opening)
    monkeypatch.setattr(rawio, "pwrite_all", writing)
    return count


@pytest.mark.parametrize("fused", [True, False])
def test_unaligned_items_are_staged_written_direct_and_their_crcs_right(tmp_path, monkeypatch, fused):
    """Live tensors (not page-aligned, at unaligned offsets, larger than one staging buffer, next
    to small items and to each other within one page) land byte-exact, with the CRC-32C of each,
    and all but the partial pages at their ends go through the direct descriptor."""
    if fused and not rawio.FUSED_COPY_CRC:
        pytest.skip("this CPU has no folded CRC-32C")
    monkeypatch.setattr(rawio, "FUSED_COPY_CRC", fused)
    monkeypatch.setattr(rawio, "STAGE_CHUNK", 3 * DIRECT_ALIGN * 64 + 512)  # several parts per item
    count = _counting(monkeypatch)
    mib = 1 << 20
    items = [WriteItem(100, _unaligned(3 * mib + 7, 1)),
             WriteItem(100 + 3 * mib + 7, _unaligned(2 * mib, 2)),           # shares a page with the first
             WriteItem(6 * mib, _unaligned(333, 3)),                         # small: buffered, unstaged
             WriteItem(7 * mib, _payload(mib, 4)),                           # aligned: direct, unstaged
             WriteItem(9 * mib + 4095, _unaligned(mib + 1, 5))]
    path = tmp_path / "f"
    path.write_bytes(b"")
    crcs = write_posix(path, items, direct=True)
    data = path.read_bytes()
    for it, crc in zip(items, crcs, strict=True):
        assert data[it.offset:it.offset + it.buf.nbytes] == it.buf.tobytes()
        assert crc == checksum(it.buf)
    total = sum(it.buf.nbytes for it in items)
    if open_direct(path) is None:
        pytest.skip("this filesystem refuses O_DIRECT: only correctness checked")
    assert count["direct"] + count["buffered"] == total
    assert count["buffered"] < 333 + 2 * DIRECT_ALIGN * 20, count   # the ends of each part only


def test_staged_writes_go_on_through_the_page_cache_where_direct_is_refused(tmp_path, monkeypatch):
    direct = _refusing(monkeypatch, errno.EINVAL)
    monkeypatch.setattr(rawio, "STAGE_CHUNK", 256 * 1024)
    items = [WriteItem(10, _unaligned(3 << 20, 6)), WriteItem(5 << 20, _unaligned(2 << 20, 7))]
    path = tmp_path / "f"
    path.write_bytes(b"")
    crcs = write_posix(path, items, direct=True)
    data = path.read_bytes()
    assert direct, "no direct descriptor was opened"
    for it, crc in zip(items, crcs, strict=True):
        assert data[it.offset:it.offset + it.buf.nbytes] == it.buf.tobytes() and crc == checksum(it.buf)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_failed_staged_write_is_raised_after_the_write_in_flight_finished(tmp_path, monkeypatch, err):
    """The error of a write in the helper thread reaches the caller (no hang, no half-seen
    success), and the next staged save works (the buffers were released)."""
    monkeypatch.setattr(rawio, "STAGE_CHUNK", 256 * 1024)
    real, calls = rawio._write_span, []

    def failing(fd, dfd, buf, offset):  # type: ignore[no-untyped-def]
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(err, os.strerror(err))
        return real(fd, dfd, buf, offset)

    monkeypatch.setattr(rawio, "_write_span", failing)
    path = tmp_path / "f"
    path.write_bytes(b"")
    with pytest.raises(OSError) as got:
        write_posix(path, [WriteItem(10, _unaligned(3 << 20, 8))], direct=True)
    assert got.value.errno == err and len(calls) == 3   # nothing written after the failed part
    monkeypatch.setattr(rawio, "_write_span", real)
    item = WriteItem(10, _unaligned(3 << 20, 9))
    assert write_posix(path, [item], direct=True) == [checksum(item.buf)]
    assert path.read_bytes()[10:10 + item.buf.nbytes] == item.buf.tobytes()


def test_a_managers_sync_save_writes_direct_and_its_close_frees_the_staging_buffers(tmp_path, monkeypatch):
    import torch

    from coci_hpc.checkpoint import CheckpointManager

    count = _counting(monkeypatch)
    state = {"w": torch.randn(3 << 18), "b": torch.randn(7)}     # 3 MiB, and a small leaf
    mgr = CheckpointManager(tmp_path / "ck", comm=None)
    mgr.save(1, state)
    want = state["w"].clone()
    state["w"].zero_()
    mgr.load(1, state)
    assert torch.equal(state["w"], want)
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    dfd = open_direct(probe)
    if dfd is not None:
        os.close(dfd)
        assert count["direct"] >= (3 << 20) - 2 * DIRECT_ALIGN, count   # all but the ends' pages
    write_posix(probe, [WriteItem(10, _unaligned(2 << 20, 11))], direct=True)
    assert rawio._stage_bufs or dfd is None
    mgr.close()
    assert not rawio._stage_bufs
