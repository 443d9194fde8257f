"""A run's history: attempts, how each ended, checkpoints, steps lost, restart latency, the loss curve.

Built from the Session's event log (``<ckpt_dir>/events.jsonl``, see docs/reference/event-log.md), read as
the typed records of :mod:`coci_hpc.runtime.events`, and, where Slurm is reachable, ``sacct``'s row for
each attempt. :func:`build` is pure (records in, a
:class:`RunHistory` out); :func:`load` does the reading; :func:`render_text`, :meth:`RunHistory.to_dict`
and :func:`plot` present it. ``coci-status`` is the command.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from coci_hpc.errors import SlurmError, UsageError
from coci_hpc.runtime.events import (
    FILENAME,
    AttemptStart,
    Checkpoint,
    CheckpointKind,
    End,
    EndStatus,
    Losses,
    PeerLost,
    PrevEndReason,
    Record,
    Relaunch,
    RelaunchAction,
    Resumed,
    Stop,
    TwoTierPlan,
    parse,
    read_records_counted,
    relaunch_cause,
)
from coci_hpc.slurm import commands, states
from coci_hpc.slurm.sacct import SlurmAttempt, job_attempts


@dataclass
class Attempt:
    attempt: int
    job_id: str | None
    nodes: list[str]
    ranks: int | None
    start_wall: float | None
    resumed_step: int | None
    steps_lost: int | None
    prev_end: dict[str, Any]                 # how the attempt BEFORE this one ended (Session's record)
    restart_latency_s: dict[str, Any] | None  # from the `resumed` record
    ended: str = "running"                   # how THIS attempt ended: a prev_end reason, or end status
    ended_source: str = ""
    # The reason alone ("node_failure"), where ``ended`` may add how ("node_failure (restarted in
    # place)", "preemption (stopped, requeued)"): the plot reads this, never the display string.
    # Not in to_dict() (the JSON keeps its fields); set with ended through _ended.
    end_reason: str = "running"
    last_step: int | None = None
    checkpoints: list[int] = field(default_factory=list)
    sacct_state: str | None = None
    sacct_id: str | None = None               # what sacct knows the job as (array task: A_T)
    # Set when this attempt was started by coci-submit's relaunch loop inside the same allocation
    # (--spare-nodes): why, where, and the latency split (detect, process start, restore).
    in_place: dict[str, Any] | None = None
    # Why a lost rank cannot be covered by a survivors' save in this attempt (state held in parts
    # across ranks, such as FSDP2's), from its attempt_start record; None when it can.
    survivors_off: str | None = None
    # Whether steps_lost is exact (the previous attempt's progress records, or its stop); False: a
    # lower bound from the event log; None: not recorded (a log written before the records).
    steps_lost_exact: bool | None = None
    prev_last_step: int | None = None         # the previous attempt's last finished step, as this one read it


@dataclass
class RunHistory:
    ckpt_dir: str
    attempts: list[Attempt]
    checkpoints: list[dict[str, Any]]        # step, kind, attempt, blocking_s, persist_s
    loss_steps: list[int]
    loss_values: list[float]
    loss_attempts: list[int]
    status: str                              # completed|gave_up|error|running|stopped
    final_step: int | None
    message: str
    sacct_note: str | None = None            # why Slurm's record is missing, when it is
    # A peer rank lost mid-run: attempt, step saved by the survivors (or why not), seconds from
    # the failure to the commit, the lost ranks, the steps the next attempt repeated.
    peer_losses: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0                    # event-log lines that did not parse (torn, foreign, damaged)
    # The newest two-tier plan (memory and disk intervals and why), from its two_tier_plan record
    two_tier_plan: dict[str, Any] | None = None

    @property
    def steps_lost_total(self) -> int:
        return sum(a.steps_lost or 0 for a in self.attempts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps_lost_total"] = self.steps_lost_total
        for a in d["attempts"]:
            del a["end_reason"]   # a part of "ended" already
        d["losses"] = {"steps": d.pop("loss_steps"), "values": d.pop("loss_values"),
                       "attempts": d.pop("loss_attempts")}
        return d


def _ended(a: Attempt, reason: str, source: str, how: str = "") -> None:
    """Record how ``a`` ended: the reason, where that was read, and how (shown after the reason)."""
    a.end_reason, a.ended_source = reason, source
    a.ended = f"{reason} ({how})" if how else reason


def _refused(e: End) -> bool:
    """An attempt that refused to start (nothing was trained or changed): not how the run ended.
    (An older log's refusal, status "error", is typed ``refused`` when read: events.parse.)"""
    return e.status == EndStatus.REFUSED


def build(events: Iterable[Record | Mapping[str, Any]], ckpt_dir: str,
          sacct: dict[str, list[SlurmAttempt]] | None = None, sacct_note: str | None = None,
          skipped_lines: int = 0) -> RunHistory:
    """The history from the event records (oldest first: the typed records of
    :func:`coci_hpc.runtime.events.read_records`; lines as read, dicts, are parsed first) and
    sacct's attempts per job id.

    An attempt's end is what the NEXT attempt recorded about it (classified from Slurm's record),
    else its own ``stop``/``end`` record, else it is still running (or died without a trace yet).
    sacct rows of a job are matched to that job's attempts by time (the row whose run contains the
    attempt's start; a row the log never saw, e.g. an attempt that died before the Session wrote,
    does not shift the others). ``sacct`` is keyed by :attr:`Attempt.sacct_id` (an array task's
    ``A_T``: its raw job id is unknown to ``sacct -j``). A run whose last attempt Slurm ended
    (cancelled, failed, ...) without an end record is not "running".
    """
    attempts: dict[int, Attempt] = {}
    checkpoints: list[dict[str, Any]] = []
    loss_pts: list[tuple[int, Any, int]] = []
    status, final_step, message = "running", None, ""
    stops: dict[int, Stop] = {}
    peer_losses: list[dict[str, Any]] = []
    relaunches: dict[int, Relaunch] = {}        # failed attempt -> the relaunch loop's record
    resumed_wall: dict[int, float] = {}
    starts: dict[int, AttemptStart] = {}        # attempt -> its attempt_start record
    before: dict[int, tuple[str, Any, str]] = {}  # attempt -> the run's status when it started
    tt_plan: dict[str, Any] | None = None
    for line in events:
        e = line if isinstance(line, Record) else parse(dict(line))
        n = e.attempt if e is not None else line.get("attempt")   # type: ignore[union-attr]
        if not isinstance(n, int) or n < 1:    # a damaged record: no attempt of its own to belong to
            skipped_lines += 1
            continue
        if e is None:                          # an event this version does not know
            continue
        if isinstance(e, AttemptStart):
            starts[n] = e
            # A new attempt runs again (a completed run trained further); its refusal puts back the before.
            before[n] = (status, final_step, message)
            status, final_step, message = "running", None, ""
            attempts[n] = Attempt(
                attempt=n, job_id=e.job_id, nodes=list(e.nodes), ranks=e.ranks,
                start_wall=e.wall, resumed_step=e.resumed_step, steps_lost=e.steps_lost,
                prev_end=dict(e.prev_end), restart_latency_s=None,
                sacct_id=e.slurm_id or e.job_id, survivors_off=e.survivors_off,
                steps_lost_exact=e.steps_lost_exact, prev_last_step=e.prev_last_step)
            for step in e.torn_survivors_saves:
                # The previous attempt's survivors were killed mid-save: no peer_lost record of theirs.
                peer_losses.append({"attempt": n - 1, "step": step, "committed": False, "after_failure_s": None,
                                    "lost_ranks": None, "reason": "the survivors' save was killed before "
                                    "its manifest", "fallback_step": e.resumed_step, "steps_lost": None})
            continue
        a = attempts.get(n)
        if isinstance(e, Relaunch):
            relaunches[n] = e
        elif isinstance(e, Resumed) and a is not None:
            a.restart_latency_s = e.restart_latency_s
            resumed_wall[n] = float(e.wall or 0.0)
        elif isinstance(e, Checkpoint):
            checkpoints.append({"step": e.step, "kind": e.kind, "attempt": n,
                                "blocking_s": e.blocking_s, "persist_s": e.persist_s})
            if a is not None and e.step is not None:
                a.checkpoints.append(int(e.step))
        elif isinstance(e, Losses):
            for s, v in zip(e.steps, e.values):
                loss_pts.append((int(s), v, n))   # a null loss (NaN when written) is a gap in the plot
        elif isinstance(e, Stop):
            stops[n] = e
        elif isinstance(e, TwoTierPlan):
            tt_plan = {"attempt": n, "wall": e.wall, "memory_every": e.memory_every, "disk_every": e.disk_every,
                       "reason": e.reason, "disk_reason": e.disk_reason}
        elif isinstance(e, PeerLost):
            fail, commit = e.failure_wall, e.commit_wall
            peer_losses.append({"attempt": n, "step": e.step, "committed": bool(e.committed),
                                "failure_wall": fail,
                                "after_failure_s": (commit - fail) if commit and fail else None,
                                "lost_ranks": e.ranks_lost, "reason": e.reason or "",
                                "fallback_step": e.fallback_step, "steps_lost": None,
                                "tier": e.tier})
            if e.committed:
                checkpoints.append({"step": e.step, "kind": "survivors", "attempt": n,
                                    "blocking_s": None, "persist_s": e.save_s})
                if a is not None and e.step is not None:
                    a.checkpoints.append(int(e.step))
        elif isinstance(e, End) and _refused(e):
            if a is not None:
                _ended(a, "refused", "session")
            status, final_step, message = before.get(n, (status, final_step, message))
        elif isinstance(e, End):
            status, final_step, message = str(e.status), e.step, str(e.message or "")
            if a is not None:
                _ended(a, status, "session")
    ordered = [attempts[k] for k in sorted(attempts)]
    for prev, nxt in zip(ordered, ordered[1:]):
        reason = nxt.prev_end.get("reason")
        # "none": the next attempt found this one ended (completed, refused, ...): its own record says how.
        if reason and reason != PrevEndReason.NONE:
            _ended(prev, str(reason), str(nxt.prev_end.get("source") or ""))
    for prev, nxt in zip(ordered, ordered[1:]):
        r = relaunches.get(prev.attempt)
        if r is None or r.action != RelaunchAction.RELAUNCH:
            continue
        # The relaunch record's typed cause, the same rule the next attempt's prev_end used
        # (runtime/attempts.py); its reason is prose ("not n2: lost a task" after a crash).
        lost = relaunch_cause(r)
        _ended(prev, str(lost), "relaunch", "restarted in place")
        nxt.in_place = in_place_split(r, [p for p in peer_losses if p["attempt"] == prev.attempt],
                                      starts.get(nxt.attempt), resumed_wall.get(nxt.attempt))
    for a in ordered:
        if a.ended == "running" and a.attempt in stops:
            st = stops[a.attempt]
            _ended(a, str(st.reason), "session", "stopped, requeued" if st.requeued else "stopped")
    for a in ordered:
        pts = [s for s, _, n in loss_pts if n == a.attempt]
        a.last_step = max(pts) if pts else (a.checkpoints[-1] if a.checkpoints else a.resumed_step)
    for prev, nxt in zip(ordered, ordered[1:]):
        # A crash's losses lag its last step; the next attempt read that step from the progress records.
        if nxt.prev_last_step is not None and (prev.last_step is None or nxt.prev_last_step > prev.last_step):
            prev.last_step = nxt.prev_last_step
    if status == "running" and ordered and ordered[-1].attempt in stops:
        status = "stopped"
    if sacct:
        for a in ordered:
            row = _row_of(a, sacct.get(str(a.sacct_id)) or [])
            if row is not None:
                a.sacct_state = row.state
        last = ordered[-1] if ordered else None
        if status in ("running", "stopped") and last is not None and last.sacct_state in SLURM_ENDED:
            requeued_stop = last.attempt in stops and stops[last.attempt].requeued
            if not requeued_stop and last.ended == "running":
                status = last.sacct_state.lower()
                _ended(last, status, "sacct")
    loss_pts.sort(key=lambda p: (p[2], p[0]))
    for pl in peer_losses:
        after = [x for x in ordered if x.attempt == pl["attempt"] + 1]
        pl["steps_lost"] = after[0].steps_lost if after else None
    return RunHistory(
        ckpt_dir=ckpt_dir, attempts=ordered, checkpoints=checkpoints,
        loss_steps=[p[0] for p in loss_pts], loss_values=[p[1] for p in loss_pts],
        loss_attempts=[p[2] for p in loss_pts], status=status, final_step=final_step, message=message,
        sacct_note=sacct_note, peer_losses=peer_losses, skipped_lines=skipped_lines, two_tier_plan=tt_plan)


def _gap(a: Any, b: Any) -> float | None:
    return float(b) - float(a) if a is not None and b is not None else None


def in_place_split(relaunch: Relaunch, peer_losses: Sequence[dict[str, Any]],
                   start: AttemptStart | None, resumed_wall: float | None) -> dict[str, Any]:
    """An in-place restart's latency, failure -> first resumed step, in the order it is paid:

    - ``detect_s``: the failure (a survivor's view of it, ``peer_lost``; else the step's end) ->
      the rank step ended (the survivors' detection and save, srun's end);
    - ``decide_s``: -> the relaunch loop's decision (Slurm asked about the nodes);
    - ``relaunch_s``: -> the new rank processes exist (srun's launch);
    - ``process_start_s``: -> the Session is created (interpreter, imports, MPI and torch set-up);
    - ``restore_s``: -> the first resumed step (event log and checkpoint read).
    Parts the records do not hold (an older log) are None; ``total_s`` is then from the step's end.
    """
    ended, decided = relaunch.step_ended_wall, relaunch.decided_wall
    fails = [float(p["failure_wall"]) for p in peer_losses if p.get("failure_wall")]
    failure = min(fails) if fails else ended
    proc = start.process_wall if start is not None else None
    session = start.session_wall if start is not None else None
    res = resumed_wall
    return {
        # A log without the relaunch's nodes said null here; a relaunch always names where it starts.
        "restart": relaunch.restart, "reason": relaunch.reason, "nodes": relaunch.nodes or None,
        "detect_s": _gap(failure, ended), "decide_s": _gap(ended, decided),
        "relaunch_s": _gap(decided, proc), "process_start_s": _gap(proc, session) if proc else _gap(decided, session),
        "restore_s": _gap(session, res) if session else _gap(start.wall if start is not None else None, res),
        "total_s": _gap(failure, res),
    }


# How an attempt that nothing interrupted ends (the next attempt, if any, is a new start).
NOT_INTERRUPTED = (EndStatus.COMPLETED, EndStatus.REFUSED, PrevEndReason.NONE, EndStatus.GAVE_UP)

# Slurm states after which the run does not come back by itself (REQUEUED and PREEMPTED do).
SLURM_ENDED = states.RUN_OVER


def _row_of(a: Attempt, rows: Sequence[SlurmAttempt], slack_s: float = 5.0) -> SlurmAttempt | None:
    """The sacct row whose run contains the attempt's start (the latest that started before it)."""
    if a.start_wall is None:
        return None
    fits = [r for r in rows if r.start is not None and r.start <= a.start_wall + slack_s
            and (r.end is None or a.start_wall <= r.end + slack_s)]
    return max(fits, key=lambda r: r.start or 0.0) if fits else None


def load(ckpt_dir: str | Path, *, use_sacct: bool = True, runner: commands.Runner | None = None) -> RunHistory:
    """Read the event log under ``ckpt_dir`` and ask sacct about each job id it names."""
    run = runner or commands.run_command
    root = Path(ckpt_dir)
    if not (root / FILENAME).is_file():
        tasks = sorted(p.parent.name for p in root.glob(f"task*/{FILENAME}"))
        hint = (f"this is an array run: pass one task's directory, e.g. {root / tasks[0]}" if tasks else
                "pass the --ckpt-dir the run used (coci-submit prints it); the log appears when the "
                "Session starts")
        raise UsageError(f"no event log {root / FILENAME}", hint=hint)
    events, skipped = read_records_counted(root / FILENAME)
    sacct: dict[str, list[SlurmAttempt]] = {}
    note = None if use_sacct else "not asked (--no-sacct)"
    if use_sacct:
        ids = (e.slurm_id or e.job_id for e in events if isinstance(e, AttemptStart))
        for job in dict.fromkeys(str(j) for j in ids if j):
            try:
                sacct[job] = job_attempts(job, run)
            except SlurmError as exc:
                note = f"sacct unavailable: {exc.message}"
                break
    return build(events, str(root), sacct, note, skipped)


def _clock(wall: float | None) -> str:
    return "-" if wall is None else dt.datetime.fromtimestamp(wall).strftime("%H:%M:%S")


def _i(x: Any) -> str:
    return "-" if x is None else str(x)


def _s(x: Any, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _lost(a: Attempt) -> str:
    """Steps lost; ``>=N`` when only a lower bound is known (no progress record survived)."""
    return ">=" + str(a.steps_lost) if a.steps_lost and a.steps_lost_exact is False else _i(a.steps_lost)


def render_text(h: RunHistory) -> str:
    """The human summary: one row per attempt, then checkpoints and totals."""
    jobs = sorted({str(a.job_id) for a in h.attempts if a.job_id})
    lines = [f"run {h.ckpt_dir}: {len(h.attempts)} attempt(s), job(s) {', '.join(jobs) or '(outside Slurm)'}, "
             f"status {h.status}" + (f" at step {h.final_step}" if h.final_step is not None else "")
             + (f": {h.message}" if h.message and h.status != "completed" else "")]
    # Left to right in time: the attempt starts (resumed from, steps the restart lost, how long the
    # restart took and where that went), trains up to a step, and ends for a reason.
    head = (f"{'att':>3} {'job':>7} {'nodes':<10} {'start':>8} {'from':>6} {'lost':>5} {'restart s':>9} "
            f"{'= requeue':>9} {'+ start':>7} {'+ restore':>9} {'to':>6}  {'ended':<28} sacct")
    lines += ["", head]
    for a in h.attempts:
        lat = a.restart_latency_s or {}
        lines.append(
            f"{a.attempt:>3} {str(a.job_id or '-'):>7} {','.join(a.nodes)[:10]:<10} {_clock(a.start_wall):>8} "
            f"{_i(a.resumed_step if a.resumed_step is not None else 0):>6} {_lost(a):>5} "
            f"{_s(lat.get('total')):>9} {_s(lat.get('slurm_requeue_s')):>9} {_s(lat.get('process_start_s')):>7} "
            f"{_s(lat.get('restore_s'), 2):>9} {_i(a.last_step):>6}  "
            f"{(a.ended + (' [' + a.ended_source + ']' if a.ended_source else ''))[:28]:<28} {a.sacct_state or '-'}")
    kinds: dict[str, int] = {}
    for c in h.checkpoints:
        kinds[str(c["kind"])] = kinds.get(str(c["kind"]), 0) + 1
    steps = ", ".join(str(c["step"]) for c in h.checkpoints[:20]) + (" ..." if len(h.checkpoints) > 20 else "")
    blocking = [c["blocking_s"] for c in h.checkpoints if c.get("blocking_s") is not None]
    lines += ["", f"checkpoints: {len(h.checkpoints)} ("
              + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) + f"): steps {steps or '-'}"
              + (f"; save stall mean {sum(blocking) / len(blocking):.3f}s" if blocking else "")]
    for pl in h.peer_losses:
        if pl["committed"]:
            tier = f" from the {pl['tier']} tier" if pl.get("tier") else ""
            lines.append(f"attempt {pl['attempt']}: rank(s) {pl['lost_ranks']} lost; survivors' checkpoint{tier} of step "
                         f"{pl['step']} committed {_s(pl['after_failure_s'])}s after the failure; "
                         f"steps lost {_i(pl['steps_lost'])}")
        else:
            who = f"rank(s) {pl['lost_ranks']} were" if pl.get("lost_ranks") else "a rank was"
            lines.append(f"attempt {pl['attempt']}: {who} lost after step {pl['step']}; no survivors' "
                         f"checkpoint ({pl['reason']}); fell back to step {_i(pl['fallback_step'])} (the disk tier served); "
                         f"steps lost {_i(pl['steps_lost'])}")
    lines.append(f"steps lost in total: {h.steps_lost_total}")
    if h.attempts and h.attempts[-1].survivors_off:
        lines.append(f"on a lost rank: no survivors' save, back to the last checkpoint: {h.attempts[-1].survivors_off}")
    for a in h.attempts:
        ip = a.in_place
        if ip:
            lines.append(f"attempt {a.attempt}: restarted in place on {','.join(ip.get('nodes') or [])} "
                         f"(in-place restart {ip.get('restart')}): {_s(ip.get('total_s'))}s = detect "
                         f"{_s(ip.get('detect_s'))} + decide {_s(ip.get('decide_s'))} + relaunch "
                         f"{_s(ip.get('relaunch_s'))} + start {_s(ip.get('process_start_s'))} + restore "
                         f"{_s(ip.get('restore_s'), 2)}; {ip.get('reason')}")
    tp = h.two_tier_plan
    if tp:
        mem = (f"memory copy every {tp['memory_every']} step(s)" if tp.get("memory_every")
               else "no memory tier")
        lines.append(f"two-tier plan (attempt {tp['attempt']}, {_clock(tp.get('wall'))}): {mem}, disk save every "
                     f"{_i(tp.get('disk_every'))} step(s)")
        lines.append(f"  memory: {tp.get('reason') or '-'}")
        lines.append(f"  disk: {tp.get('disk_reason') or '-'}")
    if h.sacct_note:
        lines.append(f"sacct: {h.sacct_note}")
    if h.skipped_lines:
        lines.append(f"event log: {h.skipped_lines} unreadable line(s) skipped")
    return "\n".join(lines)


# Attempts in cool colours, interruptions in warm ones, so the two never look alike.
_ATTEMPT_COLOURS = ("tab:blue", "tab:cyan", "tab:green", "tab:olive", "tab:gray", "navy", "teal")
# Colours for why an attempt ended (interruptions on the plot).
_REASON_COLOURS: dict[str, str] = {PrevEndReason.PREEMPTION: "tab:red", PrevEndReason.TIME_LIMIT: "tab:orange",
                   PrevEndReason.NODE_FAILURE: "tab:purple", PrevEndReason.REQUEUE_BY_HAND: "tab:brown",
                   PrevEndReason.CRASH: "black", PrevEndReason.RANK_FAILURE: "tab:pink"}

# Checkpoint markers by kind (a survivors' checkpoint: the default).
_CHECKPOINT_MARKERS: dict[str, tuple[str, int, str]] = {
    CheckpointKind.PLANNED: ("^", 6, "none"), CheckpointKind.STOP: ("^", 8, "black"),
    CheckpointKind.FINAL: ("*", 12, "gold")}


@dataclass(frozen=True)
class Interruption:
    """One end of an attempt that another attempt followed, as the plot marks it."""

    step: int                 # where the attempt stopped (its last step seen)
    reason: str               # preemption, time_limit, node_failure, crash, ...
    resumed_step: int | None  # where the next attempt resumed (steps in between were repeated)
    steps_lost: int
    in_place: bool            # restarted inside the allocation (--spare-nodes), not through the queue
    latency_s: float | None   # failure (or stop) -> first resumed step


def interruptions(h: RunHistory) -> list[Interruption]:
    """The interruptions of a run, in order: what the PNG draws (pure, so it is tested apart)."""
    out = []
    for a, nxt in zip(h.attempts, h.attempts[1:]):
        if a.end_reason in NOT_INTERRUPTED:
            continue                  # it ended by itself (completed, refused to start): nothing broke
        x = a.last_step if a.last_step is not None else nxt.resumed_step
        if x is None:
            continue
        lat = (nxt.in_place or {}).get("total_s") if nxt.in_place else (nxt.restart_latency_s or {}).get("total")
        out.append(Interruption(int(x), a.end_reason, nxt.resumed_step, nxt.steps_lost or 0,
                                nxt.in_place is not None, None if lat is None else float(lat)))
    return out


def plot(h: RunHistory, path: str | Path) -> Path:
    """PNG of the loss curve, one colour per attempt, with checkpoints and interruptions marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(h)
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out


def figure(h: RunHistory) -> Any:
    """The matplotlib figure :func:`plot` writes (the caller closes it)."""
    import matplotlib
    import numpy as np
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    by_attempt: dict[int, tuple[list[int], list[float]]] = {}
    for s, v, n in zip(h.loss_steps, h.loss_values, h.loss_attempts):
        if v is not None:
            by_attempt.setdefault(n, ([], []))[0].append(s)
            by_attempt[n][1].append(v)
    total = sum(len(xs) for xs, _ in by_attempt.values())
    window = max(1, total // 80)   # a real loss is noisy: the raw curve faint, a running mean on top
    for n, (xs, ys) in sorted(by_attempt.items()):
        colour = _ATTEMPT_COLOURS[(n - 1) % len(_ATTEMPT_COLOURS)]
        if window > 1 and len(ys) >= window:
            ax.plot(xs, ys, lw=0.6, alpha=0.3, color=colour)
            mean = np.convolve(ys, np.ones(window) / window, mode="valid")
            ax.plot(xs[window - 1:], mean, lw=1.8, color=colour, label=f"attempt {n}")
        else:
            ax.plot(xs, ys, lw=1.4, color=colour, label=f"attempt {n}")
    ymin, ymax = ax.get_ylim()
    # Checkpoints: markers along the bottom axis (planned hollow, stop-time saves filled, final a star).
    ck: dict[str, list[int]] = {}
    for c in h.checkpoints:
        if c.get("step") is not None:
            ck.setdefault(str(c["kind"]), []).append(int(c["step"]))
    for kind, xs in ck.items():
        marker, size, face = _CHECKPOINT_MARKERS.get(kind, ("^", 6, "none"))
        ax.plot(xs, [ymin] * len(xs), marker, ms=size, mfc=face, mec="black", ls="none",
                clip_on=False, zorder=5, label=f"checkpoint ({kind})")
    seen: set[str] = set()
    labels: list[str] = []
    for it in interruptions(h):
        colour = _REASON_COLOURS.get(it.reason, "black")
        # Through the queue: dashed; restarted inside the allocation (spare nodes): dotted, and the
        # label says so with its latency (seconds, where the queue costs tens).
        label = f"restarted in place: {it.reason}" if it.in_place else f"interrupted: {it.reason}"
        ax.axvline(it.step, color=colour, ls=":" if it.in_place else "--", lw=1.6 if it.in_place else 1.2,
                   label=None if label in seen else label)
        seen.add(label)
        if it.resumed_step is not None and it.resumed_step < it.step:
            ax.axvspan(it.resumed_step, it.step, color=colour, alpha=0.12, lw=0)
        text = f"{it.reason}\n{it.steps_lost} lost"
        if it.in_place:
            text += "\nin place" + ("" if it.latency_s is None else f" {it.latency_s:.0f}s")
        # Interruptions close together would print over each other: step the labels down.
        ax.annotate(text, (it.step, ymax), xytext=(3, -4 - 34 * (len(labels) % 3)),
                    textcoords="offset points", va="top", fontsize=8, color=colour,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
        labels.append(it.reason)
    ax.set_ylim(ymin, ymax)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    lat = [float(a.restart_latency_s["total"]) for a in h.attempts
           if a.restart_latency_s and a.restart_latency_s.get("total") is not None]
    n_in_place = sum(1 for a in h.attempts if a.in_place)
    ax.set_title(f"{Path(h.ckpt_dir).parent.name}/{Path(h.ckpt_dir).name}: {len(h.attempts)} attempts"
                 + (f" ({n_in_place} restarted in place)" if n_in_place else "") + f", {h.status}, "
                 f"{h.steps_lost_total} steps lost"
                 + (f", restart latency mean {sum(lat) / len(lat):.0f}s" if lat else ""), fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig
