"""The single place where coci_hpc errors become messages and exit codes."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from coci_hpc.errors import CociError, UsageError


class UsageArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors, so run_cli gives them the usage exit code (2)."""

    def error(self, message: str):
        raise UsageError(message, hint=f"see {self.prog} --help")


def run_cli(prog: str, body: Callable[[Sequence[str] | None], int | None],
            argv: Sequence[str] | None = None) -> int:
    """Run ``body(argv)``; a CociError prints ``prog: error: ...`` (and its hint) and returns its code."""
    try:
        rc = body(argv)
    except CociError as exc:
        print(f"{prog}: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"{prog}: hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)
