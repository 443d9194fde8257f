"""Every ``COCI_*`` environment variable coci_hpc reads: one table (name, type, default, meaning).

Everything that reads or sets one goes through :data:`VARS` (by its constant, e.g.
:data:`CKPT_DIR`), so a name, a type or a default is spelled once; docs/reference/configuration.md's
table is :func:`markdown_table` (a test checks that they match, and that no module spells a
``COCI_*`` name the table lacks). Each default a variable falls back to is a value here (the signal
lead, the peer deadline, the memory tier's first interval, ...), stated once: the modules that use it
import it, and the table's and the options' help text are formatted from it. ``SLURM_*`` variables have their own table,
:mod:`coci_hpc.slurm.env`. Variables only the shell scripts read (slurm/setup, the local cluster,
the demo) and the test-only fault-injection knobs are listed in the doc by hand.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The defaults, each stated once (coci-submit's options, the Session, the relaunch loop, the planner).
SIGNAL_LEAD_S = 90              # seconds of warning before the time limit (--signal=USR2@90)
MAX_RESTARTS = 3                # in-place restarts (--spare-nodes) before the requeue / giving up
MAX_REQUEUES_SUBMIT = 10        # coci-submit's --max-requeues (the Session alone: no limit)
NO_PROGRESS_LIMIT = 3           # restarts in a row from the same checkpoint before giving up
POLICY_DEFAULT = "coci"         # the checkpoint policy
PEER_TIMEOUT_S = 5.0            # what a peer gets to reach the step boundary before it counts as lost ...
PEER_TIMEOUT_STEPS = 10.0       # ... and at least this many typical steps (runtime/stepsync.py)
MEMTIER_EVERY = 10              # the memory tier's copy interval until the two-tier planner sets one
DIST_TIMEOUT_S = 120.0          # bound on every gloo/NCCL collective (init_distributed)
WHOLE_JOB_SHARE_PRIOR = 0.15    # SCR: 85 % of failures served by the node-local/partner levels
OUTAGE_HOURS_PRIOR = 160.0      # Blue Waters: 39 system-wide outages in 261 days (one per this many hours)


def pos_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise ValueError(text)
    return v


def non_negative(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise ValueError(text)
    return v


def flag(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


@dataclass(frozen=True)
class Var:
    name: str
    parse: Callable[[str], Any]
    default: Any                 # what an unset (or empty) variable means; None: unset
    meaning: str
    read_by: str
    default_text: str = ""       # the default as the doc says it, when ``repr`` would not do

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text, None when unset or empty."""
        v = (os.environ if environ is None else environ).get(self.name)
        return v if v else None

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value, else the default (a bad value is a ValueError naming the variable)."""
        raw = self.raw(environ)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r} is not valid") from None


CKPT_DIR = Var("COCI_CKPT_DIR", str, None, "checkpoint directory (checkpoints and `events.jsonl`); set by "
               "coci-submit", "Session (`ckpt_dir`), the relaunch loop", "required (a `UsageError` says how to give it)")
POLICY = Var("COCI_POLICY", str, POLICY_DEFAULT, "checkpoint policy: `coci`, `young`, `daly`, `checkfreq[:P]`, "
             "`fixed:N`, `coci-paper[:capped]`", "Session (`policy`)", f"`{POLICY_DEFAULT}`")
MAX_REQUEUES = Var("COCI_MAX_REQUEUES", pos_int, None, "give up after this many restarts after unannounced ends",
                   "Session (`max_requeues`)", f"no limit in the Session (coci-submit sets {MAX_REQUEUES_SUBMIT})")
NO_PROGRESS = Var("COCI_NO_PROGRESS_LIMIT", pos_int, NO_PROGRESS_LIMIT, "give up after this many restarts in a "
                  "row from the same checkpoint", "Session (`no_progress_limit`)")
SIGNAL_LEAD = Var("COCI_SIGNAL_LEAD_S", non_negative, None, "seconds of warning before the time limit "
                  "(`--signal=USR2@N`)", "Session (`signal_lead_s`)",
                  f"{SIGNAL_LEAD_S} s assumed (coci-submit and the templates set it)")
RESUME_OTHER_RUN = Var("COCI_RESUME_FROM_OTHER_RUN", flag, False, "`1`: accept another run's checkpoint "
                       "directory and make this command its run", "Session (`resume_from_other_run`)",
                       "`0` (refused)")
PEER_TIMEOUT = Var("COCI_PEER_TIMEOUT_S", non_negative, None, "least time a peer may keep the per-step agreement "
                   "waiting before it counts as lost", "Session (`peer_timeout_s`)",
                   f"{PEER_TIMEOUT_S:g} s (and at least {PEER_TIMEOUT_STEPS:g} typical steps)")
SURVIVORS = Var("COCI_SURVIVORS", str, "1", "`0` turns the survivors' save and the partner copy off (detection "
                "and requeue stay)", "Session (`survivors`)", "`1`")
MEMTIER_K = Var("COCI_MEMTIER_K", pos_int, None, "memory tier (state held in parts, e.g. FSDP2): copy each rank's "
                f"state to its partner every k steps; `0` turns it off; unset: {MEMTIER_EVERY} until the two-tier "
                "planner sets k", "Session", f"{MEMTIER_EVERY}, then planned")
DIST_TIMEOUT = Var("COCI_DIST_TIMEOUT_S", float, DIST_TIMEOUT_S, "bound on every gloo/NCCL collective, and on the "
                   "start-up rendezvous (each rank's stack is printed 10 s before it ends)", "`init_distributed`", f"{DIST_TIMEOUT_S:g} s")
SHIELD_SIGNALS = Var("COCI_SHIELD_SIGNALS", str, None, "`0`: do not shield DataLoader workers from "
                     "USR1/USR2/SIGTERM; `1`: shield outside a Slurm step too", "`import coci_hpc`",
                     "on inside a Slurm step")
CACHE_DIR = Var("COCI_CACHE_DIR", str, None, "where the partition's failure model is cached",
                "the failure-history cache", "`$XDG_CACHE_HOME/coci_hpc` (`~/.cache/coci_hpc`)")
PEER_NOTICE = Var("COCI_PEER_NOTICE", str, None, "path of the relaunch loop's peer notice; set by coci-submit's "
                  "relaunch loop (`--spare-nodes`), not by users", "Session", "unset")
INPLACE_RESTARTS = Var("COCI_INPLACE_RESTARTS", pos_int, None, "the relaunch loop's in-place restart number; set "
                       "by the loop, not by users", "Session", "unset")
WHOLE_JOB_SHARE = Var("COCI_WHOLE_JOB_SHARE", float, None, "share of the incidents hitting a job that end the "
                      "whole job (no survivor: the memory tier cannot serve them), strictly between 0 and 1; "
                      "the two-tier plan's disk interval answers them", "the two-tier planner (Session, coci-plan)",
                      f"{WHOLE_JOB_SHARE_PRIOR:g} (SCR), or learned from the event logs")
OUTAGE_RATE = Var("COCI_OUTAGE_RATE", float, None, "outages per hour that end every job (file system, scheduler, "
                  "fabric), >= 0; the two-tier plan's disk interval answers them",
                  "the two-tier planner (Session, coci-plan)",
                  f"1/{OUTAGE_HOURS_PRIOR:g} (Blue Waters), or learned from the Slurm history")
DEBUG = Var("COCI_DEBUG", str, None, "any value: print the traceback of a failed collective step",
            "`coci_hpc.comm`", "unset")

VARS: tuple[Var, ...] = (CKPT_DIR, POLICY, MAX_REQUEUES, NO_PROGRESS, SIGNAL_LEAD, RESUME_OTHER_RUN, PEER_TIMEOUT,
                         SURVIVORS, MEMTIER_K, DIST_TIMEOUT, SHIELD_SIGNALS, CACHE_DIR, PEER_NOTICE, INPLACE_RESTARTS,
                         WHOLE_JOB_SHARE, OUTAGE_RATE, DEBUG)
BY_NAME = {v.name: v for v in VARS}


def markdown_table() -> str:
    """The table of docs/reference/configuration.md, from :data:`VARS`."""
    rows = ["| variable | read by | meaning | default |", "|---|---|---|---|"]
    for v in VARS:
        rows.append(f"| `{v.name}` | {v.read_by} | {v.meaning} | {v.default_text or v.default} |")
    return "\n".join(rows)
