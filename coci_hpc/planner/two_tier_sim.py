"""Replay incident traces against a two-tier plan (memory every k steps, disk every K k steps).

All runs of one plan advance together, one incident at a time (numpy over runs), and every
plan is run on the SAME traces. Between incidents a run's progress is arithmetic: training
time, a memory copy (``mem_ckpt_s``) after every k steps, memory copy + disk save
(``mem_ckpt_s + disk_ckpt_s``) at every K-th. What the first-order model leaves out and this
counts:

* an incident during a checkpoint: that checkpoint is lost (its stall so far is wasted);
* an incident that takes a rank and its partner (``flags``), or any incident when the plan has
  no memory tier, rolls back to the last disk checkpoint and costs ``disk_restart_s``; any other
  rolls back to the last memory checkpoint and costs ``mem_restart_s``;
* an incident during a restart restarts it (from the disk tier when that incident is flagged:
  the memory copy being restored may be the one lost);
* the last stretch has no checkpoint after it (the job ends).
Overhead = wall time - useful work.
"""
from __future__ import annotations

import numpy as np

from coci_hpc.errors import PlannerError


def poisson_traces(rng: np.random.Generator, rate: float, partner_loss: float, work_s: float,
                   runs: int, factor: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    """Exponential incident times over ``factor * work_s`` (runs x max incidents, padded with
    inf) and which of them take a rank and its partner (probability ``partner_loss``)."""
    until = factor * work_s
    counts = rng.poisson(rate * until, runs)
    width = int(counts.max()) if runs else 0
    times = np.full((runs, width + 1), np.inf)
    for i, c in enumerate(counts):
        times[i, :c] = np.sort(rng.uniform(0.0, until, c))
    flags = rng.random(times.shape) < partner_loss
    return times, flags


def pad_traces(traces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """[(times, flags), ...] of different lengths -> the padded arrays :func:`simulate` takes."""
    width = max((t.size for t, _ in traces), default=0)
    times = np.full((len(traces), width + 1), np.inf)
    flags = np.zeros(times.shape, dtype=bool)
    for i, (t, f) in enumerate(traces):
        order = np.argsort(t, kind="stable")
        times[i, :t.size] = np.asarray(t, dtype=float)[order]
        flags[i, :t.size] = np.asarray(f, dtype=bool)[order]
    return times, flags


def simulate(mem_every_steps: int | None, disk_every_steps: int, costs, work_s: float,
             traces: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Overhead seconds of each run. ``mem_every_steps`` None: disk only. The disk interval is
    rounded to a multiple of the memory interval. ``costs``: a
    :class:`~coci_hpc.planner.two_tier.TierCosts`."""
    return simulate_many([(mem_every_steps, disk_every_steps)], costs, work_s, traces)[0]


def simulate_many(pairs, costs, work_s: float, traces: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """:func:`simulate` for several (memory, disk) step pairs at once: (pairs x runs)."""
    return simulate_detail(pairs, costs, work_s, traces)[0]


def simulate_detail(pairs, costs, work_s: float, traces: tuple[np.ndarray, np.ndarray]
                    ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`simulate_many` and, per (pair, run), the worst single failure: the most work one
    failure rolled back, in seconds of training (done since the checkpoint it went back to; the
    restart's own time is not counted)."""
    times, flags = traces
    st = costs.step_time_s
    cd, rm, rd = costs.disk_ckpt_s, costs.mem_restart_s, costs.disk_restart_s
    t_l, k_l, c_l, m_l = [], [], [], []
    for mem, disk in pairs:
        if disk < 1 or (mem is not None and mem < 1):
            raise PlannerError("checkpoint intervals must be >= 1 step")
        t_l.append((disk if mem is None else mem) * st)
        k_l.append(1 if mem is None else max(1, round(disk / mem)))
        c_l.append(0.0 if mem is None else costs.mem_ckpt_s)
        m_l.append(mem is not None)
    t_seg = np.asarray(t_l, dtype=float)[:, None]
    kk = np.asarray(k_l, dtype=np.int64)[:, None]
    cm = np.asarray(c_l, dtype=float)[:, None]
    no_mem = ~np.asarray(m_l, dtype=bool)[:, None]
    n = np.maximum(0, np.ceil(work_s / t_seg) - 1).astype(np.int64)   # checkpoints before the end
    shape = (len(t_l), times.shape[0])
    seg = t_seg + cm
    cyc = kk * seg + cd
    w = np.zeros(shape)                             # wall time computing resumes from i0
    i0 = np.zeros(shape, dtype=np.int64)
    done = np.zeros(shape, dtype=bool)
    wall = np.zeros(shape)
    worst = np.zeros(shape)

    def finish_at(w_, i_):
        return w_ + (work_s - i_ * t_seg) + (n - i_) * cm + cd * (n // kk - i_ // kk)

    for c in range(times.shape[1]):
        act = ~done
        if not act.any():
            break
        f = times[None, :, c]
        fin = finish_at(w, i0)
        end = act & (f >= fin)
        wall = np.where(end, fin, wall)
        done |= end
        live = act & ~end
        if not live.any():
            continue
        to_disk = flags[None, :, c] | no_mem
        # an incident during a restart: restart again (from disk when it is flagged)
        rst = live & (f < w)
        # an incident while computing or checkpointing: how many checkpoints completed since i0
        run = live & (f >= w)
        base = (i0 // kk) * kk
        h = np.where(run, f - w + (i0 - base) * seg, 0.0)
        q = np.floor(h / cyc)
        r = np.minimum(np.floor((h - q * cyc) / seg), kk - 1)
        j = np.clip(base + (q * kk + r).astype(np.int64), i0, n)
        sm = np.where(run, j, i0)                   # newest memory checkpoint
        sd = (sm // kk) * kk                        # newest disk checkpoint (every disk point is one)
        sel = rst | run
        # the work this failure rolls back: training done (whole segments up to the newest
        # checkpoint, then the time since it, less the stalls of the checkpoints passed) back to
        # the checkpoint restored; during a restart, what the restart was restoring beyond it
        stalls = (sm - i0) * cm + cd * (sm // kk - i0 // kk)
        done_s = np.minimum(np.minimum((sm + 1) * t_seg, work_s), i0 * t_seg + (f - w) - stalls)
        back = np.where(to_disk, sd, sm)
        lost = np.where(run, np.maximum(0.0, done_s - back * t_seg), (i0 - np.minimum(back, i0)) * t_seg)
        worst = np.where(sel, np.maximum(worst, lost), worst)
        i0 = np.where(sel, back, i0)
        w = np.where(sel, f + np.where(to_disk, rd, rm), w)
    wall = np.where(done, wall, finish_at(w, i0))
    return wall - work_s, worst
