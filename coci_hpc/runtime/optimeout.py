"""Bounds torch.distributed's per-operation timeout by the session's peer deadline (gloo only).

A host that dies or drops off the network sends nothing: its peers' TCP connections stay open and
silent, so a survivor waiting inside the user's collective (DDP's gradient allreduce in
``loss.backward()``) gets no reset and waits for gloo's timeout, ``COCI_DIST_TIMEOUT_S`` (120 s),
past Slurm's kill window on a site whose SlurmdTimeout is shorter, and always far longer than the
step agreement's deadline (measured on the local cluster, ``fail --hard --freeze``: docs/explanation/survivors.md,
"When a host goes silent"). Once this attempt's typical step is known, every later gloo operation
waits at most ``FACTOR`` x the step agreement's deadline (max(5 s, 10 typical steps)); a peer
silent that long raises gloo's "Timed out waiting" inside the step, which the session handles as
a reset (it probes the peers, then saves from the survivors).

Twice the agreement's deadline, not once: the agreement is pipelined, so it waits one step plus its
deadline, while a gloo operation starts inside the step. A slow but live peer (a step 10x the
typical one) stays inside the bound; a run with long irregular pauses inside the loop (an
evaluation on one rank while the others wait in a collective) raises ``COCI_PEER_TIMEOUT_S``,
which moves both bounds. NCCL is left alone: its watchdog ends the process at a timeout instead of
raising, which would kill the survivor too. At the end of the loop the original timeout comes back.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

FACTOR = 2.0         # the gloo bound, in step-agreement deadlines
WARMUP_STEPS = 3     # steps of this attempt timed before the bound applies (the first ones are slow)
RESET_RATIO = 1.2    # re-set the timeout only when the bound moved this much (a call costs ~us, but why)


def _gloo_backend() -> Any:
    """The default group's gloo backend, or None (no torch.distributed, another backend, one rank)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:                     # pragma: no cover - torch is a dependency
        return None
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    if dist.get_backend() != "gloo":
        return None
    world = dist.group.WORLD
    if world is None:
        return None
    backend = world._get_backend(torch.device("cpu"))
    return backend if isinstance(backend, dist.ProcessGroupGloo) else None


class OpTimeout:
    """Call :meth:`observe` at every step boundary with the step agreement's deadline and
    :meth:`restore` when the loop ends."""

    def __init__(self, backend: Any = None, factor: float = FACTOR, warmup: int = WARMUP_STEPS) -> None:
        self._backend = backend if backend is not None else _gloo_backend()
        self.factor = factor
        self.warmup = warmup
        self.original_s: float | None = (self._backend.options._timeout.total_seconds()
                                          if self._backend is not None else None)
        self.bound_s: float | None = None    # what gloo waits now, when bounded
        self._seen = 0

    @property
    def active(self) -> bool:
        return self._backend is not None

    def observe(self, deadline_s: float) -> None:
        if self._backend is None:
            return
        self._seen += 1
        if self._seen < self.warmup:
            return
        assert self.original_s is not None
        want = min(self.original_s, self.factor * deadline_s)   # never longer than the user asked
        if self.bound_s is not None and want <= self.bound_s * RESET_RATIO and want >= self.bound_s / RESET_RATIO:
            return
        self._set(want)
        self.bound_s = want

    def restore(self) -> None:
        if self._backend is not None and self.bound_s is not None and self.original_s is not None:
            self._set(self.original_s)
            self.bound_s = None

    def _set(self, seconds: float) -> None:
        # torch's _set_pg_timeout(group) does the same for every backend of the group; calling the
        # gloo backend's own setter keeps NCCL (see above) out of it.
        self._backend._set_default_timeout(timedelta(seconds=seconds))
