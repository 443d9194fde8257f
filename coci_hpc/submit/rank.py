"""One training rank of a ``--spare-nodes`` job: ``python -m coci_hpc.submit.rank SCRIPT ARGS...``.

The relaunch loop (:mod:`coci_hpc.runtime.relaunch`) starts this with ``srun`` on every rank; it
runs the script in-process exactly as submitit's runner does without spare nodes, so the Session
owns the signals. The COCI_* environment comes from the batch script's setup lines.
"""
from __future__ import annotations

import sys

from coci_hpc.submit.runner import ScriptRunner


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m coci_hpc.submit.rank SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    return ScriptRunner(argv[0], tuple(argv[1:]), {})()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
