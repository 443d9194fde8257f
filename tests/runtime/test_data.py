"""The resumable sampler: each sample once per epoch, across restarts and rank counts."""
from __future__ import annotations

import numpy as np
import pytest

from coci_hpc.errors import CheckpointError, UsageError
from coci_hpc.runtime.data import ResumableSampler


def test_each_sample_once_per_epoch_across_a_restart_mid_epoch():
    s = ResumableSampler(97, seed=4)
    seen = [s.next_batch(10) for _ in range(4)]
    saved = s.state_dict()
    resumed = ResumableSampler(97, seed=4)
    resumed.load_state_dict(saved)
    seen += [resumed.next_batch(10) for _ in range(5)]  # 9 batches = 90 of 97; tail of 7 dropped
    flat = np.concatenate(seen)
    assert len(set(flat.tolist())) == 90
    nxt = resumed.next_batch(10)
    assert resumed.epoch == 1 and len(set(nxt.tolist())) == 10
    # Same as never stopping, and a different order in the next epoch.
    ref = ResumableSampler(97, seed=4)
    assert np.array_equal(np.concatenate([ref.next_batch(10) for _ in range(9)]), flat)
    assert not np.array_equal(ref.permutation(0), ref.permutation(1))


def test_sharded_ranks_are_disjoint_and_reshard_continues_the_epoch():
    world = 2
    samplers = [ResumableSampler(60, seed=1, rank=r, world_size=world) for r in range(world)]
    first = [s.next_batch(5) for s in samplers] + [s.next_batch(5) for s in samplers]
    state = samplers[0].state_dict()
    assert state == samplers[1].state_dict()  # identical on all ranks: stored replicated
    three = [ResumableSampler(60, seed=1, rank=r, world_size=3) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    rest = [s.next_batch(5) for s in three] + [s.next_batch(5) for s in three]
    allidx = np.concatenate(first + rest).tolist()
    assert len(allidx) == 50 and len(set(allidx)) == 50


def test_iteration_covers_the_epoch_and_state_is_validated():
    s = ResumableSampler(10, seed=0, shuffle=False)
    assert list(s) == list(range(10)) and s.epoch == 1
    with pytest.raises(CheckpointError):
        ResumableSampler(11).load_state_dict(s.state_dict())
    with pytest.raises(UsageError):
        ResumableSampler(3, world_size=4)
