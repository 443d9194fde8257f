"""When a cluster test runs once more: only when a rank crashed inside MPI_Init (tests/conftest.py)."""
from __future__ import annotations

from tests.conftest import _nil_crash_before_a_step

CRASH = ("[vm:31806] *** Process received signal ***\n"
         "[vm:31806] Signal: Segmentation fault (11)\n"
         "[vm:31806] Signal code: Address not mapped (1)\n"
         "[vm:31806] Failing at address: (nil)\n")


def test_a_nil_crash_in_an_attempt_that_printed_no_step_counts_even_after_earlier_attempts() -> None:
    first = "coci: job 7 attempt 1 on n[1-2] at T\nstep=1 loss=0.5\nstep=2 loss=0.4\n"
    third = "coci: job 7 attempt 3 on n[1-2] at T\n" + CRASH + "srun: error: n2: task 1: Segmentation fault\n"
    assert _nil_crash_before_a_step(first + third)            # stop 45: the story test's third attempt
    assert _nil_crash_before_a_step(CRASH)                    # a job of one attempt
    assert not _nil_crash_before_a_step(first + CRASH)        # after a step of the same attempt: not MPI_Init
    assert not _nil_crash_before_a_step(first + third.replace("(nil)", "0x10"))
