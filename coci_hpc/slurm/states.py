"""Slurm's job states, grouped by the question each group answers (they differ on PREEMPTED).

- :data:`NOT_ACTIVE`: squeue shows the job, but nothing of it runs or waits to run: is the job
  over for now? A PREEMPTED job is (its requeue, if any, shows as PENDING again).
- :data:`RUN_OVER`: sacct's row of an attempt says the run will not come back by itself: is the
  run over? Not PREEMPTED nor REQUEUED: a preempted attempt of a requeueable job comes back.
- :data:`AFTER_A_STOP`: the states an attempt that the Session stopped (its ``stop`` record) may
  end in: was this end the Session's own stop?
- :data:`ANNOUNCED` / :data:`UNANNOUNCED`: did Slurm warn the job before ending it (a signal
  ahead of preemption, the time limit, the deadline), or not (a node failure)?
"""
from __future__ import annotations

NOT_ACTIVE = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
              "BOOT_FAIL", "DEADLINE")
RUN_OVER = ("CANCELLED", "FAILED", "COMPLETED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
AFTER_A_STOP = ("REQUEUED", "PREEMPTED", "TIMEOUT", "COMPLETED", "CANCELLED")
ANNOUNCED = ("PREEMPTED", "TIMEOUT", "DEADLINE")
UNANNOUNCED = ("NODE_FAIL",)
