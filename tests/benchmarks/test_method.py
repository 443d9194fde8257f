"""The disk benchmarks' measuring method (issue 33): medians of the timed rounds, the warm-up
round apart as the cold figure, the spread beside each median, every writer in every place."""
from __future__ import annotations

import os

from benchmarks.method import MIN_ROUNDS, cached, evict, phase_breakdown, rotate, slowest_rank, spread_table, summary


def test_summary_keeps_the_cold_round_out_of_the_median_and_gives_the_spread() -> None:
    got = summary({"coci_save": [3.0, 1.0, 2.0, 9.0, 1.5, 2.5, 2.2]}, {"coci_save": 40.0})
    assert got["coci_save"] == 2.2          # the median of the timed rounds only
    assert (got["coci_save_min"], got["coci_save_max"]) == (1.0, 9.0)
    assert got["coci_save_cold"] == 40.0


def test_summary_skips_keys_without_samples() -> None:
    assert summary({"dcp_save": []}) == {}


def test_rotate_puts_every_writer_in_every_place() -> None:
    writers = ["coci", "dcp", "raw"]
    orders = [rotate(writers, k) for k in range(MIN_ROUNDS)]
    for place in range(len(writers)):
        assert {o[place] for o in orders} == set(writers)
    assert all(sorted(o) == sorted(writers) for o in orders)


def test_at_least_seven_rounds() -> None:
    assert MIN_ROUNDS >= 7


def test_spread_table_gives_each_asked_key_its_median_min_max_and_cold() -> None:
    figures = summary({"coci_save": [3.0, 1.0, 2.0], "dcp_save": [4.0, 5.0, 6.0]}, {"coci_save": 7.0})
    got = spread_table(figures, ("coci_save", "dcp_save", "raw_save"))
    assert got == {"coci_save": {"median": 2.0, "min": 1.0, "max": 3.0, "cold": 7.0},
                   "dcp_save": {"median": 5.0, "min": 4.0, "max": 6.0, "cold": None}}   # raw_save: not measured


def test_phase_breakdown_names_the_slowest_and_fastest_round_and_keeps_the_cold_one_apart() -> None:
    ranks = [[{"check_s": 0.9, "copy_s": 0.1}, {"check_s": 0.5, "open_s": 0.2}],   # the warm-up round
             [{"check_s": 0.3, "copy_s": 0.1}, {"check_s": 0.4}],
             [{"check_s": 0.8, "copy_s": 0.3}, {"check_s": 0.2, "copy_s": 0.1}]]
    per_round = [slowest_rank(r) for r in ranks]
    assert per_round[0] == {"check_s": 0.9, "copy_s": 0.1, "open_s": 0.2}   # each phase its slowest rank
    got = phase_breakdown("coci_load_phases", [0.5, 1.1], per_round, "load_s_measured")
    assert got["coci_load_phases_slowest"] == {"load_s_measured": 1.1, "check_s": 0.8, "copy_s": 0.3}
    assert got["coci_load_phases_fastest"] == {"load_s_measured": 0.5, "check_s": 0.4, "copy_s": 0.1}
    assert got["coci_load_phases_cold"] == per_round[0]
    assert phase_breakdown("x", [0.5], per_round, "t") == {}   # rounds and phases do not line up


def test_vm_reported_mib_reads_the_counter_and_is_none_without_one(tmp_path, monkeypatch) -> None:
    import benchmarks.method as method

    counter = tmp_path / "reported_kib"
    counter.write_text("2048\n")
    monkeypatch.setattr(method, "_REPORTED_KIB", str(counter))
    assert method.vm_reported_mib() == 2.0
    monkeypatch.setattr(method, "_REPORTED_KIB", str(tmp_path / "absent"))
    assert method.vm_reported_mib() is None


def test_evict_drops_the_files_it_names_and_keeps_the_kept_one(tmp_path) -> None:
    d = tmp_path / "ckpt"
    (d / "step_1").mkdir(parents=True)
    files = [d / "step_1" / "data.h5", d / "spare.h5", tmp_path / "raw.bin"]
    for f in files:
        f.write_bytes(os.urandom(1 << 20))
        f.read_bytes()
    assert all(cached(f) for f in files)
    assert evict([d, tmp_path / "raw.bin", tmp_path / "gone"], keep=[d / "spare.h5"]) == "fadvise"
    assert not cached(files[0]) and not cached(files[2])
    assert cached(files[1])            # kept: the next save writes over it, no job evicts it


def test_rate_until_counts_whole_steps_and_the_running_steps_part() -> None:
    from benchmarks.method import rate_until

    ends = [1.0, 2.0, 4.0, 5.0]          # steps of 1, 1, 2, 1 s
    assert rate_until(ends, 2.0) == 1.0  # two whole steps in 2 s
    assert rate_until(ends, 3.0) == 2.5 / 3.0  # and half of the 2-s step running at 3 s
    assert rate_until(ends, 0.5) == 1.0  # half of the first step
    # every step ended before t_end (the loop stopped first): the steps' own rate
    assert rate_until(ends, 6.0) == 4 / 5.0
    assert rate_until([], 1.0) != rate_until([], 1.0)  # nan: nothing to measure


def test_settle_vm_waits_until_the_counter_is_quiet_and_not_without_one(tmp_path, monkeypatch) -> None:
    import time

    import benchmarks.method as method

    counter = tmp_path / "reported_kib"
    counter.write_text("0\n")
    monkeypatch.setattr(method, "_REPORTED_KIB", str(counter))
    ticks = iter([1024, 2048, 2048, 2048] + [2048] * 100)  # handed back 2 MiB, then quiet

    real_sleep = time.sleep

    def sleep(s: float) -> None:
        counter.write_text(f"{next(ticks)}\n")
        real_sleep(s)

    monkeypatch.setattr(time, "sleep", sleep)
    waited, mib = method.settle_vm(quiet_s=0.3, most_s=5.0)
    assert mib == 2.0
    assert 0.3 <= waited < 2.0  # stopped once quiet, long before the bound
    monkeypatch.setattr(method, "_REPORTED_KIB", str(tmp_path / "absent"))
    assert method.settle_vm() == (0.0, 0.0)


def test_cached_mib_counts_the_resident_bytes_of_files_and_directories(tmp_path) -> None:
    import pytest

    from benchmarks import method

    d = tmp_path / "ckpt"
    (d / "step_1").mkdir(parents=True)
    a, b = d / "step_1" / "data.h5", d / "spare.h5"
    a.write_bytes(os.urandom(2 << 20))
    b.write_bytes(os.urandom(1 << 20))
    a.read_bytes(), b.read_bytes()
    assert method.cached_mib([d]) == pytest.approx(3.0, abs=0.01)
    assert method.cached_mib([a, tmp_path / "gone"]) == pytest.approx(2.0, abs=0.01)
    evict([a])
    assert method.cached_mib([d]) == pytest.approx(1.0, abs=0.01)   # what the eviction left


def test_warm_free_memory_writes_and_removes_its_scratch_file_and_does_nothing_on_bare_metal(
        tmp_path, monkeypatch) -> None:
    import benchmarks.method as method

    counter = tmp_path / "reported_kib"
    counter.write_text("0\n")
    monkeypatch.setattr(method, "_REPORTED_KIB", str(counter))
    work = tmp_path / "work"
    work.mkdir()
    seen: list[int] = []
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: bytes, off: int) -> int:
        seen.append(off + len(data))
        return real_pwrite(fd, data, off)

    monkeypatch.setattr(os, "pwrite", pwrite)
    for sync in (True, False):
        seen.clear()
        assert method.warm_free_memory(work, 20 << 20, sync=sync) > 0
        assert max(seen) == 20 << 20          # every byte asked for went through the page cache
        assert list(work.iterdir()) == []     # and the scratch file is gone
    monkeypatch.setattr(method, "_REPORTED_KIB", str(tmp_path / "absent"))
    seen.clear()
    assert method.warm_free_memory(work, 20 << 20) == 0.0 and seen == []


def test_wait_report_gap_stops_after_a_report_burst_or_a_quiet_period_and_not_without_a_counter(
        tmp_path, monkeypatch) -> None:
    import time

    import benchmarks.method as method

    counter = tmp_path / "reported_kib"
    counter.write_text("0\n")
    monkeypatch.setattr(method, "_REPORTED_KIB", str(counter))
    real_sleep = time.sleep

    def run(ticks: list[int], **kw: float) -> float:
        it = iter(ticks)

        def sleep(s: float) -> None:
            counter.write_text(f"{next(it, ticks[-1])}\n")
            real_sleep(s)

        monkeypatch.setattr(time, "sleep", sleep)
        try:
            return method.wait_report_gap(**kw)
        finally:
            monkeypatch.setattr(time, "sleep", real_sleep)

    # a pass hands back 3 x 128 MiB, then nothing: stop soon after the burst, long before quiet_s
    # (upper bounds loose: the unit phase runs niced beside the cluster tests)
    waited = run([0, 0, 131072, 262144, 393216], burst_end_s=0.1, quiet_s=6.0, most_s=12.0)
    assert 0.1 <= waited < 5.0
    # nothing pending: wait the whole quiet period (longer than a report period), not the bound
    counter.write_text("393216\n")
    waited = run([393216], burst_end_s=0.1, quiet_s=0.5, most_s=12.0)
    assert 0.5 <= waited < 5.0
    # the counter never stands still: the bound
    waited = run(list(range(0, 10**9, 1024)), burst_end_s=30.0, quiet_s=30.0, most_s=0.6)
    assert 0.6 <= waited < 5.0
    monkeypatch.setattr(method, "_REPORTED_KIB", str(tmp_path / "absent"))
    assert method.wait_report_gap() == 0.0
