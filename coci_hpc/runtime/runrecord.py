"""Which run a checkpoint directory belongs to: one run, one directory.

A sweep that reused a directory (``train.py --seed 7`` after ``train.py --seed 0``) resumed the
other run's weights and "completed" at once. So every attempt records its run (the script, its
arguments and the world size) in its ``attempt_start`` record of ``events.jsonl``, and a Session
whose script or arguments differ from the directory's last recorded run is refused at
``Session()``, before anything is loaded or written, unless it is told to resume from the other
run (``resume_from_other_run=True``, ``COCI_RESUME_FROM_OTHER_RUN=1``, coci-submit
``--resume-from-other-run``); the new run is then recorded and is the directory's run from then on.

The world size is recorded, not compared: the checkpoint store reshards (2 ranks -> 1), so an
attempt on fewer or more nodes is the same run. So is a changed step count (``--steps 60``, then
``--steps 100``: the same run trained longer, or stopped sooner): arguments that differ only in a
step-count option (:data:`STEP_OPTIONS`) resume the run, and the Session says so in one line.
Any other difference is named, option by option (``--seed 0 -> 7``).

coci-submit makes the same check when it submits (``coci_hpc.submit.checks``), so a job that
would be refused on the node is refused before it queues.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from coci_hpc.runtime.events import AttemptStart, Lines, records

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


def recorded_run(events: Lines) -> dict[str, Any] | None:
    """The run recorded by the directory's last attempt (None: no attempt recorded one); ``events``:
    the log's records, or its lines as read."""
    for e in reversed(records(events)):
        if isinstance(e, AttemptStart) and isinstance(e.run, dict):
            return dict(e.run)
    return None


# Options that set how long a run trains, not which run it is (normalised: lower case, '_' -> '-').
STEP_OPTIONS = frozenset({"--steps", "--total-steps", "--max-steps", "--num-steps", "--train-steps",
                          "--iters", "--max-iters", "--iterations", "--num-iterations", "--max-iterations",
                          "--epochs", "--num-epochs", "--max-epochs", "--num-train-epochs"})


def _is_option(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _is_number(token)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _options(args: Sequence[str]) -> dict[str, list[str]]:
    """``--lr 1 --steps=5 -v data`` -> {'--lr': ['1'], '--steps': ['5'], '-v': ['data']}; positionals
    before any option under ''. How most argument parsers read a command line, close enough to name
    what differs (never to decide more than that)."""
    out: dict[str, list[str]] = {}
    key = ""
    for tok in args:
        if _is_option(tok):
            name, eq, value = tok.partition("=")
            key = name
            out.setdefault(key, [])
            if eq:
                out[key].append(value)
        else:
            out.setdefault(key, []).append(tok)
    return out


def _norm(option: str) -> str:
    return option.lower().replace("_", "-")


def _changed(recorded: Sequence[str], current: Sequence[str]) -> list[tuple[str, str, str]]:
    """(option, old value, new value) for each option whose values differ ('' when absent)."""
    a, b = _options(recorded), _options(current)
    keys = list(dict.fromkeys([*a, *b]))
    return [(k or "(positional)", " ".join(a[k]) if k in a else "(absent)", " ".join(b[k]) if k in b else "(absent)")
            for k in keys if a.get(k) != b.get(k)]


def _only_steps(changed: Sequence[tuple[str, str, str]]) -> bool:
    return bool(changed) and all(_norm(k) in STEP_OPTIONS and o != "(absent)" and n != "(absent)"
                                 for k, o, n in changed)


def difference(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str | None:
    """How ``current`` differs from the directory's run, as a sentence naming what differs; None
    when it is the same run (also when only a step count changed: see :func:`continuation`)."""
    if recorded is None:
        return None
    if recorded.get("script") != current["script"]:
        return f"its run is {_command(recorded)}, this one is {_command(current)} (another script)"
    old, new = list(recorded.get("args") or []), list(current["args"])
    if old == new:
        return None
    changed = _changed(old, new)
    if _only_steps(changed):
        return None
    named = ", ".join(f"{k} {o} -> {n}" for k, o, n in changed) or "their order"
    return f"its run is {_command(recorded)}, this one is {_command(current)} (other arguments: {named})"


def continuation(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str | None:
    """``--steps 60 -> 100`` when ``current`` is the directory's run with only its step count
    changed (the same run, trained longer or shorter); None otherwise."""
    if recorded is None or recorded.get("script") != current["script"]:
        return None
    changed = _changed(list(recorded.get("args") or []), list(current["args"]))
    if not _only_steps(changed):
        return None
    return ", ".join(f"{k} {o} -> {n}" for k, o, n in changed)


def _command(run: Mapping[str, Any]) -> str:
    return " ".join([str(run.get("script"))] + [str(a) for a in run.get("args") or []])


def check_same_run(comm: Any, events_path: Path, run: Mapping[str, Any], ckpt_dir: Path, *,
                   resume_from_other_run: bool, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Collective, at ``Session()``: one run, one directory, refused before anything is loaded
    (``CheckpointOtherRun``) unless told to resume from the other run. Rank 0 reads the log and
    returns its records (the start parses ``events.jsonl`` once: the attempt book reuses them)."""
    from coci_hpc.errors import CheckpointOtherRun
    from coci_hpc.runtime.events import read_events

    events = read_events(events_path) if comm.rank == 0 else []
    recorded = recorded_run(events) if comm.rank == 0 else None
    diff = comm.bcast(difference(recorded, run) if comm.rank == 0 else None)
    if diff is None:
        longer = continuation(recorded, run) if comm.rank == 0 else None
        if longer:
            say(f"the same run with another step count ({longer}): resuming it")
        return events
    if not resume_from_other_run:
        raise CheckpointOtherRun(f"checkpoint directory {ckpt_dir} belongs to another run: {diff}", hint=HINT)
    if comm.rank == 0:
        say(f"resuming from another run's directory, as asked (resume_from_other_run): {diff}")
    return events
