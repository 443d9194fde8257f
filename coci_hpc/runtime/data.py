"""Data loading that resumes where it stopped: :class:`ResumableSampler`, and which loaders the
Session accepts as state (:func:`session_state`).

A DataLoader with workers runs ahead of the training loop: its workers have prefetched batches
the loop never consumed. Only a loader that counts what the loop consumed can resume at the right
batch: torchdata's ``StatefulDataLoader`` (its state is ints, bools, None and the sampler's
generator as a uint8 tensor: stored without pickle), or a :class:`ResumableSampler` the loop draws
indices from itself. A plain ``torch.utils.data.DataLoader`` has no state: in the Session's state
it is refused with that hint. A ``StatefulDataLoader`` is saved per rank (its worker seed and
position belong to that rank's loader).

ResumableSampler, a rank-sharded sampler: every sample once per epoch, across restarts.

The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` only, so it does not depend on
the global RNG or on how many times the job restarted. The state is the global position ``g``
in that permutation (items consumed by all ranks together); rank ``r`` of ``W`` takes
``perm[g + r]`` and the position advances by ``W`` per item, so ranks stay in lockstep and the
state is identical on every rank (it is saved as replicated state). Because the state is a
global position, it can be resumed on a different number of ranks.

Each epoch ends when fewer than ``W`` items remain (at most ``W - 1`` items of an epoch are
skipped, like ``DistributedSampler(drop_last=True)``; none when ``W == 1``); ``next_batch``
also starts a new epoch when fewer than ``batch_size`` items per rank remain.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from coci_hpc.checkpoint.leaves import PerRank
from coci_hpc.errors import CheckpointError, UsageError

LOADER_HINT = ("use torchdata's StatefulDataLoader (pip install torchdata; `from torchdata.stateful_dataloader "
               "import StatefulDataLoader`, a drop-in replacement that resumes at the batch the loop consumed), "
               "or draw indices from a coci_hpc.runtime.data.ResumableSampler kept in the state instead")


def is_stateful_dataloader(obj: Any) -> bool:
    """torchdata's StatefulDataLoader (or a subclass), without importing torchdata."""
    return any(c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata.")
               for c in type(obj).__mro__)


def _is_plain_dataloader(obj: Any) -> bool:
    return any(c.__name__ == "DataLoader" and c.__module__ == "torch.utils.data.dataloader"
               for c in type(obj).__mro__) and not callable(getattr(obj, "state_dict", None))


def session_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The user's state as the Session saves it: a StatefulDataLoader becomes per-rank state; a
    plain DataLoader is refused (it cannot say which batch the loop consumed)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        inner = value.value if isinstance(value, PerRank) else value
        if _is_plain_dataloader(inner):
            raise UsageError(f"state {key!r} is a torch DataLoader, which has no state to resume from: "
                             f"after a restart it would start its epoch again (and with workers, its "
                             f"prefetched batches were never trained on)", hint=LOADER_HINT)
        out[key] = PerRank(value) if is_stateful_dataloader(value) else value
    return out


class ResumableSampler:
    def __init__(self, n: int, *, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1) -> None:
        if n <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise UsageError(f"bad sampler arguments n={n}, rank={rank}, world_size={world_size}",
                             hint="n > 0 and 0 <= rank < world_size")
        if n < world_size:
            raise UsageError(f"{n} samples cannot be split over {world_size} ranks",
                             hint="use at least one sample per rank")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.position = 0
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            else:
                self._perm = np.arange(self.n)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def remaining(self) -> int:
        """Items this epoch still has for every rank (full rounds of W)."""
        return max(0, (self.n - self.position) // self.world_size)

    def next_batch(self, batch_size: int) -> np.ndarray:
        """This rank's next ``batch_size`` indices (starting a new epoch if too few remain)."""
        if batch_size * self.world_size > self.n:
            raise UsageError(f"batch_size {batch_size} x {self.world_size} ranks exceeds {self.n} samples",
                             hint="use a smaller batch")
        if self.remaining() < batch_size:
            self.epoch += 1
            self.position = 0
        perm = self.permutation(self.epoch)
        start = self.position + self.rank
        idx = perm[start:start + batch_size * self.world_size:self.world_size]
        self.position += batch_size * self.world_size
        return idx.copy()

    def __iter__(self) -> Iterator[int]:
        """Sample-wise iteration over the rest of the current epoch, then move to the next."""
        while self.remaining() > 0:
            i = int(self.permutation(self.epoch)[self.position + self.rank])
            self.position += self.world_size
            yield i
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return self.remaining()

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch,
                "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["n"]) != self.n or bool(state["shuffle"]) != self.shuffle:
            raise CheckpointError(
                f"sampler state is for n={state['n']} shuffle={state['shuffle']}, this sampler has "
                f"n={self.n} shuffle={self.shuffle}", hint="resume with the same data set")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def check_saveable(state: Mapping[str, Any]) -> list[Any]:
    """Refuse at Session() what the store could not save (a lock, a file, an arbitrary object: it
    would fail at the first checkpoint, maybe an hour later). Flattening takes views, no copies.
    Collective where a ``state_dict()`` is: every rank calls it here. Returns the leaves."""
    from coci_hpc.checkpoint.state import collect

    try:
        return collect(state, rng=False, defer_device=True)[1]
    except CheckpointError as exc:
        raise UsageError(f"this state cannot be checkpointed: {exc.message}",
                         hint=exc.hint or "keep tensors, numpy arrays, JSON values and objects with "
                                          "state_dict()/load_state_dict() in the state") from exc
