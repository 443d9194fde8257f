"""coci_hpc.slurm.commands: Slurm's command lines and what their output means (fake runners)."""
from __future__ import annotations

from collections.abc import Sequence

from coci_hpc.slurm.commands import step_active


def test_step_active_reads_squeue_steps() -> None:
    seen: list[list[str]] = []

    def squeue(argv: Sequence[str]) -> str:
        seen.append(list(argv))
        return "77.0\n77.2\n"  # squeue -h --steps -o %i

    assert step_active("77", "2", runner=squeue) is True
    assert step_active("77", "1", runner=squeue) is False
    assert step_active("77", "batch", runner=squeue) is None  # not every Slurm lists batch steps
    assert seen[0] == ["squeue", "-h", "--steps", "-j", "77", "-o", "%i"]
