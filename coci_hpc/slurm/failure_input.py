"""The failure-model pipeline of ``coci-plan``: a failure history (sacct/sacctmgr files, the cluster
itself) or a per-node MTBF in, a :class:`~coci_hpc.planner.failures.FailureModel` out.

The CLI (:mod:`coci_hpc.cli.plan`) parses the arguments into a :class:`FailureInput` and prints;
the checks of which sources go together, the window and the maintenance patterns are here. Error
messages name coci-plan's flags, the only way to give these inputs.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from coci_hpc.errors import PlannerError, UsageError
from coci_hpc.planner import failures as fmod
from coci_hpc.slurm import accounting as acct


@dataclass(frozen=True)
class FailureInput:
    """Where the failure model comes from (coci-plan's flags of the same names)."""

    mtbf_hours: float | None = None
    sacct_file: str | None = None
    events_file: str | None = None
    from_cluster: bool = False
    since: str | None = None
    until: str | None = None
    partition: str | None = None
    cluster_nodes: int | None = None
    confidence: float = 0.9
    skip_bad_lines: bool = False
    maintenance_patterns: tuple[str, ...] = ()


def failure_model(a: FailureInput, now: float) -> tuple[fmod.FailureModel, dict]:
    """The failure model and a description of where it came from (``source``, the window, the
    maintenance patterns, ...). Pure but for reading the files or asking the cluster."""
    if a.mtbf_hours is not None:
        if a.sacct_file or a.events_file or a.from_cluster:
            raise UsageError("give either --mtbf-hours or a failure history, not both",
                             hint="drop --mtbf-hours to use the history")
        if not (math.isfinite(a.mtbf_hours) and a.mtbf_hours > 0):
            raise UsageError(f"--mtbf-hours {a.mtbf_hours:g}: the per-node MTBF must be a positive number of hours",
                             hint="e.g. --mtbf-hours 70, or read it from the cluster with --from-cluster")
        return fmod.from_mtbf(a.mtbf_hours * 3600.0), {"source": "--mtbf-hours"}
    patterns = tuple(a.maintenance_patterns) if a.maintenance_patterns else \
        acct.DEFAULT_MAINTENANCE_PATTERNS
    for pat in patterns:
        try:
            re.compile(pat)
        except re.error as exc:
            raise UsageError(f"bad --maintenance-pattern {pat!r}: {exc}",
                             hint="give a Python regular expression") from exc
    info: dict
    if a.from_cluster:
        if a.sacct_file or a.events_file:
            raise UsageError("--from-cluster reads the cluster; drop --sacct-file/--events-file",
                             hint="use one source")
        if not a.since:
            raise UsageError("--from-cluster needs --since", hint="e.g. --since 2026-01-01")
        # Both are for files: the cluster's window ends now, and sinfo counts the partition's nodes.
        if a.cluster_nodes is not None:
            raise UsageError("--cluster-nodes is for --sacct-file/--events-file; --from-cluster counts the "
                             "partition's nodes with sinfo", hint="drop --cluster-nodes (or --partition to "
                                                                  "count another partition's nodes)")
        if a.until:
            raise UsageError("--until is for --sacct-file/--events-file; --from-cluster's window ends now",
                             hint="drop --until, or save sacct/sacctmgr output to files for an older window")
        model, info = acct.failure_model_from_cluster(
            a.partition, since=a.since, confidence=a.confidence, skip_bad_lines=a.skip_bad_lines,
            maintenance_patterns=patterns, now_s=now)
    elif a.sacct_file or a.events_file:
        if a.cluster_nodes is not None and a.cluster_nodes < 1:
            raise UsageError(f"--cluster-nodes {a.cluster_nodes} must be at least 1",
                             hint="the number of nodes in the cluster (or partition) the files cover")
        hist = acct.History()
        kw = {"skip_bad_lines": a.skip_bad_lines}
        if a.sacct_file:
            jobs = acct.read_file(a.sacct_file, "sacct", **kw)
            if not jobs.jobs:
                # nothing to count exposure, NODE_FAIL ends or outages from: a wrong file, not a quiet cluster
                raise UsageError(f"--sacct-file {a.sacct_file}: no job records that ran (the exposure, the "
                                 "NODE_FAIL ends and the outages are counted from them)",
                                 hint="produce it with: " + " ".join(acct.SACCT_ARGS) + " --starttime=...; "
                                      "or plan from --events-file or --mtbf-hours (the outage and whole-job "
                                      "rates then default to their priors)")
            hist = hist.merge(jobs)
        if a.events_file:
            hist = hist.merge(acct.read_file(a.events_file, "events", maintenance_patterns=patterns,
                                             **kw))
        start = acct.parse_since(a.since) if a.since else hist.first_s
        end = acct.parse_since(a.until, "--until") if a.until else hist.last_s
        if start is None or end is None:
            raise PlannerError("the failure history has no timestamps to form a window",
                               hint="check the files, or give --since/--until")
        n_cluster = a.cluster_nodes or len(hist.nodes_seen)
        model, info = acct.build_model(hist, start, end, cluster_nodes=n_cluster,
                                       have_events=bool(a.events_file), confidence=a.confidence)
        info["source"] = "files"
    else:
        raise UsageError("no failure information",
                         hint="give --sacct-file, --events-file, --from-cluster or --mtbf-hours")
    info["maintenance_patterns"] = list(patterns)
    return model, info
