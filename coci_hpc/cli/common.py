"""The single place where coci_hpc errors become exit codes (printed in the one format of
:func:`coci_hpc.errors.report_error`, also importable from here), and what every coci-* tool
shares: ``--version`` (every :class:`UsageArgumentParser` has it), the ``--json`` flag
(:func:`add_json`, :func:`print_json`), the plot flag (:func:`add_plot`, :func:`plot_target`), the
missing-directory error (:func:`require_dir`) and progress on a terminal (:func:`progress`).

Exit codes are the error classes' (:mod:`coci_hpc.errors`): 0 done, 1 unexpected, 2 bad usage,
3 Slurm, 4 planner, 5 checkpoint, 6 no checkpoint (or no such directory), 7 corrupt checkpoint,
8 communication, 9 gave up, 130 interrupted, 141 output pipe closed (``| head``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# report_error (the one error style) lives in coci_hpc.errors, below every layer; importable here too.
from coci_hpc.errors import CheckpointNotFound, CociError, UsageError, report_error

EXIT_PIPE = 141          # 128 + SIGPIPE, what a C tool killed by the closed pipe reports
# What matplotlib writes without extra packages; anything else (out.txt) is refused up front.
PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def version() -> str:
    """The installed coci_hpc's version (the package metadata; the source's when not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as meta_version
    try:
        return meta_version("coci_hpc")
    except PackageNotFoundError:
        from coci_hpc import __version__
        return __version__


class _VersionAction(argparse.Action):
    """``--version``: the metadata is read only when asked (no cost for other calls)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog} (coci_hpc) {version()}")
        parser.exit()


class UsageArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors, so run_cli gives them the usage exit code (2).
    Every coci-* tool built on it answers ``--version``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action=_VersionAction, help="print the version and exit")

    def error(self, message: str):
        raise UsageError(message, hint=f"see {self.prog} --help")


def add_json(p: argparse.ArgumentParser, what: str = "the result") -> None:
    """The ``--json`` convention: one JSON object on stdout (messages stay on stderr)."""
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON object on stdout")


def _plain(o: Any) -> Any:
    if hasattr(o, "item") and callable(o.item):        # numpy scalars
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON: {type(o).__name__}")


def _no_nan(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return x


def print_json(obj: Any) -> None:
    """``obj`` as strict JSON (NaN and inf become null, numpy scalars numbers)."""
    print(json.dumps(_no_nan(obj), indent=1, allow_nan=False, default=_plain))


def require_dir(path: str | os.PathLike, what: str = "checkpoint directory", hint: str | None = None) -> Path:
    """``path`` as a directory, or the one error (and exit code 6) every tool gives for a missing one."""
    p = Path(path)
    if not p.is_dir():
        why = "does not exist" if not p.exists() else "is not a directory"
        raise CheckpointNotFound(f"{what} {p} {why}",
                                 hint=hint or "pass the directory the run used (coci-submit prints it)")
    return p


def add_plot(p: argparse.ArgumentParser, help: str) -> None:
    """The plot flag of every tool: ``--plot FILE`` (.png, .pdf, .svg); ``--png`` is its old name."""
    p.add_argument("--plot", metavar="FILE.png", help=help)
    p.add_argument("--png", dest="png_deprecated", metavar="FILE.png", help=argparse.SUPPRESS)


def plot_target(args: argparse.Namespace, prog: str, default_name: str) -> Path | None:
    """Where to write the plot the user asked for (None: not asked), checked before any work:

    a directory gets ``default_name`` inside it; a name without a suffix gets ``.png``; another
    suffix than an image's is a UsageError (matplotlib would fail after the work, or write
    ``out.txt.png`` while the user looks for ``out.txt``)."""
    value = args.plot
    old = getattr(args, "png_deprecated", None)
    if old is not None:
        print(f"{prog}: --png is deprecated, use --plot", file=sys.stderr)
        if value is not None and value != old:
            raise UsageError("--plot and --png (its old name) name different files", hint="give --plot only")
        value = value or old
    if value is None:
        return None
    target = Path(value)
    if target.is_dir():
        target = target / default_name
    elif not target.suffix:
        target = target.with_suffix(".png")
    elif target.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"cannot write a plot to {value}: {target.suffix!r} is not an image format",
                         hint=f"name the file with one of {', '.join(PLOT_SUFFIXES)}, e.g. --plot {target.stem}.png")
    return target


def on_terminal() -> bool:
    return sys.stderr.isatty()


@contextmanager
def progress(prog: str, what: str, after_s: float = 2.0) -> Iterator[None]:
    """Say ``what`` on stderr when it takes more than ``after_s`` seconds, on a terminal only
    (a log or a pipe gets nothing): a spinner-free line, then how long it took."""
    if not on_terminal():
        yield
        return
    import threading
    done = threading.Event()
    t0 = time.monotonic()

    def say() -> None:
        if not done.wait(after_s):
            print(f"{prog}: {what} ...", file=sys.stderr, flush=True)
            done.wait()
            print(f"{prog}: {what}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    th = threading.Thread(target=say, daemon=True)
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join(timeout=1.0)


def _pipe_closed() -> int:
    # The reader left (| head): stop quietly; stdout goes to /dev/null so the interpreter's final
    # flush does not raise again.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_PIPE


def run_cli(prog: str, body: Callable[[Sequence[str] | None], int | None],
            argv: Sequence[str] | None = None) -> int:
    """Run ``body(argv)``; a CociError prints ``prog: error: ...`` (and its hint) and returns its code."""
    try:
        rc = body(argv)
        sys.stdout.flush()                 # a closed pipe shows here, not at the interpreter's exit
    except CociError as exc:
        report_error(prog, exc)
        return exc.exit_code
    except BrokenPipeError:
        return _pipe_closed()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)
