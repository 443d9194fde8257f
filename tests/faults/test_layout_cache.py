"""The layout cache (plan once, on the coordinator) must be invalidated whenever the state's shape
changes, and never write a wrong layout. Runs under mpiexec -n 1 and -n 2 (`mpi` marker).

Each case saves a state twice unchanged (the second save reuses the cached layout), then changes
the state in one way, saves, and loads every step back bit-exact into states of the matching
shapes; the manifest must describe the new shapes.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, PerRank, Sharded, commit
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint.layout import Piece, RankLayout

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

CHANGES = ["tensor_shape", "reshape_same_bytes", "dtype_same_bytes", "one_ranks_per_rank_size",
           "sharded_rows_move", "leaf_added", "leaf_renamed", "leaves_reordered"]


def make_state(rank: int, world: int, seed: int, change: str | None = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w_shape, w_dtype = (4, 3), torch.float32
    mine_len = 2 + rank
    rows = [3] * world
    if change == "tensor_shape":
        w_shape = (5, 3)
    elif change == "reshape_same_bytes":
        w_shape = (3, 4)
    elif change == "dtype_same_bytes":
        w_dtype = torch.int32
    elif change == "one_ranks_per_rank_size" and rank == world - 1:
        mine_len = 7
    elif change == "sharded_rows_move":
        # rank 0 gains a row the last rank loses (one rank alone: it gains one)
        rows = [3 + (r == 0) - (r == world - 1 and world > 1) for r in range(world)]
    w = (torch.randn(w_shape, generator=g) * 100).to(w_dtype)
    total = sum(rows)
    glob = torch.randn(total, 2, generator=g, dtype=torch.float64)
    lo = sum(rows[:rank])
    state: dict[str, Any] = {
        "model": {"w": w, "b": torch.randn(6, generator=g)},
        "mine": PerRank({"x": torch.arange(mine_len, dtype=torch.int64) + 100 * rank + seed}),
        "rows": Sharded(glob[lo:lo + rows[rank]].clone()),
    }
    if change == "leaf_added":
        state["model"]["extra"] = torch.ones(2, 2)
    elif change == "leaf_renamed":  # same bytes, same shapes, another name
        state["model"] = {"w": state["model"]["w"], "bias": state["model"]["b"]}
    elif change == "leaves_reordered":  # same leaves, another order of the datasets
        state["model"] = {"b": state["model"]["b"], "w": state["model"]["w"]}
    return state


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a["model"]:
        assert a["model"][k].dtype == b["model"][k].dtype and torch.equal(a["model"][k], b["model"][k]), k
    assert torch.equal(a["mine"].value["x"], b["mine"].value["x"])
    assert torch.equal(a["rows"].local, b["rows"].local)


def blank(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "mine": PerRank({"x": torch.zeros_like(state["mine"].value["x"])}),
            "rows": Sharded(torch.zeros_like(state["rows"].local))}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_state_is_planned_again_and_loads_back(shared_dir, comm, change, mode):
    mgr = CheckpointManager(shared_dir, comm=comm, rng=False, keep=5)
    save = mgr.save if mode == "sync" else (lambda s, st: (mgr.save_async(s, st), mgr.wait()))
    before = make_state(comm.rank, comm.size, 1)
    save(1, before)
    assert mgr._layouts.last["source"] == "planned"
    save(2, before)
    assert mgr._layouts.last["source"] == "cached"
    after = make_state(comm.rank, comm.size, 3, change)
    save(3, after)
    assert mgr._layouts.last["source"] == "planned"   # every rank re-planned, not only the changed one
    save(4, after)
    assert mgr._layouts.last["source"] == "cached"

    m = cat.read_manifest(cat.step_dir(shared_dir, 4))
    w = next(t for t in m["tensors"] if t["name"] == "replicated/model/w")
    assert tuple(w["shape"]) == tuple(after["model"]["w"].shape) and w["dtype"] == str(after["model"]["w"].dtype)
    x = next(t for t in m["tensors"] if t["name"] == "per_rank/mine/x")
    sizes = comm.allgather(after["mine"].value["x"].numel())
    assert [p[2] for p in x["parts"]] == [[n] for n in sizes]
    for step, expected in ((2, before), (4, after)):
        target = blank(expected)
        mgr.load(step, target)
        assert_same(target, expected)
    mgr.close()


def test_a_cache_that_does_not_fit_the_leaves_is_not_used(shared_dir, comm):
    """Even a cache made for the same leaves is not trusted once its pieces changed after they
    were made or checked (a bug, memory damage): pieces reaching past a leaf make every rank
    plan again instead of writing them."""
    mgr = CheckpointManager(shared_dir, comm=comm, rng=False)
    state = make_state(comm.rank, comm.size, 1)
    mgr.save(1, state)
    cache = mgr._layouts
    assert cache.mine is not None
    if comm.rank == comm.size - 1:
        bad = [Piece(p.dataset, p.rank, p.start, p.stop + 64, p.leaf, p.src_start) for p in cache.mine.pieces]
        cache.mine = RankLayout(tuple(bad))
    mgr.save(2, state)
    assert cache.last["source"] == "planned"
    target = blank(state)
    mgr.load(2, target)
    assert_same(target, state)
    mgr.close()


def test_a_requeued_job_reuses_the_last_manifests_layout_only_if_it_fits(shared_dir, comm):
    state = make_state(comm.rank, comm.size, 1)
    with CheckpointManager(shared_dir, comm=comm, rng=False, keep=5) as mgr:
        mgr.save(1, state)
    with CheckpointManager(shared_dir, comm=comm, rng=False, keep=5) as mgr:  # the requeued job
        mgr.save(2, state)
        assert mgr._layouts.last["source"] == "manifest"
        mgr.save(3, state)
        assert mgr._layouts.last["source"] == "cached"
        target = blank(state)
        mgr.load(3, target)
        assert_same(target, state)
    changed = make_state(comm.rank, comm.size, 2, "one_ranks_per_rank_size")
    with CheckpointManager(shared_dir, comm=comm, rng=False, keep=5) as mgr:
        mgr.save(4, changed)
        assert mgr._layouts.last["source"] == "planned"
        target = blank(changed)
        mgr.load(4, target)
        assert_same(target, changed)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_commit_sends_a_ranks_skeleton_only_when_it_changed(shared_dir, comm, mode, monkeypatch):
    """Rank 0 reuses the per-rank skeleton it has while a rank's is unchanged (1, 1.0 and True
    count as changes), and every manifest holds each rank's skeleton of that very save."""
    mgr = CheckpointManager(shared_dir, comm=comm, rng=False, keep=10)
    sent: list[Any] = []
    message_of = commit.commit_message  # what each rank sends rank 0 (sync: gather; async: igather)

    def spy(prepared, crcs):  # type: ignore[no-untyped-def]
        message, blob = message_of(prepared, crcs)
        sent.append(message["per_rank"])
        return message, blob

    monkeypatch.setattr(commit, "commit_message", spy)
    last = comm.rank == comm.size - 1
    values = [1, 1, True, 1.0, 1.0, "one", 2]
    for step, v in enumerate(values, 1):
        state = make_state(comm.rank, comm.size, 1)
        state["mine"] = PerRank({"x": state["mine"].value["x"], "pos": v if last else 7})
        if mode == "sync":
            mgr.save(step, state)
        else:
            mgr.save_async(step, state)
            mgr.wait()
    mgr.close()
    unchanged = [s is None for s in sent]
    if last:
        assert unchanged == [False, True, False, False, True, False, False]
    else:
        assert unchanged == [False] + [True] * (len(values) - 1)
    for step, v in enumerate(values, 1):
        skel = cat.read_manifest(cat.step_dir(shared_dir, step))["skeletons"]["per_rank"]
        assert sorted(skel) == [str(r) for r in range(comm.size)]
        got = skel[str(comm.size - 1)]["mine"]["pos"]
        assert type(got) is type(v) and got == v, (step, got, v)
        assert all(skel[str(r)]["mine"]["pos"] == 7 for r in range(comm.size - 1))


def test_a_cached_save_builds_no_leaf_descriptions(shared_dir, comm, monkeypatch):
    """A save of an unchanged state compares its leaves' rows (built in C) with the cached ones;
    only a changed state builds descriptions, and a changed state is always noticed."""
    from coci_hpc.checkpoint import coordinator
    from coci_hpc.checkpoint.layout import describe, leaf_rows

    calls = []

    def counting(leaves):  # type: ignore[no-untyped-def]
        calls.append(len(leaves))
        return describe(leaves)

    monkeypatch.setattr(coordinator, "describe", counting)
    mgr = CheckpointManager(shared_dir, comm=comm, rng=False, keep=5)
    mgr.save(1, make_state(comm.rank, comm.size, 1))
    assert len(calls) == 1 and mgr._layouts.last["source"] == "planned"
    mgr.save(2, make_state(comm.rank, comm.size, 2))
    assert len(calls) == 1 and mgr._layouts.last["source"] == "cached"
    mgr.save(3, make_state(comm.rank, comm.size, 3, "reshape_same_bytes"))
    assert len(calls) == 2 and mgr._layouts.last["source"] == "planned"
    mgr.close()
    from coci_hpc.checkpoint.state import collect

    _, leaves = collect(make_state(comm.rank, comm.size, 1), rng=False)
    assert leaf_rows(leaves) == tuple(describe(leaves)) and all(type(r) is tuple for r in leaf_rows(leaves))
