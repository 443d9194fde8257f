"""The rank step of the relaunch loop, supervised: ``srun`` run to its end, its lost tasks noticed.

The relaunch loop (:mod:`coci_hpc.runtime.relaunch`) decides what to do when a rank step ends;
this module is its Slurm side: it starts srun, passes srun's lines through, counts the tasks srun
reports ended per node, tells the loop at once when the first is lost (``on_loss``), and ends a
step that does not end by itself (survivors stuck with a lost peer, a silent host).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from coci_hpc.slurm import commands

# The same, for a step none of whose ranks has started training yet (no ``<notice>.training``
# marker from the Session): there is nothing newer than the checkpoint they restore to save, and a
# rank stuck in MPI/gloo start-up with a peer on a node that just went would wait out the grace.
START_GRACE_S = 1.0
# Seconds the loop waits, once the survivors' writer has left after a peer loss and every task on
# the other nodes has ended, before it ends the silent node's tasks: the other survivors' exits may
# still be on their way to srun (a survivor counted silent is only preferred less on relaunch).
LEFT_SETTLE_S = 1.0



@dataclass
class StepLoss:
    """What srun said about lost tasks of one rank step: when it first did (monotonic) and on which nodes."""

    at: float | None = None
    nodes: list[str] = field(default_factory=list)


def watch_step(argv: Sequence[str], env: Mapping[str, str] | None, grace_s: float, poll_s: float = 0.2,
               on_loss: Callable[[str], None] | None = None, loss: StepLoss | None = None,
               training: str | None = None,
               start_grace_s: float = START_GRACE_S, nodes: Sequence[str] = (), tasks_per_node: int = 1,
               left: str | None = None, left_settle_s: float = LEFT_SETTLE_S) -> int:
    """Run the rank step (srun) to its end and return its status; srun's own lines pass through
    to this process's stderr. Once srun reports a task lost, ``on_loss`` gets srun's line (the
    relaunch loop posts the step's peer notice, :mod:`coci_hpc.runtime.peernotice`: the survivors
    stop waiting for the lost rank and save at once), and the step gets ``grace_s`` seconds to end by itself (the survivors' save), then it is
    ended (:func:`commands.end_step_signals`); only ``start_grace_s`` while the file ``training``
    (the Session's marker: its ranks are past their start) does not exist. ``loss`` collects the
    nodes srun named. Once the file ``left`` exists (the survivors' writer left after a peer loss)
    and every task on the step's other ``nodes`` has ended (:func:`silent_nodes`), the step is ended
    after ``left_settle_s`` and the nodes whose tasks never ended become ``loss``'s suspects."""
    p = subprocess.Popen(list(argv), env=None if env is None else dict(env), stderr=subprocess.PIPE,
                         text=True, bufsize=1, errors="replace")
    loss = loss if loss is not None else StepLoss()
    ended_tasks: dict[str, int] = {}

    def pump() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            lost = commands.srun_ended_tasks(line)
            if lost is None:
                continue
            node, count = lost
            ended_tasks[node] = min(tasks_per_node, ended_tasks.get(node, 0) + (count or tasks_per_node))
            # Suspect: the first loss, a node failure, a task killed by a signal. Not a task that
            # exited with a status after that (the survivors leave with 1 once they saved), nor what
            # this loop's own ending of the step killed.
            if node not in loss.nodes and ended_at is None and (
                    loss.at is None or "Node failure" in line or "Exited with exit code" not in line):
                loss.nodes.append(node)
            if loss.at is None:
                loss.at = time.monotonic()
                if on_loss is not None:
                    on_loss(line)
    ended_at: float | None = None
    silent_since: float | None = None
    reader = threading.Thread(target=pump, name="coci-srun-stderr", daemon=True)
    reader.start()
    while True:
        try:
            rc = p.wait(timeout=poll_s)
            break
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            lost_at = loss.at
            limit = grace_s if training is None or os.path.exists(training) else min(grace_s, start_grace_s)
            silent = silent_nodes(nodes, tasks_per_node, dict(ended_tasks),
                                  left is not None and os.path.exists(left)) if ended_at is None and nodes else ()
            silent_since = (silent_since or now) if silent else None
            if silent and silent_since is not None and now - silent_since >= left_settle_s:
                ended_at = now                 # first: the pump counts no later line as a loss
                loss.nodes[:] = list(silent)
                _say(f"the survivors saved and left after a peer loss; no task on {','.join(silent)} has ended "
                     f"(a silent host Slurm has not declared down yet): ending the step")
                commands.end_step_signals(p)
            elif ended_at is None and lost_at is not None and now - lost_at > limit:
                if limit < grace_s:
                    _say(f"a task of the rank step was lost {now - lost_at:.1f}s ago, before its ranks started "
                         f"training (nothing newer than their checkpoint to save): ending the step")
                else:
                    _say(f"a task of the rank step was lost {now - lost_at:.0f}s ago and the step is still "
                         f"running (a survivor stuck in a collective with the lost rank?): ending the step")
                ended_at = now                 # first: what the ending kills is no suspect
                commands.end_step_signals(p)
            elif ended_at is not None and now - ended_at > 30:
                p.kill()
    reader.join(timeout=5)
    return rc


def silent_nodes(step_nodes: Sequence[str], tasks_per_node: int, ended: Mapping[str, int],
                 survivors_left: bool) -> tuple[str, ...]:
    """The step's nodes none of whose tasks has ended, when the step can be ended without them:
    the survivors' writer has left after a peer loss (``survivors_left``, the Session's marker), and
    every task on every other node has ended (``ended``: tasks srun reported ended, per node). Else
    ``()``: wait (a slow but live peer keeps its whole deadline: without a peer loss the survivors
    never leave). Pure.

    Why: a host that goes silent (frozen, powered off, off the network) ends none of its tasks,
    and srun's step ends only when its last task does, that is when slurmctld declares the node
    DOWN (SlurmdTimeout, 300 s by default). These nodes are the suspects, not the survivors whose
    exit srun reported first."""
    if not survivors_left:
        return ()
    if any(0 < ended.get(n, 0) < tasks_per_node for n in step_nodes):
        return ()        # a node with some tasks still running: a survivor still leaving
    silent = tuple(n for n in step_nodes if ended.get(n, 0) == 0)
    return silent if 0 < len(silent) < len(step_nodes) else ()


def _say(msg: str) -> None:
    print(f"coci-relaunch: {msg}", file=sys.stderr, flush=True)
