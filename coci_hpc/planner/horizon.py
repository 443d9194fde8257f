"""The finite-horizon end game: how many equal chunks to cut the remaining work into.

Bougeret et al., "Checkpointing strategies for parallel jobs" (SC'11): with exponential failures
of rate lambda, work W, checkpoint cost C, the optimal strategy cuts W into K* equal chunks,
K* = floor or ceil of K0 = lambda*W / (1 + LambertW(-exp(-lambda*C - 1))), whichever has the
smaller expected makespan  K * e^{lambda R} (1/lambda + D) (e^{lambda (W/K + C)} - 1).

Their model ends every chunk with a checkpoint; a training job needs none after its last chunk
(it ends; the runtime saves the final state anyway). :func:`chunks` therefore compares K*-2 ..
K*+2 under that model (K chunks, K-1 checkpoints), exactly for exponential failures, restarts
included: E(K) = e^{lambda R}/lambda * [(K-1)(e^{lambda (W/K + C)} - 1) + e^{lambda W/K} - 1].
"""
from __future__ import annotations

import math


def bougeret_k0(rate: float, work_s: float, ckpt_s: float) -> float:
    """The real-valued optimum K0 = lambda*W / (1 + W0(-exp(-lambda*C - 1)))."""
    from scipy.special import lambertw  # not at import: a training rank's start pays for it
    w = lambertw(-math.exp(-rate * ckpt_s - 1.0), 0).real
    return rate * work_s / (1.0 + w)


def bougeret_makespan(k: int, rate: float, work_s: float, ckpt_s: float, restart_s: float = 0.0,
                      downtime_s: float = 0.0) -> float:
    """Expected makespan of K equal chunks, each followed by a checkpoint (Bougeret's model)."""
    return k * math.exp(rate * restart_s) * (1.0 / rate + downtime_s) * math.expm1(
        rate * (work_s / k + ckpt_s))


def bougeret_k(rate: float, work_s: float, ckpt_s: float, restart_s: float = 0.0) -> int:
    """K* per Bougeret et al.: floor or ceil of K0, whichever has the smaller makespan (>= 1)."""
    k0 = bougeret_k0(rate, work_s, ckpt_s)
    cands = {max(1, math.floor(k0)), max(1, math.ceil(k0))}
    return min(cands, key=lambda k: (bougeret_makespan(k, rate, work_s, ckpt_s, restart_s), k))


def makespan_no_final(k: int, rate: float, work_s: float, ckpt_s: float,
                      restart_s: float = 0.0) -> float:
    """Expected wall time of K equal chunks with a checkpoint after each but the last."""
    x = work_s / k
    return math.exp(rate * restart_s) / rate * (
        (k - 1) * math.expm1(rate * (x + ckpt_s)) + math.expm1(rate * x))


def chunks(rate: float, work_s: float, ckpt_s: float, restart_s: float = 0.0,
           min_chunk_s: float = 0.0) -> int:
    """How many equal chunks to cut ``work_s`` into (no checkpoint after the last), no chunk
    shorter than ``min_chunk_s`` (an asynchronous save must finish persisting first)."""
    k0 = bougeret_k(rate, work_s, ckpt_s, restart_s)
    kmax = max(1, int(work_s // min_chunk_s)) if min_chunk_s > 0 else None
    cands = [k for k in range(max(1, k0 - 2), k0 + 3) if kmax is None or k <= kmax]
    if not cands:  # every candidate is above kmax, so kmax is set
        assert kmax is not None
        cands = [kmax]
    return min(cands, key=lambda k: (makespan_no_final(k, rate, work_s, ckpt_s, restart_s), k))
