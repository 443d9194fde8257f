"""The run's append-only event log, ``<ckpt_dir>/events.jsonl``: one JSON object per line, and its schema.

This module is the one place that knows the records: their types (one dataclass per ``event``,
:data:`RECORD_TYPES`), how they are written (:class:`EventLog`) and read (:func:`read_records`: the
typed records every reader works on; :func:`read_events`: the same lines as plain dicts), and the
few facts several readers derive from them (:func:`current_attempt`,
:func:`relaunch_cause`, :func:`session_gave_up`). docs/reference/event-log.md's table is
:func:`markdown_table` (a test checks that they match).

Written by rank 0 only (a survivor writes its ``peer_lost``). Each record is one ``os.write`` on an
``O_APPEND`` descriptor followed by ``fsync``, so a record is either whole on disk or, if the
process died inside the write, a torn last line. The writer starts a fresh line when it finds the
file not ending in a newline, and :func:`read_events` skips lines that do not parse, so one torn
record never hides the others.

Every record has ``v`` (format version, 1), ``event``, ``wall`` (unix seconds), ``attempt``
(1-based, counted in this log: :func:`current_attempt`) and ``job_id`` (Slurm's, or null). Logs
written before the schema existed read the same: every field of a record type is optional when
read (a missing one is null), and a field the type does not know is kept in ``extra``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from coci_hpc.strenum import StrEnum

VERSION = 1
FILENAME = "events.jsonl"


# The values a record's fields take. StrEnum members are their strings: a line is written exactly as
# the plain strings were (json writes the value), and a member compares equal to its string, so
# readers of the dicts (tests, the run record) see no difference.
class CheckpointKind(StrEnum):
    """``checkpoint.kind``: which save wrote it."""
    PLANNED = "planned"
    STOP = "stop"
    FINAL = "final"


class StopReason(StrEnum):
    """``stop.reason``: why the Session stopped (runtime/attempts.py's ``stop_reason``)."""
    TIME_LIMIT = "time_limit"
    PREEMPTION = "preemption"
    CANCELLED = "cancelled"
    REQUEUE_BY_HAND = "requeue_by_hand"
    NODE_FAILURE = "node_failure"
    TERMINATED = "terminated"


class PrevEndReason(StrEnum):
    """``attempt_start.prev_end.reason``: how the attempt before this one ended (a stop's reason,
    or what the next attempt read from Slurm, a survivor's record or the relaunch loop)."""
    TIME_LIMIT = "time_limit"
    PREEMPTION = "preemption"
    NODE_FAILURE = "node_failure"
    RANK_FAILURE = "rank_failure"
    REQUEUE_BY_HAND = "requeue_by_hand"
    CANCELLED = "cancelled"
    TERMINATED = "terminated"
    CRASH = "crash"
    NONE = "none"


class PrevEndSource(StrEnum):
    """``attempt_start.prev_end.source``: who said how the previous attempt ended."""
    SESSION = "session"
    SACCT = "sacct"
    SCONTROL = "scontrol"
    RELAUNCH = "relaunch"
    NONE = "none"


class EndStatus(StrEnum):
    """``end.status``: how the attempt ended (``refused``: it refused to start, not the run's end)."""
    COMPLETED = "completed"
    GAVE_UP = "gave_up"
    ERROR = "error"
    REFUSED = "refused"


class Tier(StrEnum):
    """``peer_lost.tier``: which tier served after a lost peer."""
    SURVIVORS = "survivors"
    MEMORY = "memory"
    DISK = "disk"


class SavedFrom(StrEnum):
    """``peer_lost.saved_from``: which copy of the state the survivors' checkpoint was written from."""
    LIVE = "live"
    HOST = "host"


class RelaunchAction(StrEnum):
    """``relaunch.action``: the relaunch loop's decision."""
    RELAUNCH = "relaunch"
    REQUEUE = "requeue"
    GIVE_UP = "give_up"


class RelaunchCause(StrEnum):
    """``relaunch.cause``: why the relaunch loop's rank step failed (its ``reason`` is prose)."""
    NODE_FAILURE = "node_failure"
    CRASH = "crash"


PREV_END_REASONS = tuple(PrevEndReason)
RELAUNCH_CAUSES = tuple(RelaunchCause)


def _alts(values: type[StrEnum]) -> str:
    """The values of an enum as the table writes them: `a`\\|`b`."""
    return "\\|".join(f"`{v}`" for v in values)


def _f(doc: str, default: Any = None, *, values: type[StrEnum] | None = None) -> Any:
    """A record field: optional when read (older logs may lack it), documented in the table;
    ``values``: the enum its value is one of (:func:`parse` turns the read string into it)."""
    meta: dict[str, Any] = {"doc": doc, "values": values}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Record:
    """The common part of every record; ``wall``, ``attempt`` and ``job_id`` are set by the writer."""

    EVENT: ClassVar[str] = ""
    WRITER: ClassVar[str] = "the Session (rank 0)"
    wall: float | None = field(default=None, kw_only=True, metadata={"doc": "unix seconds"})
    attempt: int | None = field(default=None, kw_only=True, metadata={"doc": "1-based, counted in this log"})
    job_id: str | None = field(default=None, kw_only=True, metadata={"doc": "Slurm's, or null"})
    extra: dict[str, Any] = field(default_factory=dict, kw_only=True, repr=False,
                                  metadata={"doc": "", "internal": True})

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"v": VERSION, "event": self.EVENT}
        for f in dataclasses.fields(self):
            if f.name != "extra":
                d[f.name] = getattr(self, f.name)
        return {**self.extra, **d}


@dataclass
class AttemptStart(Record):
    EVENT: ClassVar[str] = "attempt_start"
    nodes: list[str] = _f("the nodes of this attempt", [])
    ranks: int | None = _f("the world size")
    run: dict[str, Any] | None = _f("{`script`, `args`, `world_size`}")
    policy: str | None = _f("the checkpoint policy")
    restart_count: int | None = _f("Slurm's SLURM_RESTART_COUNT")
    prev_end: dict[str, Any] = _f("how the attempt before this one ended: {`reason`: " + _alts(PrevEndReason)
                                  + ", `source`: " + _alts(PrevEndSource) + ", `detail`}", {})
    resumed_step: int | None = _f("the checkpoint step resumed from (null: from scratch)")
    steps_lost: int | None = _f("steps of the previous attempt done again: its last finished step minus "
                                "`resumed_step`")
    steps_lost_exact: bool | None = _f("whether `steps_lost` is exact (the ranks' progress records, or a stop); "
                                       "false: a lower bound from this log (no progress record of that attempt "
                                       "survived: a power loss, or a version before them)")
    prev_last_step: int | None = _f("the last step the previous attempt finished (its ranks' progress records, "
                                    "else the newest step its records name)")
    torn_survivors_saves: list[int] = _f("steps of survivors' saves killed before their manifest", [])
    config_sources: dict[str, str] = _f("where each setting came from", {})
    slurm_id: str | None = _f("what sacct knows the job as (an array task's `A_T`)")
    survivor_coverage: float | None = _f("share of failures a survivors' save covers")
    survivors_off: str | None = _f("why a lost rank cannot be covered by a survivors' save (null: it can)")
    memory_tier_every: int | None = _f("the memory tier's interval in steps (state held in parts: each rank's "
                                       "copy goes to its partner every k steps); null: no memory tier")
    in_place_restart: int | None = _f("the relaunch loop's restart number; null outside it")
    process_wall: float | None = _f("when this process was exec'd, from /proc")
    session_wall: float | None = _f("when `Session()` was created")


@dataclass
class Resumed(Record):
    EVENT: ClassVar[str] = "resumed"
    step: int | None = _f("the step resumed from")
    restart_latency_s: dict[str, Any] | None = _f(
        "{`total` (from the previous attempt's last finished step when its progress records date it, else from "
        "its stop or end), `after_last_step_s` (that step -> the previous attempt's stop or end), `slurm_requeue_s`, "
        "`process_start_s`, `restore_s`}")


@dataclass
class Checkpoint(Record):
    EVENT: ClassVar[str] = "checkpoint"
    step: int | None = _f("the step saved")
    kind: CheckpointKind | None = _f(_alts(CheckpointKind), values=CheckpointKind)
    blocking_s: float | None = _f("seconds training waited")
    persist_s: float | None = _f("two-phase saves' background seconds; null for synchronous ones")


@dataclass
class Losses(Record):
    EVENT: ClassVar[str] = "losses"
    steps: list[int] = _f("steps (rank 0's losses, flushed with checkpoints, stops, the end, and at most "
                          "every 5 s)", [])
    values: list[float | None] = _f("their losses (NaN/inf written as null)", [])


@dataclass
class Stop(Record):
    EVENT: ClassVar[str] = "stop"
    step: int | None = _f("the step the session stopped at")
    reason: StopReason | None = _f(_alts(StopReason), values=StopReason)
    signal: str | None = _f("the signal's name")
    requeued: bool | None = _f("whether the session asked Slurm to requeue the job")
    detail: str | None = _f("Slurm's record of why")
    restart_count: int | None = _f("Slurm's SLURM_RESTART_COUNT")
    saved: bool | None = _f("whether a stop-time checkpoint was written")


@dataclass
class LeadWarning(Record):
    EVENT: ClassVar[str] = "lead_warning"
    message: str | None = _f("the signal lead cannot fit a step, a save and the requeue")
    lead_s: float | None = _f("the signal lead")
    step_s: float | None = _f("the step time")
    save_s: float | None = _f("the save time")


@dataclass
class PeerLost(Record):
    EVENT: ClassVar[str] = "peer_lost"
    WRITER: ClassVar[str] = "the survivor that wrote (or tried to write) the survivors' checkpoint"
    step: int | None = _f("the step the survivors' checkpoint is of: the last step every rank finished, or the "
                          "memory tier's newest whole step")
    tier: Tier | None = _f("which tier served: `survivors` (the last step), `memory` (the memory tier's newest "
                          "whole step), `disk` (nothing committed: the last disk checkpoint)", values=Tier)
    how: str | None = _f("agreement timeout, the relaunch loop's peer notice, an exception inside the step, a "
                         "checkpoint collective that did not complete, or a checkpoint write stuck in MPI-IO")
    survivor: int | None = _f("the writing survivor's rank")
    committed: bool | None = _f("whether the survivors' checkpoint committed")
    lost_ranks: list[int] | None = _f("whose per-rank state came from a partner's copy")
    lost: list[int] | None = _f("the ranks that never reached the survivors' save (lost, as the writing survivor "
                                "saw it); absent in logs written before 2026-11-27")
    reason: str | None = _f("why nothing was committed")
    failure_wall: float | None = _f("when the peer was lost")
    detect_wall: float | None = _f("when a survivor saw it")
    commit_wall: float | None = _f("when the survivors' checkpoint committed")
    save_s: float | None = _f("the survivors' save seconds")
    fallback_step: int | None = _f("the checkpoint the next attempt resumes from instead")
    saved_from: SavedFrom | None = _f("which copy the committed checkpoint was written from: `live` (the survivors' "
                                      "own state, rolled back to the last step boundary), `host` (the memory tier's "
                                      "host copies, packed at a boundary: the only source under NCCL, where device "
                                      "memory is never read after a lost peer); absent when the survivors wrote "
                                      "nothing (nothing committed, or that step's regular checkpoint had) and in logs "
                                      "written before 2026-11-29", values=SavedFrom)

    @property
    def ranks_lost(self) -> list[int] | None:
        """The lost ranks as far as the record knows: ``lost``, or in a log written before that
        field, ``lost_ranks`` (the ranks whose state came from a partner, the lost ones then)."""
        return self.lost or self.lost_ranks


@dataclass
class End(Record):
    EVENT: ClassVar[str] = "end"
    step: int | None = _f("the last step")
    status: EndStatus | None = _f(_alts(EndStatus) + " (the attempt refused to start and changed nothing: not the "
                                  "run's end)", values=EndStatus)
    message: str | None = _f("why, for anything but completed")


@dataclass
class Relaunch(Record):
    EVENT: ClassVar[str] = "relaunch"
    WRITER: ClassVar[str] = "coci-submit's relaunch loop (`--spare-nodes`), as the failed attempt, per decision"
    action: RelaunchAction | None = _f(_alts(RelaunchAction), values=RelaunchAction)
    cause: RelaunchCause | None = _f("why the rank step failed: " + _alts(RelaunchCause)
                                     + " (logs before it: read from `lost`)", values=RelaunchCause)
    reason: str | None = _f("the decision in prose (not parsed)")
    restart: int | None = _f("the in-place restart this decision starts")
    rc: int | None = _f("srun's status")
    lost: dict[str, str] = _f("{node: state} of the nodes Slurm reported down or out of the job", {})
    nodes: list[str] = _f("where the ranks start again", [])
    lost_task_on: list[str] = _f("the nodes srun reported a task lost on (suspect: a spare is taken first)", [])
    step_ended_wall: float | None = _f("when the rank step ended")
    decided_wall: float | None = _f("when the loop decided")


@dataclass
class TwoTierPlan(Record):
    EVENT: ClassVar[str] = "two_tier_plan"
    WRITER: ClassVar[str] = "the Session (rank 0), when the memory tier's plan changes"
    memory_every: int | None = _f("memory-tier copy every this many steps; null: the plan drops the memory tier")
    disk_every: int | None = _f("disk save every this many steps")
    reason: str | None = _f("why the memory tier is kept or dropped")
    disk_reason: str | None = _f("why the disk interval is what it is: the failures it answers (partner losses, "
                                 "whole-job failures) and where their rates came from")


RECORD_TYPES: tuple[type[Record], ...] = (AttemptStart, Resumed, Checkpoint, Losses, Stop, LeadWarning,
                                          PeerLost, End, Relaunch, TwoTierPlan)
BY_EVENT: dict[str, type[Record]] = {t.EVENT: t for t in RECORD_TYPES}
EVENTS = tuple(BY_EVENT)


def _clean(x: Any) -> Any:
    """JSON has no NaN/inf: they become null, so every line stays strict JSON; an enum value is
    written as its plain string."""
    if isinstance(x, StrEnum):
        return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


class EventLog:
    """Appends records for one attempt. ``enabled=False`` (ranks other than 0) makes it a no-op."""

    def __init__(self, path: str | os.PathLike, *, attempt: int, job_id: str | None,
                 enabled: bool = True) -> None:
        self.path = Path(path)
        self.attempt, self.job_id, self.enabled = int(attempt), job_id, enabled
        self._checked_tail = False

    def write(self, record: Record | str, **fields: Any) -> dict[str, Any] | None:
        """Append ``record`` (a :data:`RECORD_TYPES` instance) stamped with the time, this log's
        attempt and job id; returns the line's dict. The package writes typed records
        (``write(Checkpoint(step=...))``, so mypy checks every field; a test checks that no module
        writes by name). ``write("checkpoint", step=...)``, for tests and tools, builds the record
        type named so from ``fields`` (:func:`make`: a field the type does not declare is a ValueError)."""
        if isinstance(record, str):
            record = make(record, **fields)
        elif fields:
            raise TypeError("fields go into the record, not next to it")
        if not self.enabled:
            return None
        record.wall, record.attempt, record.job_id = time.time(), self.attempt, self.job_id
        rec = _clean(record.to_dict())
        line = json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n"
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if not self._checked_tail:
                self._checked_tail = True
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    line = "\n" + line  # the previous writer died mid-record: start a fresh line
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return rec


def make(event: str, **fields: Any) -> Record:
    """The record of type ``event`` with ``fields``; an unknown event or field is a ValueError."""
    cls = BY_EVENT.get(event)
    if cls is None:
        raise ValueError(f"unknown event {event!r}")
    known = {f.name for f in dataclasses.fields(cls)} - {"extra", "wall", "attempt", "job_id"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"event {event!r} has no field(s) {', '.join(unknown)} "
                         "(declare them in coci_hpc/runtime/events.py)")
    return cls(**fields)


def parse(d: dict[str, Any]) -> Record | None:
    """The typed record of one read line (:func:`read_events`'s dicts); None for an event this
    version does not know. Missing fields are null; fields the type lacks go to ``extra``."""
    cls = BY_EVENT.get(str(d.get("event")))
    if cls is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    kw = {k: v for k, v in d.items() if k in names}
    extra = {k: v for k, v in d.items() if k not in names and k not in ("v", "event")}
    rec = cls(**kw)
    rec.extra = extra
    for f in dataclasses.fields(cls):
        factory, values, v = f.default_factory, f.metadata.get("values"), kw.get(f.name)
        if f.name in kw and v is None and callable(factory):
            setattr(rec, f.name, factory())     # an old log's explicit null where the type has an empty default
        elif values is not None and isinstance(v, str) and v in values.__members__.values():
            setattr(rec, f.name, values(v))     # a value this version does not know stays the string read
    if isinstance(rec, End):
        _upgrade_refusal(rec)
    return rec


# Logs written before the `refused` status (until 2026-11-26, da117a3) recorded a refused start as
# status `error` with a UsageError whose message ended so. The one place a message is read: old
# records become the typed status here, so no reader looks at the prose.
_OLD_REFUSAL = "nothing was changed"


def _upgrade_refusal(rec: End) -> None:
    if rec.status == EndStatus.ERROR and _OLD_REFUSAL in str(rec.message or ""):
        rec.status = EndStatus.REFUSED


def read_records(path: str | os.PathLike) -> list[Record]:
    """All whole records of the log, typed (:func:`parse`), in order: what the readers of the log
    (history, the attempt rules, the relaunch loop) work on. A torn or foreign line is skipped, and
    so is an event this version does not know. A missing file is empty."""
    return read_records_counted(path)[0]


def read_records_counted(path: str | os.PathLike) -> tuple[list[Record], int]:
    """:func:`read_records` and how many non-empty lines were skipped (as :func:`read_events_counted`
    counts them: an event this version does not know is left out without being counted)."""
    lines, skipped = read_events_counted(path)
    return records(lines), skipped


# What the readers accept: typed records, or lines as read (dicts), parsed by :func:`records`.
Lines = Iterable[Record | Mapping[str, Any]]


def records(lines: Lines) -> list[Record]:
    """The typed records of lines as read (:func:`read_events`' dicts); records pass as they are,
    an event this version does not know is left out."""
    out: list[Record] = []
    for e in lines:
        rec = e if isinstance(e, Record) else parse(dict(e))
        if rec is not None:
            out.append(rec)
    return out


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All whole records as the dicts they were written as, in order; a torn or foreign line is
    skipped. A missing file is empty. The raw view (tests, the run record, the error exit's own
    lines); the log's readers use :func:`read_records`."""
    return read_events_counted(path)[0]


def read_events_counted(path: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """:func:`read_events` and how many non-empty lines it skipped (torn, foreign, or a record
    without a valid attempt number), so a reader can say that some were."""
    p = Path(path)
    if p.is_dir():
        p = p / FILENAME
    try:
        text = p.read_text(errors="replace")
    except FileNotFoundError:
        return [], 0
    out, skipped = [], 0
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(rec, dict) and rec.get("v") == VERSION and "event" in rec and _attempt_ok(rec.get("attempt")):
            out.append(rec)
        else:
            skipped += 1
    return out, skipped


def _attempt_ok(a: Any) -> bool:
    # Every writer numbers attempts from 1; a record without one (a damaged line that still
    # parses) would otherwise become a bogus "attempt 0".
    return isinstance(a, int) and not isinstance(a, bool) and a >= 1


def last_attempt(events: Sequence[Record]) -> int:
    """The newest attempt number any record carries (0 for an empty log)."""
    return max((int(e.attempt or 0) for e in events), default=0)


def current_attempt(events: Sequence[Record]) -> int:
    """The attempt the newest records belong to, at least 1: the one counter of attempts. The
    Session numbers a new attempt ``last_attempt + 1``; the relaunch loop records its decision as
    this attempt. Counting ``attempt_start`` lines instead would go one short after a torn one."""
    return max(last_attempt(events), 1)


def relaunch_cause(rec: Relaunch) -> RelaunchCause:
    """Why the relaunch loop's rank step failed: the record's typed ``cause``; in logs written
    before it, ``node_failure`` when the record names ``lost`` nodes. Never read from the prose
    ``reason`` (a crash's reason says "lost a task")."""
    if rec.cause in RELAUNCH_CAUSES:
        return RelaunchCause(rec.cause)
    return RelaunchCause.NODE_FAILURE if rec.lost else RelaunchCause.CRASH


def session_gave_up(events: Sequence[Record]) -> str | None:
    """The Session's give-up message when the newest attempt in the log ended ``gave_up``."""
    last = last_attempt(events)
    for e in reversed(events):
        if int(e.attempt or 0) == last and isinstance(e, End):
            return str(e.message or "gave up") if e.status == EndStatus.GAVE_UP else None
    return None


def whole_job_ends(events: Sequence[Record]) -> tuple[int, int]:
    """(attempts that ended whole, attempts that ended with a node or rank lost and a survivor
    left) in one run's log, for the two-tier planner's whole-job share
    (:mod:`coci_hpc.planner.whole_job`). An attempt that a later attempt followed and that wrote
    no ``stop`` (an announced end), no ``end`` and no ``peer_lost`` (a survivor saw the loss) ended
    with every rank at once: a crash of the whole job. The newest attempt may still run: not
    counted. The relaunch loop's ``relaunch`` record says which: after a lost node the survivors'
    case, after a crash of the rank step a whole-job end."""
    by: dict[int, set[str]] = {}
    relaunched_node: set[int] = set()
    for e in events:
        a = int(e.attempt or 0)
        by.setdefault(a, set()).add(e.EVENT)
        if isinstance(e, Relaunch) and relaunch_cause(e) == RelaunchCause.NODE_FAILURE:
            relaunched_node.add(a)
    last = last_attempt(events)
    whole = other = 0
    for a, kinds in by.items():
        if a >= last or AttemptStart.EVENT not in kinds:
            continue
        if PeerLost.EVENT in kinds or a in relaunched_node:
            other += 1
        elif not kinds & {Stop.EVENT, End.EVENT}:
            whole += 1
    return whole, other


def markdown_table() -> str:
    """The record table of docs/reference/event-log.md, from the record types."""
    rows = ["| `event` | written by | fields |", "|---|---|---|"]
    for t in RECORD_TYPES:
        own = [f for f in dataclasses.fields(t) if f.name not in ("wall", "attempt", "job_id", "extra")]
        cells = "; ".join(f"`{f.name}`: {f.metadata['doc']}" for f in own)
        rows.append(f"| `{t.EVENT}` | {t.WRITER} | {cells} |")
    return "\n".join(rows)
