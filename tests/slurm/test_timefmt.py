"""coci_hpc.slurm.timefmt: Slurm's printed durations and the one grammar of typed durations (--time, --horizon).

The same text means different things in the two Slurm grammars: a bare "30" is 30 seconds as
Slurm prints it (squeue %L) and 30 minutes as sbatch --time takes it; "1-12" is 1 day 12 hours in
both (it once read as 1 day 12 seconds)."""
from __future__ import annotations

import pytest

from coci_hpc.errors import UsageError
from coci_hpc.slurm.timefmt import limit_min, printed_s, read_duration


@pytest.mark.parametrize("text,seconds", [("1-02:03:04", 93784), ("02:03:04", 7384), ("3:04", 184),
                                          ("1-12", 129600), ("1-12:30", 131400),  # D-HH, D-HH:MM
                                          ("30", 30), ("0:00", 0),
                                          ("UNLIMITED", None), ("INVALID", None), ("", None)])
def test_printed_durations(text: str, seconds: float | None) -> None:
    assert printed_s(text) == seconds


@pytest.mark.parametrize("text", ["1:2:3:4", "abc", "1-x"])
def test_a_printed_duration_that_is_none_of_slurms_forms(text: str) -> None:
    with pytest.raises(ValueError):
        printed_s(text)


@pytest.mark.parametrize("text,minutes", [
    ("30", 30), ("30:00", 30), ("0:30", 1), ("5:01", 6), ("2:00:00", 120), ("1-0", 1440), ("1-12", 2160),
    ("1-2:30", 1590), ("1-02:30:30", 1591), ("90", 90), ("0:0:59", 1), (" 10 ", 10),
    ("2h", 120), ("90m", 90), ("1d12h", 2160), ("1h30m", 90), ("45s", 1), ("1.5h", 90),
])
def test_sbatch_time_limits(text: str, minutes: int) -> None:
    assert limit_min(text) == minutes


def test_a_bare_number_is_seconds_printed_and_minutes_as_a_limit() -> None:
    assert printed_s("30") == 30 and limit_min("30") == 30  # 30 s vs 30 min
    assert printed_s("1-12") == limit_min("1-12") * 60      # the day forms agree


@pytest.mark.parametrize("text", ["INFINITE", "unlimited"])
def test_unlimited_time(text: str) -> None:
    assert limit_min(text) is None


@pytest.mark.parametrize("text", ["", "1h1h", "30m2h", "1:2:3:4", "1-24", "1-1:60", "10:60", "1:60:00", "-1", "0", "0:00", "1.5"])
def test_bad_sbatch_time(text: str) -> None:
    with pytest.raises(UsageError) as e:
        limit_min(text)
    assert e.value.hint and ("Slurm" in e.value.hint or "positive" in e.value.hint)


@pytest.mark.parametrize("text,seconds", [("90m", 5400), ("24h", 86400), ("2d", 172800), ("1d12h", 129600),
                                          ("1.5h", 5400), ("1h30m", 5400), ("45s", 45),
                                          ("1-00:00:00", 86400), ("12:00:00", 43200), ("1:30", 90), ("1-12", 129600)])
def test_one_grammar_for_every_tool(text: str, seconds: float) -> None:
    """coci-plan's --horizon and coci-submit's --time read a duration the same way (issue 26, 9)."""
    assert read_duration(text, flag="--horizon", bare=None).seconds == seconds
    assert limit_min(text) == -(-seconds // 60)


def test_errors_say_how_the_value_was_read() -> None:
    assert read_duration("1:30", flag="-t").reading() == "'1:30' read as MM:SS = 1 min 30 s"
    assert read_duration("90", flag="-t").reading().endswith("= 1 h 30 min")
    assert read_duration("1-12", flag="-t").reading() == "'1-12' read as D-HH = 1 d 12 h"


def test_a_bare_number_where_it_once_meant_seconds_asks_for_the_unit() -> None:
    with pytest.raises(UsageError, match=r"--horizon '3600' has no unit") as e:
        read_duration("3600", flag="--horizon", bare=None)
    assert "3600s" in (e.value.hint or "") and "3600m" in (e.value.hint or "")


@pytest.mark.parametrize("text", ["", "UNLIMITED", "3w", "nan", "1h1h", "-2h", "1:60"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(UsageError, match="is not a duration|has no unit") as e:
        read_duration(text, flag="--horizon", bare=None)
    assert "2h" in (e.value.hint or "") or "unit" in (e.value.hint or "")
