"""coci-status: what happened to a run (attempts, why each ended, checkpoints, steps lost, restart latency).

    coci-status CKPT_DIR [--plot history.png] [--json] [--no-sacct]

Reads <CKPT_DIR>/events.jsonl (written by the Session) and asks sacct about the run's jobs. With
--plot FILE (.png, .pdf or .svg; a directory gets history.png inside it) it also draws the loss
curve with checkpoints and interruptions marked, and prints where it wrote it. Nothing is written
unless asked (the checkpoint directory is the run's).

Exit codes: 0 shown, 2 no event log there (or bad usage), 6 no such directory.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from coci_hpc.cli.common import (
    UsageArgumentParser,
    add_json,
    add_plot,
    plot_target,
    print_json,
    progress,
    require_dir,
    run_cli,
)

PROG = "coci-status"


def _main(argv: Sequence[str] | None) -> int:
    p = UsageArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("ckpt_dir", help="the run's checkpoint directory (coci-submit --ckpt-dir)")
    add_plot(p, "also draw the loss curve into this file (.png, .pdf, .svg; a directory: history.png in it)")
    p.add_argument("--no-png", action="store_true", help=argparse.SUPPRESS)   # the old default's opt-out
    add_json(p, "the history")
    p.add_argument("--no-sacct", action="store_true", help="do not ask Slurm (the event log alone)")
    a = p.parse_args(argv)
    require_dir(a.ckpt_dir, hint="pass the --ckpt-dir the run used (coci-submit prints it)")
    target = plot_target(a, PROG, "history.png")
    # history imports the Slurm helpers; kept out of --help's path.
    from coci_hpc import history
    with progress(PROG, "reading the event log" + ("" if a.no_sacct else " and asking sacct")):
        h = history.load(a.ckpt_dir, use_sacct=not a.no_sacct)
    png, png_error = None, None
    if target is not None:
        try:
            with progress(PROG, f"drawing {target}"):
                png = history.plot(h, target)
        except OSError as exc:     # a read-only place must not hide the table
            png_error = f"loss plot not written to {target}: {exc.strerror or exc}; pass another --plot FILE"
    if a.json:
        d = h.to_dict()
        d["plot"] = str(png) if png else None
        d["plot_error"] = png_error
        print_json(d)
        if png:
            print(f"{PROG}: plot written to {png}", file=sys.stderr)
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
