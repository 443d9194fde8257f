"""coci_hpc.slurm.sacct: one job's attempts as sacct records them."""
from __future__ import annotations

from collections.abc import Sequence

from coci_hpc.slurm import sacct

SACCT = """41|PREEMPTED|2026-11-22T10:00:00|2026-11-22T10:00:09|n[1-2]
41|NODE_FAIL|2026-11-22T10:00:30|2026-11-22T10:01:00|n[1-2]
41|CANCELLED by 0|2026-11-22T10:01:40|2026-11-22T10:01:50|n1
41|RUNNING|2026-11-22T10:02:10|Unknown|n[1-2]
41.batch|RUNNING|2026-11-22T10:02:10|Unknown|n1
"""


def test_parse_job_attempts_keeps_the_job_rows_in_order() -> None:
    rows = sacct.parse_job_attempts(SACCT, "41")
    assert [r.state for r in rows] == ["PREEMPTED", "NODE_FAIL", "CANCELLED", "RUNNING"]
    assert rows[1].end is not None and rows[3].end is None
    assert sacct.job_attempts_argv("7_1")[-2:] == ["7_1", "--format=JobID,State,Start,End,NodeList"]


def test_job_attempts_runs_the_one_command_line() -> None:
    seen: list[list[str]] = []

    def runner(argv: Sequence[str]) -> str:
        seen.append(list(argv))
        return SACCT

    assert len(sacct.job_attempts("41", runner)) == 4
    assert seen == [sacct.job_attempts_argv("41")]
