"""Read the cluster's failure history from Slurm accounting.

Two sources, both ``--parsable2`` WITH their header line, parsed by column name:

* job records (``sacct``): jobs that ended ``NODE_FAIL`` are failures; the node-seconds of all
  job records are the exposure (a per-node rate as seen by jobs);
* node events (``sacctmgr show event``): DOWN / DRAIN / FAIL states with their reasons; the
  exposure is cluster nodes x window.

Planned maintenance is dropped by reason patterns (configurable). A malformed line raises
:class:`~coci_hpc.errors.InputFormatError` with its line number, or with ``skip_bad_lines`` is
counted in ``History.skipped``. :func:`from_cluster` runs the commands through a replaceable
runner so tests need no Slurm.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Sequence

from coci_hpc.errors import InputFormatError, UsageError
from coci_hpc.planner.failures import FailureEvent, merge_events
from coci_hpc.slurm.commands import Runner, run_command

# Exact command lines (the lead captures tests/fixtures/slurm/real_*.txt with these, plus the
# window arguments added by sacct_argv / sacctmgr_event_argv).
SACCT_FORMAT = "JobIDRaw,JobID,JobName,Partition,State,Start,End,NNodes,NodeList"
SACCT_ARGS = ["sacct", "-a", "-X", "-D", "--parsable2", f"--format={SACCT_FORMAT}"]
SACCTMGR_EVENT_ARGS = ["sacctmgr", "--parsable2", "show", "event", "Event=Node",
                       "format=NodeName,TimeStart,TimeEnd,State,Reason"]
SINFO_NODES_ARGS = ["sinfo", "--noheader", "--Node", "--format=%N"]

# Reasons admins give for planned work; an unplanned "node unexpectedly rebooted" is NOT one.
DEFAULT_MAINTENANCE_PATTERNS = (r"(?i)maint", r"(?i)upgrade", r"(?i)planned", r"(?i)scheduled",
                                r"(?i)reserv", r"(?i)reboot\s+(asap|requested|issued)")
FAILURE_STATE = re.compile(r"^(DOWN|DRAIN|DRAINED|DRAINING|FAIL|FAILING|NO_RESPOND)", re.I)
_UNKNOWN_TIMES = {"", "unknown", "none", "n/a"}



def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist: ``n[1-3,5]``, ``gpu[01-02]-ib[1-2]``, ``a1,b[2-3]``."""
    expr = expr.strip()
    if not expr or expr.lower() in ("none", "none assigned", "(null)"):
        return []
    parts, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append(cur)
    out: list[str] = []
    for p in parts:
        if p:
            out.extend(_expand_one(p))
    return out


def _expand_one(p: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", p)
    if not m:
        if "[" in p or "]" in p:
            raise ValueError(f"bad hostlist element {p!r}")
        return [p]
    head, body, tail = p[:m.start()], m.group(1), p[m.end():]
    items: list[str] = []
    for rng in body.split(","):
        if re.fullmatch(r"\d+", rng):
            items.append(rng)
        elif re.fullmatch(r"\d+-\d+", rng):
            a, b = rng.split("-")
            if int(b) < int(a):
                raise ValueError(f"descending range {rng!r}")
            width = len(a) if a.startswith("0") else 0
            items.extend(str(i).zfill(width) for i in range(int(a), int(b) + 1))
        else:
            raise ValueError(f"bad range {rng!r} in hostlist")
    return [head + it + rest for it in items for rest in _expand_one(tail)]


def parse_time(text: str) -> float | None:
    """Slurm's ISO local time ``2026-11-22T04:19:11`` -> epoch seconds; Unknown/None -> None."""
    t = text.strip()
    if t.lower() in _UNKNOWN_TIMES:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M"):
        try:
            return time.mktime(datetime.strptime(t, fmt).timetuple())
        except ValueError:
            continue
    raise ValueError(f"unrecognised time {text!r}")


@dataclass
class History:
    """What the adapters read: failure events plus what is needed for the exposure."""

    events: list[FailureEvent] = field(default_factory=list)
    job_node_seconds: float = 0.0         # sacct: sum of NNodes x elapsed over job records
    nodes_seen: set[str] = field(default_factory=set)
    first_s: float | None = None
    last_s: float | None = None
    skipped: int = 0
    filtered_maintenance: int = 0
    n_records: int = 0
    sources: list[str] = field(default_factory=list)

    def _see(self, t: float | None) -> None:
        if t is None:
            return
        self.first_s = t if self.first_s is None else min(self.first_s, t)
        self.last_s = t if self.last_s is None else max(self.last_s, t)

    def merge(self, other: "History") -> "History":
        h = History(self.events + other.events, self.job_node_seconds + other.job_node_seconds,
                    self.nodes_seen | other.nodes_seen, None, None,
                    self.skipped + other.skipped,
                    self.filtered_maintenance + other.filtered_maintenance,
                    self.n_records + other.n_records, self.sources + other.sources)
        for t in (self.first_s, self.last_s, other.first_s, other.last_s):
            h._see(t)
        return h

    def failures(self, merge_window_s: float = 600.0) -> list[FailureEvent]:
        return merge_events(self.events, merge_window_s)


def _rows(text: str, source: str, required: Sequence[Sequence[str]],
          optional: Sequence[Sequence[str]], command: Sequence[str]):
    """Yield (line_no, {column: value} or None, error) from parsable2 text with a header line.

    Columns are alias groups; the first alias of each group is the key. Optional columns absent
    from the header are left out of the row."""
    lines = text.splitlines()
    hdr_no = next((i for i, l in enumerate(lines) if l.strip()), None)
    if hdr_no is None:
        return
    header = lines[hdr_no].split("|")
    lower = {h.strip().lower(): i for i, h in enumerate(header)}
    cols: dict[str, int] = {}
    for group in list(required) + list(optional):
        idx = next((lower[a.lower()] for a in group if a.lower() in lower), None)
        if idx is None and group in required:
            raise InputFormatError(
                f"header has no {group[0]} column (got {lines[hdr_no][:120]!r})",
                line=hdr_no + 1, source=source,
                hint="produce the file with a header line: " + " ".join(command))
        if idx is not None:
            cols[group[0]] = idx
    last_is_reason = header[-1].strip().lower() == "reason"
    for i in range(hdr_no + 1, len(lines)):
        raw = lines[i]
        if not raw.strip():
            continue
        fields = raw.split("|")
        if len(fields) > len(header) and last_is_reason:
            # a '|' inside the free-text reason: glue the tail back together
            fields = fields[:len(header) - 1] + ["|".join(fields[len(header) - 1:])]
        if len(fields) != len(header):
            yield i + 1, None, (f"expected {len(header)} '|'-separated fields as in the header, "
                                f"got {len(fields)}: {raw[:80]!r}")
            continue
        yield i + 1, {k: fields[j].strip() for k, j in cols.items()}, None


def _bad(msg: str, line: int, source: str, skip: bool, hist: History, hint: str) -> None:
    if skip:
        hist.skipped += 1
        return
    raise InputFormatError(msg, line=line, source=source, hint=hint)


def _is_maintenance(reason: str, patterns: Sequence[str]) -> bool:
    return any(re.search(p, reason) for p in patterns)


def parse_sacct(text: str, *, source: str = "sacct", skip_bad_lines: bool = False,
                window_end_s: float | None = None) -> History:
    """Job records -> NODE_FAIL failure events and job node-seconds of exposure.

    Running jobs (End=Unknown) count up to ``window_end_s`` (default: now)."""
    hist = History(sources=[source])
    end_default = time.time() if window_end_s is None else window_end_s
    hint = "fix or remove the line, or pass --skip-bad-lines"
    req = [("State",), ("Start",), ("End",), ("NodeList",)]
    opt = [("JobID", "JobIDRaw"), ("NNodes",)]
    for line_no, row, err in _rows(text, source, req, opt, SACCT_ARGS):
        if row is None:
            _bad(err, line_no, source, skip_bad_lines, hist, hint)
            continue
        state = row["State"].split()[0].upper() if row["State"] else ""
        try:
            start = parse_time(row["Start"])
            end = parse_time(row["End"])
            nodes = expand_hostlist(row["NodeList"])
            nn = int(row["NNodes"]) if row.get("NNodes") else len(nodes)
        except ValueError as exc:
            _bad(str(exc), line_no, source, skip_bad_lines, hist, hint)
            continue
        hist.n_records += 1
        hist.nodes_seen.update(nodes)
        hist._see(start)
        hist._see(end)
        if start is None or not nodes:
            continue                      # never ran: no exposure, cannot have failed on a node
        stop = end if end is not None else end_default
        hist.job_node_seconds += max(0.0, stop - start) * max(nn, 1)
        if state == "NODE_FAIL":
            job = row.get("JobID")
            hist.events.append(FailureEvent(tuple(nodes), stop, reason="job ended NODE_FAIL",
                                            source="sacct", state=state, job_id=job))
    return hist


def parse_events(text: str, *, source: str = "sacctmgr", skip_bad_lines: bool = False,
                 maintenance_patterns: Sequence[str] = DEFAULT_MAINTENANCE_PATTERNS) -> History:
    """Node events -> failure events (DOWN/DRAIN/FAIL whose reason is not maintenance)."""
    hist = History(sources=[source])
    hint = "fix or remove the line, or pass --skip-bad-lines"
    req = [("NodeName", "Node"), ("TimeStart", "Start"), ("TimeEnd", "End"), ("State",),
           ("Reason",)]
    for line_no, row, err in _rows(text, source, req, (), SACCTMGR_EVENT_ARGS):
        if row is None:
            _bad(err, line_no, source, skip_bad_lines, hist, hint)
            continue
        node = row["NodeName"]
        try:
            start = parse_time(row["TimeStart"])
            end = parse_time(row["TimeEnd"])
            nodes = expand_hostlist(node) if node else []
        except ValueError as exc:
            _bad(str(exc), line_no, source, skip_bad_lines, hist, hint)
            continue
        if start is None:
            _bad("event without a start time", line_no, source, skip_bad_lines, hist, hint)
            continue
        hist.n_records += 1
        hist._see(start)
        hist._see(end)
        if not nodes:
            continue                     # cluster events (registration etc.) are not failures
        hist.nodes_seen.update(nodes)
        state = row["State"].upper()
        # compound states like IDLE+DRAIN or DOWN*+DRAIN: any failure component counts
        if not any(FAILURE_STATE.match(part) for part in state.split("+")):
            continue
        reason = row["Reason"]
        if _is_maintenance(reason, maintenance_patterns):
            hist.filtered_maintenance += 1
            continue
        for n in nodes:
            hist.events.append(FailureEvent((n,), start, reason=reason, source="event",
                                            state=state, end_s=end))
    return hist


def read_file(path: str, kind: str, **kw) -> History:
    """``kind`` is "sacct" or "events"."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}",
                         hint="check the path given to --sacct-file/--events-file") from exc
    if kind == "sacct":
        return parse_sacct(text, source=path, **kw)
    return parse_events(text, source=path, **kw)


def sacct_argv(since: str | None = None, partition: str | None = None) -> list[str]:
    argv = list(SACCT_ARGS)
    if since:
        argv += [f"--starttime={since}", "--endtime=now"]
    if partition:
        argv += [f"--partition={partition}"]
    return argv


def sacctmgr_event_argv(since: str | None = None) -> list[str]:
    argv = list(SACCTMGR_EVENT_ARGS)
    if since:
        argv += [f"Start={since}", "End=now"]
    return argv


def sinfo_argv(partition: str | None = None) -> list[str]:
    return SINFO_NODES_ARGS + ([f"--partition={partition}"] if partition else [])


@dataclass
class ClusterHistory:
    history: History
    cluster_nodes: list[str]
    window_start_s: float
    window_end_s: float
    commands: list[list[str]]


def from_cluster(since: str, partition: str | None = None, *, runner: Runner | None = None,
                 skip_bad_lines: bool = False,
                 maintenance_patterns: Sequence[str] = DEFAULT_MAINTENANCE_PATTERNS,
                 now_s: float | None = None) -> ClusterHistory:
    """Run sacct, sacctmgr and sinfo for the window starting at ``since`` (Slurm time syntax,
    ISO form recommended); keep only failures inside the window and on the partition's nodes."""
    try:
        since_s = parse_time(since)
    except ValueError as exc:
        raise UsageError(f"--since {since!r} is not a time", hint="use YYYY-MM-DDTHH:MM:SS") from exc
    if since_s is None:
        raise UsageError("--since is required with --from-cluster", hint="e.g. --since 2026-01-01")
    now = time.time() if now_s is None else now_s
    runner = runner or run_command      # looked up at call time so tests can replace it
    cmds = [sacct_argv(since, partition), sacctmgr_event_argv(since), sinfo_argv(partition)]
    jobs = parse_sacct(runner(cmds[0]), source="sacct", skip_bad_lines=skip_bad_lines,
                       window_end_s=now)
    evs = parse_events(runner(cmds[1]), source="sacctmgr", skip_bad_lines=skip_bad_lines,
                       maintenance_patterns=maintenance_patterns)
    nodes = sorted({n for line in runner(cmds[2]).splitlines() for n in expand_hostlist(line)})
    hist = jobs.merge(evs)
    keep = set(nodes)
    hist.events = [e for e in hist.events
                   if since_s <= e.time_s <= now + 1 and (not keep or set(e.nodes) & keep)]
    return ClusterHistory(hist, nodes, since_s, now, cmds)
