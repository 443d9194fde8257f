"""Round trip of every kind of state, bit-exact, on however many ranks run the test."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, PerRank, Sharded
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.integrity import seal
from coci_hpc.checkpoint.state import collect
from coci_hpc.checkpoint.treecode import unflatten
from coci_hpc.errors import CheckpointError, CheckpointNotFound, CommError, UsageError
from tests.checkpoint.helpers import canonical, empty_state, full_state, rng_draws, rows_of

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.mark.parametrize("backend", ["auto", "serial"])
def test_every_kind_of_state_round_trips_bit_exact(shared_dir, comm, backend):
    state = full_state(5, comm.rank, comm.size)
    expected = canonical(state)
    mgr = CheckpointManager(shared_dir, comm=comm, backend=backend)
    mgr.save(7, state)
    after_save = rng_draws()  # what a resumed run must draw next

    target = empty_state(comm.rank, comm.size)
    assert canonical(target) != expected
    res = mgr.load_latest(target)
    assert res.step == 7 and res.saved_world_size == comm.size and res.missing == ()
    assert rng_draws() == after_save
    assert canonical(target) == expected
    # Types survive JSON: tuples, int keys, inf, numpy arrays.
    ex = target["extras"]
    assert ex["pair"] == (1, (2.5, "x")) and ex["by_int"] == {3: "three", 10: [1, 2]}
    assert ex["inf"] == float("inf") and ex["arr"].dtype == np.int32
    assert target["mine"].value["rank"] == comm.rank
    m = cat.read_manifest(cat.step_dir(shared_dir, 7))
    assert m["world_size"] == comm.size
    assert m["backend"] == ("hdf5-serial" if backend == "serial" or comm.size == 1 and not comm.is_mpi
                            else m["backend"])
    mgr.close()


def test_replicated_bytes_are_split_across_ranks(shared_dir, comm):
    state = full_state(1, comm.rank, comm.size, big=1 << 18)
    mgr = CheckpointManager(shared_dir, comm=comm)
    mgr.save(1, state)
    m = cat.read_manifest(cat.step_dir(shared_dir, 1))
    per_rank = [0] * comm.size
    for s in m["shards"]:
        ds = next(t for t in m["tensors"] if t["dataset"] == s["dataset"])
        if ds["kind"] == "replicated":
            per_rank[s["rank"]] += s["stop"] - s["start"]
    total = sum(per_rank)
    assert total == sum(t["nbytes"] for t in m["tensors"] if t["kind"] == "replicated")
    assert all(abs(b - total / comm.size) <= 8192 for b in per_rank), per_rank
    # Each replicated dataset is stored once; a per-rank leaf is ONE dataset packing every rank's
    # part (file metadata grows with the leaves, not ranks x leaves), each rank writing its own.
    assert sum(1 for t in m["tensors"] if t["dataset"] == "replicated/model/fc1.weight") == 1
    rng = [t for t in m["tensors"] if t["name"] == "per_rank/__rng__/torch"]
    assert len(rng) == 1 and rng[0]["dataset"] == "per_rank/__rng__/torch" and rng[0]["rank"] is None
    assert [p[0] for p in rng[0]["parts"]] == list(range(comm.size))
    assert sorted(s["rank"] for s in m["shards"] if s["dataset"] == "per_rank/__rng__/torch") == \
        list(range(comm.size))


def test_no_pickle_in_checkpoint(shared_dir, comm):
    mgr = CheckpointManager(shared_dir, comm=comm)
    mgr.save(1, full_state(2, comm.rank, comm.size))
    comm.barrier()
    raw = (cat.step_dir(shared_dir, 1) / "data.h5").read_bytes()
    assert b"torch._utils" not in raw and b"\x80\x04\x95" not in raw  # no pickle protocol-4 frames
    json.loads((cat.step_dir(shared_dir, 1) / "manifest.json").read_text())
    comm.barrier()


def test_unserialisable_state_is_refused_with_a_hint(shared_dir, comm):
    mgr = CheckpointManager(shared_dir, comm=comm)
    with pytest.raises(CheckpointError, match="without pickle"):
        mgr.save(1, {"extras": {"f": object()}})
    assert mgr.latest_step() is None


def test_replicated_state_must_agree_across_ranks(shared_dir, comm):
    mgr = CheckpointManager(shared_dir, comm=comm)
    shape = (3 + comm.rank,) if comm.size > 1 else (3,)
    if comm.size == 1:
        mgr.save(1, {"w": {"x": torch.zeros(shape)}})
        return
    with pytest.raises(CheckpointError, match="differs between rank 0"):
        mgr.save(1, {"w": {"x": torch.zeros(shape)}})


def test_load_without_checkpoint_raises_not_found(shared_dir, comm):
    mgr = CheckpointManager(shared_dir, comm=comm)
    with pytest.raises((CheckpointNotFound, CommError)):
        mgr.load_latest({"x": {}})


def test_failure_on_one_rank_commits_nothing_and_names_the_rank(shared_dir, comm, monkeypatch):
    from coci_hpc.checkpoint.prepared import Prepared

    mgr = CheckpointManager(shared_dir, comm=comm)
    good = full_state(3, comm.rank, comm.size)
    mgr.save(1, good)
    bad_rank = comm.size - 1
    real = Prepared.items

    def failing(self, rank, arrays=None):
        if rank == bad_rank:
            raise OSError("disk on fire")
        return real(self, rank, arrays)

    monkeypatch.setattr(Prepared, "items", failing)
    with pytest.raises(CommError) as info:
        mgr.save(2, full_state(4, comm.rank, comm.size))
    assert set(info.value.failed_ranks) == {bad_rank}
    assert "disk on fire" in str(info.value)
    monkeypatch.setattr(Prepared, "items", real)
    assert mgr.latest_step() == 1
    target = empty_state(comm.rank, comm.size)
    mgr.load_latest(target)
    assert canonical(target["model"]) == canonical(good["model"])


def test_flatten_unflatten_keeps_types():
    skel, leaves = collect({"a": {"t": (1, [2, {"k": torch.ones(2)}]), 5: "int-key"}}, rng=False)
    tensors = {l.name: torch.from_numpy(l.array.copy()) for l in leaves}
    back = unflatten(skel["replicated"]["a"], tensors)
    assert back["t"][0] == 1 and isinstance(back["t"], tuple) and back[5] == "int-key"
    assert torch.equal(back["t"][1][1]["k"], torch.ones(2))
    assert [l.name for l in leaves] == ["replicated/a/t/1/1/k"]


def test_sharded_rows_reassemble(shared_dir, comm):
    g = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    rows = rows_of(comm.rank, comm.size)
    mgr = CheckpointManager(shared_dir, comm=comm)
    mgr.save(1, {"s": {"w": Sharded(g[rows.start:rows.stop].clone())}, "p": PerRank({"x": comm.rank})})
    tgt = Sharded(torch.zeros(len(rows), 3))
    mgr.load(1, {"s": {"w": tgt}})
    assert torch.equal(tgt.local, g[rows.start:rows.stop])


def test_load_into_a_state_of_other_shapes_or_dtypes_is_refused_and_changes_nothing(shared_dir, comm):
    mgr = CheckpointManager(shared_dir, comm=comm)
    torch.manual_seed(0)
    mgr.save(1, {"model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                 "w": torch.ones(1)})
    cases = [
        {"model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))},       # shape
        {"model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double()},  # dtype
        {"model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2),
                                      torch.nn.Linear(2, 2))},                               # keys
        {"w": torch.zeros(3)},                              # would broadcast [1] -> [3] silently
        {"w": torch.zeros(1, dtype=torch.float64)},         # would convert silently
    ]
    for target in cases:
        before = {k: {n: t.clone() for n, t in v.state_dict().items()} if isinstance(v, torch.nn.Module)
                  else v.clone() for k, v in target.items()}
        with pytest.raises(CheckpointError, match="does not match|in the state passed to load") as info:
            mgr.load(1, target)
        assert info.value.hint
        for k, v in target.items():
            if isinstance(v, torch.nn.Module):
                assert all(torch.equal(t, before[k][n]) for n, t in v.state_dict().items())
            else:
                assert torch.equal(v, before[k])


def test_negative_or_non_integer_step_is_refused(shared_dir, comm):
    mgr = CheckpointManager(shared_dir, comm=comm)
    for step in (-1, 2.5):
        with pytest.raises(UsageError, match="non-negative integer"):
            mgr.save(step, {"a": torch.ones(2)})
    assert cat.scan(shared_dir) == []


def test_keep_must_be_a_positive_integer(shared_dir, comm):
    for keep in (0, -1, 1.5, "2"):
        with pytest.raises(UsageError, match="keep="):
            CheckpointManager(shared_dir, comm=comm, keep=keep)


def test_a_manifest_cannot_smuggle_objects_into_the_state(shared_dir, comm):
    mgr = CheckpointManager(shared_dir, comm=comm)
    mgr.save(1, {"x": {"dt": torch.float32, "a": np.zeros(4)}})
    comm.barrier()
    if comm.rank == 0:
        path = cat.step_dir(shared_dir, 1) / mf.MANIFEST
        m = json.loads(path.read_text())
        m["skeletons"]["replicated"]["x"]["dt"] = {"__torch_dtype__": "torch.load"}
        path.write_text(json.dumps(seal(m)))  # a crafted manifest, not damage: checksum redone
    comm.barrier()
    with pytest.raises((CheckpointError, CommError), match="where a torch dtype belongs"):
        mgr.load(1, {"x": {}})
    # Raw bytes are never read into an object (pointer) array: only numeric dtypes load.
    from coci_hpc.checkpoint.leaves import storage_dtype
    for bad in ("numpy.object", "numpy.void", "numpy.str_", "numpy.nonsense"):
        with pytest.raises(CheckpointError, match="unsupported tensor dtype"):
            storage_dtype(bad)


def test_a_step_that_succeeds_everywhere_is_agreed_without_an_allgather(comm, monkeypatch):
    """Every collective step of a save ends in Comm.check: with N ranks an allgather of N empty
    messages handed every rank O(N) bytes; on success one 8-byte allreduce is enough, and a
    failure still names the rank that failed."""
    calls: list[object] = []
    real = type(comm).allgather
    monkeypatch.setattr(type(comm), "allgather", lambda self, obj: (calls.append(obj), real(self, obj))[1])
    assert comm.run_step(lambda: 5, "a step that works") == 5
    assert calls == ([] if comm.size > 1 else [None])
    bad = comm.size - 1

    def fail() -> int:
        if comm.rank == bad:
            raise OSError("disk on fire")
        return 1

    with pytest.raises(CommError) as info:
        comm.run_step(fail, "a step that fails on one rank")
    assert set(info.value.failed_ranks) == {bad} and "disk on fire" in str(info.value)
