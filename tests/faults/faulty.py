"""Fault injection through the storage protocol (test-only): a writer that pauses inside a save.

Production code reads no fault knob; a test wraps the writers instead. In a test process,
:class:`FaultyWriter` is passed or patched in directly. A job script run as a subprocess (under
mpiexec, or submitted to the cluster) is started through this module, which reads the knobs
below from the environment, installs the faulty writers and then runs the script::

    python -m tests.faults.faulty job.py ARGS...      # or: python tests/faults/faulty.py job.py ARGS...

Knobs (the environment of the job, never of a real run):

* ``COCI_FAULT_SAVE_PAUSE_S``: rank ``COCI_FAULT_SAVE_PAUSE_RANK`` (default 1) sleeps this many
  seconds inside one regular save while the other ranks wait in that save's next collective
  (a test kills it there). ``COCI_FAULT_SAVE_PAUSE_AT`` says where: "prepare" (default: as the
  file is created, the others wait in a polled collective) or "mpiio" (a synchronous save's
  collective write, just before MPI-IO: the others wait inside MPI-IO, which only the guard's
  timer can notice). Once per checkpoint directory (a marker file: a requeued run does not
  pause again).
* ``COCI_FAULT_SURVIVORS_PAUSE_S``: the survivors' writer sleeps this many seconds after its
  shards are written, before they are checked and the manifest is written.
"""
from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

SAVE_PAUSE_ENV = "COCI_FAULT_SAVE_PAUSE_S"
SURVIVORS_PAUSE_ENV = "COCI_FAULT_SURVIVORS_PAUSE_S"
MARKER = ".fault-save-paused"


class FaultyWriter:
    """A :class:`~coci_hpc.checkpoint.protocol.StorageWriter` that delegates to ``inner`` and
    sleeps ``pause_s`` at ``at``: "prepare" (``create``), "mpiio" (a collective ``write``) or
    "written" (after ``write_independent``). ``once``: only the first time under a checkpoint
    root (a marker file there). ``label``: how the printed line names the knob."""

    def __init__(self, inner: Any, *, pause_s: float, at: str = "prepare", once: bool = True,
                 label: str = SAVE_PAUSE_ENV, rank: int = 0) -> None:
        self.inner, self.pause_s, self.at, self.once, self.label, self.rank = inner, pause_s, at, once, label, rank
        self.name: str = inner.name
        self.collective_write: bool = inner.collective_write

    def create(self, directory: Path, datasets: Sequence[Any] | None, tuning: Any) -> dict[int, int]:
        if self.at == "prepare":
            self._pause(directory)
        return self.inner.create(directory, datasets, tuning)  # type: ignore[no-any-return]

    def write(self, path: Path, items: Sequence[Any], tuning: Any) -> list[int]:
        if self.at == "mpiio" and self.collective_write:
            self._pause(path.parent)
        return self.inner.write(path, items, tuning)  # type: ignore[no-any-return]

    def write_independent(self, path: Path, items: Sequence[Any], tuning: Any, *,
                          direct: bool = False) -> list[int]:
        crcs: list[int] = self.inner.write_independent(path, items, tuning, direct=direct)
        if self.at == "written":
            self._pause(path.parent)
        return crcs

    def _pause(self, step_dir: Path) -> None:
        if self.once:
            try:
                os.close(os.open(step_dir.parent / MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                return
        where = {"prepare": f"rank {self.rank} pauses in the save of {step_dir.name}, at prepare",
                 "mpiio": f"rank {self.rank} pauses in the save of {step_dir.name}, at mpiio",
                 "written": f"the survivors' save of {step_dir.name} pauses before its manifest"}[self.at]
        print(f"coci: FAULT INJECTION ({self.label}={self.pause_s:g}): {where}", file=sys.stderr, flush=True)
        time.sleep(self.pause_s)


def patch_writes(fn: Callable[..., list[int]], set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Route both backends' non-collective writes through ``fn(path, items, **kw)`` (a function
    like :func:`~coci_hpc.checkpoint.rawio.write_posix`, which it may call): ``write_independent``
    (the async save's thread, its retry, the survivors' save) and the serial backend's ``write``.
    ``set_attr``: ``monkeypatch.setattr`` in a test (undone after it)."""
    from coci_hpc.checkpoint.h5_parallel import ParallelH5Writer
    from coci_hpc.checkpoint.h5_serial import SerialH5Writer

    def independent(self: Any, path: Path, items: Sequence[Any], tuning: Any, *, direct: bool = False) -> list[int]:
        return fn(path, items, direct=direct)

    def serial(self: Any, path: Path, items: Sequence[Any], tuning: Any) -> list[int]:
        return fn(path, items)

    for cls in (SerialH5Writer, ParallelH5Writer):
        set_attr(cls, "write_independent", independent)
    set_attr(SerialH5Writer, "write", serial)


def install(environ: Mapping[str, str]) -> None:
    """Wrap the writers the checkpoint manager and the survivors' save make, as ``environ`` says."""
    from coci_hpc.checkpoint import api
    from coci_hpc.runtime import survivors

    save_pause = float(environ.get(SAVE_PAUSE_ENV) or 0)
    if save_pause > 0:
        make = api.make_writer
        rank = int(environ.get("COCI_FAULT_SAVE_PAUSE_RANK", "1"))
        at = environ.get("COCI_FAULT_SAVE_PAUSE_AT", "prepare")

        def faulty(comm: Any, backend: str) -> Any:
            writer = make(comm, backend)
            return FaultyWriter(writer, pause_s=save_pause, at=at, rank=comm.rank) if comm.rank == rank else writer
        api.make_writer = faulty  # type: ignore[assignment]
    survivors_pause = float(environ.get(SURVIVORS_PAUSE_ENV) or 0)
    if survivors_pause > 0:
        make_survivors = survivors.make_writer
        survivors.make_writer = lambda: FaultyWriter(  # type: ignore[assignment]
            make_survivors(), pause_s=survivors_pause, at="written", once=False, label=SURVIVORS_PAUSE_ENV)


def main(argv: Sequence[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m tests.faults.faulty SCRIPT [ARGS...]")
    install(os.environ)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as if the script were run itself
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
