"""Which run a checkpoint directory belongs to: one run, one directory.

A sweep that reused a directory (``train.py --seed 7`` after ``train.py --seed 0``) resumed the
other run's weights and "completed" at once. So every attempt records its run (the script, its
arguments and the world size) in its ``attempt_start`` record of ``events.jsonl``, and a Session
whose script or arguments differ from the directory's last recorded run is refused at
``Session()``, before anything is loaded or written, unless it is told to resume from the other
run (``resume_from_other_run=True``, ``COCI_RESUME_FROM_OTHER_RUN=1``, coci-submit
``--resume-from-other-run``); the new run is then recorded and is the directory's run from then on.

The world size is recorded, not compared: the checkpoint store reshards (2 ranks -> 1), so an
attempt on fewer or more nodes is the same run.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HINT = ("give this run its own checkpoint directory (--ckpt-dir; coci-submit's default is distinct per "
        "command), or, to continue from that run's checkpoint on purpose, pass --resume-from-other-run to "
        "coci-submit (Session(resume_from_other_run=True), COCI_RESUME_FROM_OTHER_RUN=1)")


def current_run(argv: Sequence[str], world_size: int, cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """This process's run: the script as an absolute path (``-c`` and the like as given), its
    arguments and the number of ranks."""
    script = argv[0] if argv else ""
    if script and not script.startswith("-"):
        script = str((Path(cwd or os.getcwd()) / script).resolve())
    return {"script": script, "args": list(argv[1:]), "world_size": int(world_size)}


def recorded_run(events: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The run recorded by the directory's last attempt (None: no attempt recorded one)."""
    for e in reversed(events):
        if e.get("event") == "attempt_start" and isinstance(e.get("run"), dict):
            return dict(e["run"])
    return None


def difference(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str | None:
    """How ``current`` differs from the directory's run, as a sentence; None when it is the same run."""
    if recorded is None:
        return None
    if recorded.get("script") != current["script"]:
        return f"its run is {_command(recorded)}, this one is {_command(current)} (another script)"
    if list(recorded.get("args") or []) != current["args"]:
        return f"its run is {_command(recorded)}, this one is {_command(current)} (other arguments)"
    return None


def _command(run: Mapping[str, Any]) -> str:
    return " ".join([str(run.get("script"))] + [str(a) for a in run.get("args") or []])
