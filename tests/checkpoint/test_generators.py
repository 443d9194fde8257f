"""Random number generator objects in the state (a sampler's torch.Generator, an augmentation's
numpy Generator, ...): saved and loaded like stateful objects, the same numbers drawn after a
load as after the save; another kind is refused and changes nothing (rng.GeneratorState)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, PerRank
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError

MAKERS = {
    "torch": lambda seed: torch.Generator().manual_seed(seed),
    "numpy_pcg64": lambda seed: np.random.default_rng(seed),
    "numpy_mt19937": lambda seed: np.random.Generator(np.random.MT19937(seed)),
    "numpy_philox": lambda seed: np.random.Generator(np.random.Philox(seed)),
    "numpy_randomstate": lambda seed: np.random.RandomState(seed),
    "python": lambda seed: random.Random(seed),
}


def draw(gen, n: int = 5) -> list[float]:
    if isinstance(gen, torch.Generator):
        return torch.rand(n, generator=gen).tolist()
    if isinstance(gen, np.random.RandomState):
        return gen.random_sample(n).tolist()
    if isinstance(gen, np.random.Generator):
        return gen.random(n).tolist()
    return [gen.random() for _ in range(n)]


@pytest.mark.parametrize("per_rank", [False, True])
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_a_generator_draws_after_a_load_what_it_drew_after_the_save(tmp_path, kind, per_rank):
    gen = MAKERS[kind](1)
    draw(gen, 7)  # not at its seed
    if kind == "numpy_randomstate":
        gen.standard_normal()  # RandomState keeps a cached Gaussian: part of its state
    wrap = PerRank if per_rank else (lambda v: v)
    with CheckpointManager(tmp_path) as cm:
        cm.save(1, {"model": torch.nn.Linear(2, 2), "gen": wrap(gen)})
        expected = draw(gen, 9)
        other = MAKERS[kind](99)
        cm.load(1, {"model": torch.nn.Linear(2, 2), "gen": wrap(other)})
        assert draw(other, 9) == expected
        assert draw(other, 3) == draw(gen, 3)


def test_async_saves_keep_the_generator_as_it_was_at_the_call(tmp_path):
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(tmp_path) as cm:
        assert cm.save_async(1, {"model": model, "gen": gen}) == "started"
        expected = draw(gen)
        cm.wait()
        other = torch.Generator().manual_seed(5)
        cm.load(1, {"model": torch.nn.Linear(2, 2), "gen": other})
        assert draw(other) == expected


@pytest.mark.parametrize("saved,loading", [("numpy_pcg64", "numpy_mt19937"), ("numpy_pcg64", "torch"),
                                           ("python", "numpy_randomstate")])
def test_another_kind_of_generator_is_refused_and_nothing_changes(tmp_path, saved, loading):
    with CheckpointManager(tmp_path) as cm:
        cm.save(1, {"model": torch.nn.Linear(2, 2), "gen": MAKERS[saved](1)})
        target, twin = MAKERS[loading](7), MAKERS[loading](7)
        model = torch.nn.Linear(2, 2)
        weight = model.weight.detach().clone()
        with pytest.raises(CheckpointError):
            cm.load(1, {"model": model, "gen": target})
        assert draw(target) == draw(twin)   # the generator as it was
        assert torch.equal(model.weight, weight)   # and nothing else touched


def test_a_system_random_is_still_refused_with_a_clear_error(tmp_path):
    with CheckpointManager(tmp_path) as cm, pytest.raises(CheckpointError, match="SystemRandom"):
        cm.save(1, {"gen": random.SystemRandom()})


@pytest.mark.mpi
def test_a_generator_seeded_by_rank_is_refused_outside_per_rank_and_kept_per_rank_inside(tmp_path_factory):
    # numpy's default generator (PCG64) keeps its state in two integers, no array: its digest
    # is what the first save's cross-rank check compares
    comm = Comm.world()
    base = comm.bcast(str(tmp_path_factory.mktemp("gens")) if comm.rank == 0 else None)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(base, comm=comm) as cm:
        if comm.size > 1:
            with pytest.raises(CheckpointError, match="gen/digest") as info:
                cm.save(1, {"model": model, "gen": np.random.default_rng(comm.rank)})
            assert "PerRank" in (info.value.hint or "")
            assert cm.latest_step() is None
        cm.save(2, {"model": model, "gen": PerRank(np.random.default_rng(comm.rank)),
                    "shared": np.random.default_rng(42)})
        mine, shared = np.random.default_rng(1000), np.random.default_rng(7)
        cm.load(2, {"model": model, "gen": PerRank(mine), "shared": shared})
        assert mine.random() == np.random.default_rng(comm.rank).random()
        assert shared.random() == np.random.default_rng(42).random()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_generator_draws_after_a_load_what_it_drew_after_the_save(tmp_path):
    gen = torch.Generator(device="cuda").manual_seed(1)
    torch.rand(7, generator=gen, device="cuda")
    with CheckpointManager(tmp_path) as cm:
        cm.save(1, {"gen": gen})
        expected = torch.rand(9, generator=gen, device="cuda").tolist()
        other = torch.Generator(device="cuda").manual_seed(99)
        cm.load(1, {"gen": other})
        assert torch.rand(9, generator=other, device="cuda").tolist() == expected
        with pytest.raises(CheckpointError):   # a CPU generator's state is another size
            cm.load(1, {"gen": torch.Generator()})
