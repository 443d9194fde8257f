"""The one error hierarchy of coci_hpc.

Library code raises these; only ``coci_hpc.cli`` turns them into exit codes
(``coci_hpc.cli.common.run_cli``; for a user's script that lets one escape,
``coci_hpc.runtime.errorexit``), both printing them with :func:`report_error`, the one format. A
message names the problem; ``hint`` says how to fix it.
"""
from __future__ import annotations

import sys


class CociError(Exception):
    """Base of every error coci_hpc raises on purpose."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} (hint: {self.hint})"


def report_error(prog: str, exc: CociError) -> None:
    """The one error style: ``prog: error: message`` and, when there is one, ``prog: hint: ...``.
    Here, below the CLI, so that the runtime's exit hook (runtime/errorexit.py) prints the same
    without importing the CLI layer."""
    print(f"{prog}: error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"{prog}: hint: {exc.hint}", file=sys.stderr)


class UsageError(CociError):
    """Bad arguments or configuration given by the user."""

    exit_code = 2


class InputFormatError(UsageError):
    """An input file (sacct output, profile JSON, ...) does not parse.

    ``line`` is the 1-based line number where known.
    """

    def __init__(self, message: str, *, line: int | None = None, source: str | None = None,
                 hint: str | None = None) -> None:
        where = ""
        if source is not None:
            where = f"{source}"
        if line is not None:
            where = f"{where}:{line}" if where else f"line {line}"
        super().__init__(f"{where}: {message}" if where else message, hint=hint)
        self.line = line
        self.source = source


class SlurmError(CociError):
    """A Slurm command failed or is missing."""

    exit_code = 3


class PlannerError(CociError):
    """The planner cannot produce a plan from the given numbers."""

    exit_code = 4


class CheckpointError(CociError):
    """Saving or loading a checkpoint failed."""

    exit_code = 5


class CheckpointNotFound(CheckpointError):
    """No committed checkpoint where one was asked for."""

    exit_code = 6


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint fails verification (checksum, missing shard, bad manifest)."""

    exit_code = 7


class CheckpointLocked(CheckpointError):
    """Another live writer holds the checkpoint directory (its lock file names it)."""


class CheckpointOtherRun(CheckpointError):
    """The checkpoint directory belongs to another run (another script or other arguments)."""


class CommError(CociError):
    """One or more ranks failed in a collective step; raised on every rank, naming the failed ones."""

    exit_code = 8

    def __init__(self, message: str, *, failed_ranks: dict[int, str] | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.failed_ranks = dict(failed_ranks or {})


class PeerLost(CommError):
    """A peer rank vanished (crashed, killed, its node gone): a collective did not complete within
    its deadline, or the transport reported the peer gone. The survivors save without it."""


class GaveUpError(CociError):
    """A training session stopped for good: too many requeues, or restarts that make no progress."""

    exit_code = 9
