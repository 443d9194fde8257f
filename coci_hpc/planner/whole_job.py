"""Failures that end the whole job at once: what the memory tier cannot cover beyond partner losses.

The memory tier lives in the job's processes. A failure that ends every rank at once (a software
error raised on all ranks, an NCCL hang, a switch, a file system or scheduler outage) leaves no
survivor to save from it, and the job goes back to its last disk checkpoint. Two components:

* ``share``: the probability that an incident hitting the job (a node failure) ends the whole
  job rather than its own ranks only. Prior 15 %: SCR's multi-level work at LLNL found its
  node-local and partner levels covered about 85 % of the system's failures, the rest needed
  the parallel file system. Learned from our own event logs when they are given (attempts that
  ended with no stop and no survivors' save, over the node incidents the run saw).
* ``outage_rate``: outages (per second) that end every job on the partition, whatever its size.
  Prior one per 160 hours: Blue Waters, 39 system-wide outages in 261 days (Di Martino et al.,
  DSN 2014). Learned from Slurm when its history shows any (partition- or cluster-wide
  incidents in the node events, several jobs ending NODE_FAIL in the same minute).

Pure: numbers in, a frozen :class:`WholeJob` out. The Slurm side (which records are outages)
is in :mod:`coci_hpc.slurm.accounting`; the event-log side in :mod:`coci_hpc.runtime.events`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from coci_hpc import settings
from coci_hpc.errors import UsageError

DEFAULT_SHARE = settings.WHOLE_JOB_SHARE_PRIOR       # SCR's (the value and its source: settings.py)
DEFAULT_OUTAGE_HOURS = settings.OUTAGE_HOURS_PRIOR   # Blue Waters
SHARE_PRIOR_WEIGHT = 2.0             # the prior share counts as this many observed ends
OUTAGE_NODE_SHARE = 0.5              # an incident on at least this share of the watched nodes: an outage


@dataclass(frozen=True)
class WholeJob:
    """``share``: P(an incident hitting the job ends all of it); ``outage_rate``: outages per second
    that end every job; ``*_source``: "prior", "given" (a setting or option) or "learned"."""

    share: float
    outage_rate: float
    share_source: str = "prior"
    outage_source: str = "prior"
    note: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.share, (int, float)) and 0.0 <= self.share < 1.0):
            raise UsageError(f"whole-job share must be in [0, 1), got {self.share!r}")
        if not (isinstance(self.outage_rate, (int, float)) and math.isfinite(self.outage_rate)
                and self.outage_rate >= 0.0):
            raise UsageError(f"outage rate must be a finite number >= 0 per second, got {self.outage_rate!r}")

    def describe(self) -> str:
        """One phrase for a plan's reason: both components and where each came from."""
        out = ("no system outages" if self.outage_rate <= 0
               else f"outages 1 per {1.0 / self.outage_rate / 3600:.4g} h")
        return (f"{100 * self.share:.3g} % of incidents end the whole job ({_src(self.share_source, 'SCR')}), "
                f"{out} ({_src(self.outage_source, 'Blue Waters')})")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["outage_mtbf_hours"] = None if self.outage_rate <= 0 else 1.0 / self.outage_rate / 3600
        return d


def _src(source: str, prior_of: str) -> str:
    return f"prior, {prior_of}" if source == "prior" else source


def check_share(value: float, name: str) -> float:
    """A whole-job share given by the user: strictly inside (0, 1). ``name`` is the setting or
    option that gave it (the error names it)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 < value < 1.0):
        raise UsageError(f"{name} {value!r}: the share of incidents that end the whole job must be "
                         "strictly between 0 and 1",
                         hint=f"e.g. {name} {DEFAULT_SHARE:g} (SCR's 15 %, the default)")
    return float(value)


def check_outage_rate(per_hour: float, name: str) -> float:
    """An outage rate given by the user, per hour: finite and >= 0 (0: no outages). Returns it
    per second."""
    if not (isinstance(per_hour, (int, float)) and math.isfinite(per_hour) and per_hour >= 0.0):
        raise UsageError(f"{name} {per_hour!r}: the rate of outages that end every job must be a "
                         "number >= 0 per hour",
                         hint=f"e.g. {name} {1 / DEFAULT_OUTAGE_HOURS:g} (one per {DEFAULT_OUTAGE_HOURS:g} h, "
                              "the default); 0 for none")
    return float(per_hour) / 3600.0


def resolve(*, share: float | None = None, share_name: str = "share",
            outage_per_hour: float | None = None, outage_name: str = "outage rate",
            learned_outages: tuple[int, float] | None = None,
            learned_share: tuple[int, float] | None = None) -> WholeJob:
    """The whole-job model from what was given and learned; the prior for what was not.

    A given value (a setting or an option) wins over what was learned, and that over the prior.
    ``learned_outages``: (outages seen, window seconds) from Slurm's history: a count of 0 learns
    nothing (the history "has none": the prior stays, the note says so). ``learned_share``:
    (whole-job ends, ends a survivor saw) from our own event logs, shrunk towards the prior."""
    notes = []
    if share is not None:
        f, fsrc = check_share(share, share_name), "given"
    elif learned_share is not None and learned_share[0] + learned_share[1] > 0:
        # a run's logs hold a handful of ends: shrink towards the prior (a beta prior worth
        # SHARE_PRIOR_WEIGHT ends), so one crash does not make every incident a whole-job one
        k, n = learned_share
        f = (k + DEFAULT_SHARE * SHARE_PRIOR_WEIGHT) / (k + n + SHARE_PRIOR_WEIGHT)
        fsrc = "learned"
        notes.append(f"{k} whole-job end(s) and {n:g} end(s) a survivor saw in the event logs")
    else:
        f, fsrc = DEFAULT_SHARE, "prior"
        if learned_share is not None:
            notes.append("the event logs show no whole-job end: the share is the prior")
    if outage_per_hour is not None:
        r, rsrc = check_outage_rate(outage_per_hour, outage_name), "given"
    elif learned_outages is not None and learned_outages[0] > 0 and learned_outages[1] > 0:
        k, span = learned_outages
        r, rsrc = k / span, "learned"
        notes.append(f"{k} outage(s) in {span / 3600:.4g} h of history")
    else:
        r, rsrc = 1.0 / (DEFAULT_OUTAGE_HOURS * 3600.0), "prior"
        if learned_outages is not None:
            notes.append(f"no outage in {learned_outages[1] / 3600:.4g} h of history: the rate is the prior")
    return WholeJob(f, r, fsrc, rsrc, "; ".join(notes))


def outage_count(sizes_times: list[tuple[int, float]], watched_nodes: int) -> int:
    """Incidents (node count, time) that took at least :data:`OUTAGE_NODE_SHARE` of the
    ``watched_nodes`` (and at least 2 nodes): partition- or cluster-wide outages."""
    if watched_nodes < 2:
        return 0
    need = max(2, math.ceil(OUTAGE_NODE_SHARE * watched_nodes))
    return sum(1 for m, _ in sizes_times if m >= need)


def given_from_settings(environ=None) -> dict:
    """``resolve``'s keyword arguments from ``COCI_WHOLE_JOB_SHARE`` and ``COCI_OUTAGE_RATE``
    (unset: None, the learned value or the prior). A bad value is a :class:`UsageError` naming
    the variable."""
    out: dict = {"share_name": settings.WHOLE_JOB_SHARE.name, "outage_name": settings.OUTAGE_RATE.name}
    for var, key, check in ((settings.WHOLE_JOB_SHARE, "share", check_share),
                            (settings.OUTAGE_RATE, "outage_per_hour", check_outage_rate)):
        try:
            v = var.get(environ)
        except ValueError as exc:
            raise UsageError(str(exc), hint=f"{var.name} is a number ({var.meaning.split(',')[0]}), "
                                            "or unset it for the default") from None
        if v is not None:
            check(v, var.name)
        out[key] = v
    return out
