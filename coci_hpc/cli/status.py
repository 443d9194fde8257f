"""coci-status: what happened to a run (attempts, why each ended, checkpoints, steps lost, restart latency).

    coci-status CKPT_DIR [--png loss.png] [--json] [--no-sacct]

Reads <CKPT_DIR>/events.jsonl (written by the Session) and asks sacct about the run's jobs. Writes
a PNG of the loss curve with checkpoints and interruptions marked (default <CKPT_DIR>/history.png).

Exit codes: 0 shown, 2 no event log there (or bad usage).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from coci_hpc import history
from coci_hpc.cli.common import UsageArgumentParser, run_cli

PROG = "coci-status"


def _main(argv: Sequence[str] | None) -> int:
    p = UsageArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("ckpt_dir", help="the run's checkpoint directory (coci-submit --ckpt-dir)")
    p.add_argument("--png", help="where to write the loss plot (default <ckpt_dir>/history.png)")
    p.add_argument("--no-png", action="store_true", help="write no plot")
    p.add_argument("--json", action="store_true", help="print the history as JSON instead of a table")
    p.add_argument("--no-sacct", action="store_true", help="do not ask Slurm (the event log alone)")
    a = p.parse_args(argv)
    h = history.load(a.ckpt_dir, use_sacct=not a.no_sacct)
    png, png_error = None, None
    if not a.no_png:
        target = a.png or Path(a.ckpt_dir) / "history.png"
        try:
            png = history.plot(h, target)
        except OSError as exc:     # a read-only run directory must not hide the table
            png_error = f"loss plot not written to {target}: {exc.strerror or exc}; pass --png PATH or --no-png"
    if a.json:
        d = h.to_dict()
        d["png"] = str(png) if png else None
        d["png_error"] = png_error
        print(json.dumps(d, indent=2))
    else:
        print(history.render_text(h))
        if png:
            print(f"loss plot: {png}")
    if png_error:
        print(f"{PROG}: {png_error}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
