"""Read the cluster's failure history from Slurm accounting.

Two sources, both ``--parsable2`` WITH their header line, parsed by column name:

* job records (``sacct``): jobs that ended ``NODE_FAIL`` are failures; the node-seconds of all
  job records inside the window are the exposure (a per-node rate as seen by jobs). PREEMPTED
  and TIMEOUT are announced (a signal comes first and the runtime saves on it): they are counted
  in the summary, never as failures;
* node events (``sacctmgr show event``): DOWN / DRAIN / FAIL states with their reasons; the
  exposure is cluster nodes x window.

Planned maintenance is dropped by reason patterns (configurable). A malformed line raises
:class:`~coci_hpc.errors.InputFormatError` with its line number, or with ``skip_bad_lines`` is
counted in ``History.skipped``. :func:`from_cluster` runs the commands through a replaceable
runner so tests need no Slurm; :func:`build_model` turns a history and its window into the
failure model (records declustered into incidents) and a JSON-able summary;
:func:`failure_model_from_cluster` is both in one call (the runtime's and coci-plan's entry).
"""
from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from coci_hpc.errors import InputFormatError, PlannerError, UsageError
from coci_hpc.planner import failures as fmod
from coci_hpc.planner.failures import FailureEvent, FailureModel, merge_events
from coci_hpc.slurm import states
from coci_hpc.slurm.commands import Runner, run_command
from coci_hpc.slurm.hostlist import expand_hostlist
from coci_hpc.slurm.timefmt import parse_since, parse_time  # noqa: F401 - callers use acct.parse_*

# Exact command lines (the lead captures tests/fixtures/slurm/real_*.txt with these, plus the
# window arguments added by sacct_argv / sacctmgr_event_argv).
# No JobName: it is free text (may hold '|') and nothing here needs it.
SACCT_FORMAT = "JobIDRaw,JobID,Partition,State,Start,End,NNodes,NodeList"
SACCT_ARGS = ["sacct", "-a", "-X", "-D", "--parsable2", f"--format={SACCT_FORMAT}"]
SACCTMGR_EVENT_ARGS = ["sacctmgr", "--parsable2", "show", "event", "Event=Node",
                       "format=NodeName,TimeStart,TimeEnd,State,Reason"]
SINFO_NODES_ARGS = ["sinfo", "--noheader", "--Node", "--format=%N"]

# Reasons admins give for planned work; an unplanned "node unexpectedly rebooted" is NOT one.
DEFAULT_MAINTENANCE_PATTERNS = (r"(?i)maint", r"(?i)upgrade", r"(?i)planned", r"(?i)scheduled",
                                r"(?i)reserv", r"(?i)reboot\s+(asap|requested|issued)")
FAILURE_STATE = re.compile(r"^(DOWN|DRAIN|DRAINED|DRAINING|FAIL|FAILING|NO_RESPOND)", re.I)
# Job ends that come with a signal first (the runtime saves on it): not failures.
ANNOUNCED_STATES = states.ANNOUNCED
UNANNOUNCED_JOB_STATES = states.UNANNOUNCED
DEFAULT_WINDOW_DAYS = 30.0



@dataclass(frozen=True)
class JobRecord:
    """One sacct record that ran: [start_s, end_s) on ``nnodes`` nodes; end None = still running."""

    start_s: float
    end_s: float | None
    nnodes: int
    state: str

    def node_seconds(self, window_start_s: float, window_end_s: float) -> float:
        """Node-seconds inside the window; a running job counts up to the window's end, which
        is --until or the last record for files and "now" only when reading the live cluster."""
        end = window_end_s if self.end_s is None else min(self.end_s, window_end_s)
        return max(0.0, end - max(self.start_s, window_start_s)) * max(self.nnodes, 1)


@dataclass
class History:
    """What the adapters read: failure events plus what is needed for the exposure."""

    events: list[FailureEvent] = field(default_factory=list)
    jobs: list[JobRecord] = field(default_factory=list)
    nodes_seen: set[str] = field(default_factory=set)
    first_s: float | None = None
    last_s: float | None = None
    skipped: int = 0
    filtered_maintenance: int = 0
    n_records: int = 0
    sources: list[str] = field(default_factory=list)
    job_states: Counter = field(default_factory=Counter)    # final state of every job record
    # When each ignored maintenance event started, so the count can follow the window (--since).
    maintenance_s: list[float] = field(default_factory=list)

    def job_node_seconds_in(self, start_s: float, end_s: float) -> float:
        return sum(j.node_seconds(start_s, end_s) for j in self.jobs)

    @property
    def job_node_seconds(self) -> float:
        """All job node-seconds, running jobs up to the last record (no window)."""
        if self.first_s is None or self.last_s is None:
            return 0.0
        return self.job_node_seconds_in(self.first_s, self.last_s)

    def _see(self, t: float | None) -> None:
        if t is None:
            return
        self.first_s = t if self.first_s is None else min(self.first_s, t)
        self.last_s = t if self.last_s is None else max(self.last_s, t)

    def merge(self, other: History) -> History:
        h = History(self.events + other.events, self.jobs + other.jobs,
                    self.nodes_seen | other.nodes_seen, None, None,
                    self.skipped + other.skipped,
                    self.filtered_maintenance + other.filtered_maintenance,
                    self.n_records + other.n_records, self.sources + other.sources,
                    self.job_states + other.job_states, self.maintenance_s + other.maintenance_s)
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
    # free-text columns may hold '|': Reason (sacctmgr) and JobName (older sacct formats)
    free = [i for i, h in enumerate(header) if h.strip().lower() in ("reason", "jobname")]
    for i in range(hdr_no + 1, len(lines)):
        raw = lines[i]
        if not raw.strip():
            continue
        fields = raw.split("|")
        extra = len(fields) - len(header)
        if extra > 0 and len(free) == 1:
            # glue the free-text column back together; the fixed columns around it stay put
            j = free[0]
            fields = fields[:j] + ["|".join(fields[j:j + extra + 1])] + fields[j + extra + 1:]
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


def parse_sacct(text: str, *, source: str = "sacct", skip_bad_lines: bool = False) -> History:
    """Job records -> NODE_FAIL failure events and the job records for the exposure.

    Running jobs (End=Unknown) keep end None; the window decides where they stop counting."""
    hist = History(sources=[source])
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
        hist.jobs.append(JobRecord(start, end, max(nn, 1), state))
        hist.job_states[state] += 1
        if state in UNANNOUNCED_JOB_STATES and end is not None:
            job = row.get("JobID")
            hist.events.append(FailureEvent(tuple(nodes), end, reason="job ended NODE_FAIL",
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
            hist.maintenance_s.append(start)
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
    """Run sacct, sacctmgr and sinfo for the window starting at ``since`` (``YYYY-MM-DD`` or
    ``YYYY-MM-DDTHH:MM:SS``); keep only failures inside the window and on the partition's nodes."""
    if not since:
        raise UsageError("--since is required with --from-cluster", hint="e.g. --since 2026-01-01")
    since_s = parse_since(since)
    now = time.time() if now_s is None else now_s
    runner = runner or run_command      # looked up at call time so tests can replace it
    cmds = [sacct_argv(since, partition), sacctmgr_event_argv(since), sinfo_argv(partition)]
    jobs = parse_sacct(runner(cmds[0]), source="sacct", skip_bad_lines=skip_bad_lines)
    evs = parse_events(runner(cmds[1]), source="sacctmgr", skip_bad_lines=skip_bad_lines,
                       maintenance_patterns=maintenance_patterns)
    nodes = sorted({n for line in runner(cmds[2]).splitlines() for n in expand_hostlist(line)})
    hist = jobs.merge(evs)
    keep = set(nodes)
    hist.events = [e for e in hist.events
                   if since_s <= e.time_s <= now + 1 and (not keep or set(e.nodes) & keep)]
    return ClusterHistory(hist, nodes, since_s, now, cmds)


def _reason_class(e: FailureEvent) -> str:
    """'Hardware: Memory' -> 'Hardware'; free text is cut, so the summary stays a short table."""
    r = (e.reason or e.state or "unknown").strip()
    head = r.split(":", 1)[0].strip() if ":" in r[:40] else r
    return head[:48]


def build_model(hist: History, window_start_s: float, window_end_s: float, *,
                cluster_nodes: int, have_events: bool, confidence: float = 0.9,
                ) -> tuple[FailureModel, dict]:
    """The per-node failure model from what was read, over exactly [start, end].

    Failure records inside the window (NODE_FAIL jobs merged with their node's DOWN event) are
    declustered into incidents, and the rate is incidents over the exposure:
    ``cluster_nodes`` x window with node events (every node is watched all the time), else the
    job node-seconds inside the window. Announced ends (PREEMPTED, TIMEOUT) are counted in the
    summary only. Returns (model, JSON-able summary)."""
    if window_end_s <= window_start_s:
        raise PlannerError("the failure history's window is empty (end <= start)",
                           hint="check --since/--until, or give a longer history")
    recs = [e for e in hist.failures() if window_start_s <= e.time_s <= window_end_s + 1]
    incidents = fmod.decluster(recs)
    span = window_end_s - window_start_s
    if have_events:
        n = max(cluster_nodes, 1)
        exposure = n * span
        basis = f"{n} cluster node(s) x {span / 3600:.4g} h window"
    else:
        exposure = hist.job_node_seconds_in(window_start_s, window_end_s)
        basis = f"job node-hours inside the window from {len(hist.jobs)} job record(s)"
    model = fmod.estimate(incidents, exposure, confidence=confidence, basis=basis,
                          n_records=len(recs),
                          cluster_nodes=max(cluster_nodes, 1) if have_events else None)
    outages = outage_times(incidents, [e for e in hist.events if e.source == "sacct"
                                       and window_start_s <= e.time_s <= window_end_s + 1],
                           max(cluster_nodes, 1) if have_events else 0)
    model = dataclasses.replace(model, outage_times=tuple(outages), outage_window_s=span)
    by_node: Counter = Counter(n for e in recs for n in e.nodes)
    announced = Counter(j.state for j in hist.jobs if j.state in ANNOUNCED_STATES
                        and j.end_s is not None and window_start_s <= j.end_s <= window_end_s + 1)
    fmt = lambda t: time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))  # noqa: E731
    summary = {
        "window_start": fmt(window_start_s), "window_end": fmt(window_end_s),
        "window_hours": span / 3600.0, "cluster_nodes": cluster_nodes,
        "exposure_node_hours": exposure / 3600.0, "exposure_basis": basis,
        "records": len(recs), "incidents": len(incidents),
        "outages": len(outages),
        "by_node": dict(by_node.most_common()),
        "by_reason": dict(Counter(_reason_class(e) for e in recs).most_common()),
        "announced_not_counted": {s: announced.get(s, 0) for s in ANNOUNCED_STATES},
        "skipped_lines": hist.skipped,
        "filtered_maintenance": sum(1 for t in hist.maintenance_s if window_start_s <= t <= window_end_s + 1),
        "records_read": hist.n_records,
    }
    return model, summary


def outage_times(incidents: Sequence[FailureEvent], job_fails: Sequence[FailureEvent],
                 watched_nodes: int) -> list[float]:
    """The incidents that were outages ending every job (:mod:`coci_hpc.planner.whole_job`), by
    their times: with node events (``watched_nodes`` > 0), an incident on at least half the
    watched nodes (a partition- or cluster-wide outage); from job records, a minute in which two
    or more jobs on different nodes ended NODE_FAIL (several nodes went at once: Slurm does not
    say which node of a job died, so one job's NODE_FAIL alone is one node). Such a minute is
    the incident that holds it, when there is one."""
    from coci_hpc.planner.whole_job import outage_count
    found = {e.time_s for e in incidents if outage_count([(len(set(e.nodes)), e.time_s)], watched_nodes)}
    recs = sorted(job_fails, key=lambda e: e.time_s)
    i = 0
    while i < len(recs):
        j = i
        while j + 1 < len(recs) and recs[j + 1].time_s - recs[i].time_s <= fmod.SIMULTANEOUS_S:
            j += 1
        group = recs[i:j + 1]
        if any(not set(a.nodes) & set(b.nodes) for x, a in enumerate(group) for b in group[x + 1:]):
            t = recs[i].time_s
            holder = [e.time_s for e in incidents if e.time_s <= t <= e.time_s + fmod.SIMULTANEOUS_S]
            found.add(holder[0] if holder else t)
        i = j + 1
    return sorted(found)


def failure_model_from_cluster(partition: str | None, *, since: str | None = None,
                               runner: Runner | None = None, confidence: float = 0.9,
                               skip_bad_lines: bool = False,
                               maintenance_patterns: Sequence[str] = DEFAULT_MAINTENANCE_PATTERNS,
                               now_s: float | None = None,
                               window_days: float = DEFAULT_WINDOW_DAYS) -> tuple[FailureModel, dict]:
    """The partition's failure model from this cluster's accounting, for a job about to plan.

    Called once per job attempt on rank 0 (and by ``coci-plan --from-cluster``). ``since``
    defaults to ``window_days`` before now. Raises :class:`~coci_hpc.errors.SlurmError` when
    sacct/sacctmgr/sinfo is missing or fails: the caller falls back (and logs why)."""
    now = time.time() if now_s is None else now_s
    if since is None:
        since = time.strftime("%Y-%m-%dT%H:%M:%S",
                              time.localtime(now - window_days * 86400.0))
    ch = from_cluster(since, partition, runner=runner, skip_bad_lines=skip_bad_lines,
                      maintenance_patterns=maintenance_patterns, now_s=now)
    n_cluster = len(ch.cluster_nodes) or len(ch.history.nodes_seen)
    model, summary = build_model(ch.history, ch.window_start_s, ch.window_end_s,
                                 cluster_nodes=n_cluster, have_events=True,
                                 confidence=confidence)
    summary.update(source="cluster", partition=partition,
                   commands=[" ".join(c) for c in ch.commands])
    return model, summary
