"""The load's I/O pieces (issue 15, restore at disk speed): how the checked bytes are copied, how
many threads copy, that the file's mapping is built once and torn down off the load's path, and
that finding libc spawns no process."""
from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager, h5read, rawio
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.checkpoint.h5read import DatasetReader
from tests.checkpoint.helpers import canonical, full_state


def _saved(tmp_path: Path) -> tuple[Path, dict]:
    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(1, full_state(1, big=300_001))
    mgr.close()
    d = cat.step_dir(tmp_path, 1)
    return d / mf.DATA_FILE, cat.read_manifest(d)


def _all_keys(reader: DatasetReader, m: dict) -> set:
    return reader.shards_of([(t, 0, t["nbytes"]) for t in m["tensors"]])


def flip_last_moment_byte(root: Path, step: int, min_nbytes: int = 0) -> None:
    """Flip one bit near the end of the Adam moment (``exp_avg*``, at least ``min_nbytes``) that
    lies last in the step's data file: the last bytes a load's check reads."""
    d = cat.step_dir(root, step)
    last = max((t for t in cat.read_manifest(d)["tensors"] if "exp_avg" in t["name"] and t["nbytes"] >= min_nbytes),
               key=lambda t: t["offset"])
    with open(d / mf.DATA_FILE, "r+b") as f:
        f.seek(last["offset"] + last["nbytes"] - 3)
        b = f.read(1)
        f.seek(last["offset"] + last["nbytes"] - 3)
        f.write(bytes([b[0] ^ 0x01]))


def test_libc_is_found_without_running_ldconfig(monkeypatch):
    """`ctypes.util.find_library` runs `ldconfig -p` in a subprocess (about 70 ms here, paid by
    the first load of every restarted job): the process's own symbols are used instead."""
    def no_ldconfig(name):
        raise AssertionError("find_library ran ldconfig")

    monkeypatch.setattr(ctypes.util, "find_library", no_ldconfig)
    monkeypatch.setattr(rawio, "_libc", None)
    assert rawio._madvise() is not None


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_copies_split_over_threads_give_the_same_bytes(tmp_path, monkeypatch, threads):
    """copy_verified splits the bytes of all pieces evenly over the threads (cutting pieces at
    any byte): every split gives exactly the file's bytes."""
    monkeypatch.setattr(h5read, "_MIN_COPY_SHARE", 1000)  # small pieces still split
    path, m = _saved(tmp_path)
    with DatasetReader(path, m) as r:
        r.verify(_all_keys(r, m))
        pieces, want = [], []
        for t in m["tensors"]:
            dest = np.zeros(t["nbytes"], dtype=np.uint8)
            piece = r.plan_verified(t, dest)
            if piece is not None:
                pieces.append(piece)
                want.append((dest, r.read_bytes(t, 0, t["nbytes"])))
        r.copy_verified(pieces, threads)
    assert sum(d.nbytes for d, _ in pieces) > 4 * 300_001
    for dest, ref in want:
        assert np.array_equal(dest, ref)


def test_plan_refuses_bytes_no_checked_shard_covers(tmp_path):
    """Nothing is copied from a dataset whose shards were not checked."""
    from coci_hpc.errors import CheckpointCorrupt

    path, m = _saved(tmp_path)
    t = next(t for t in m["tensors"] if t["nbytes"] > 1000)
    with DatasetReader(path, m) as r, pytest.raises(CheckpointCorrupt, match="not all covered"):
        r.plan_verified(t, np.zeros(t["nbytes"], dtype=np.uint8))


def test_copy_threads_follow_the_cores_a_rank_may_use(monkeypatch):
    """A rank bound to one core (Open MPI's default for 1 or 2 ranks) copies in one thread;
    ranks that may run on the same cores share them."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert rawio.copy_threads(1) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert rawio.copy_threads(1) == rawio.MAX_COPY_THREADS
    assert rawio.copy_threads(4) == 4
    assert rawio.copy_threads(64) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert rawio.copy_threads(1) == 4  # bound to 4 cores of its own
    assert rawio.copy_threads(2) == 2  # 4 cores another rank of the node may run on too


@pytest.mark.mpi
def test_ranks_of_a_node_count_who_shares_their_cores():
    """Under mpiexec (Open MPI binds each of 1 or 2 ranks to its own core here) no other rank
    shares a rank's core; each rank knows the node's ranks."""
    from coci_hpc.checkpoint.load import _node_ranks
    from coci_hpc.comm import Comm

    comm = Comm.world()
    node, sharing = _node_ranks(comm)
    assert node == list(range(comm.size))  # one node here
    cores = comm.allgather(sorted(os.sched_getaffinity(0)))
    overlap = sum(1 for c in cores if set(c) & os.sched_getaffinity(0))
    assert sharing == overlap >= 1


def test_a_populated_range_is_not_walked_again(tmp_path, monkeypatch):
    """The copies after the check map ranges the check mapped already: no second
    MADV_POPULATE_READ walk over them (its page tables cost about 25 ms per GB here)."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        fm = rawio.FileMap.open(fd, 3 << 20)
        assert fm is not None
        calls = []
        madvise = rawio._madvise()
        monkeypatch.setattr(rawio, "_madvise", lambda: lambda a, n, how: calls.append(n) or madvise(a, n, how))
        fm.populate(0, 1 << 20)
        fm.populate(1 << 20, 1 << 20)      # touches the first: merged into [0, 2 MB)
        assert len(calls) == 2
        fm.view(4096, (2 << 20) - 8192)    # inside what is mapped: no call
        fm.populate(0, 2 << 20)
        assert len(calls) == 2
        fm.view(1 << 20, 2 << 20)          # reaches past it: populated
        assert len(calls) == 3
        assert bytes(fm.view(0, 3 << 20)) == path.read_bytes()
        assert len(calls) == 3
        fm.close()
    finally:
        os.close(fd)


def _maps_of(path: Path) -> int:
    with open("/proc/self/maps") as f:
        return sum(str(path) in line for line in f)


def test_a_load_unmaps_the_file_off_its_own_path(tmp_path):
    """The load returns before the data file is unmapped (tearing down the page tables of a
    large mapping takes 10-70 ms here); the helper thread unmaps it right after."""
    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(1, full_state(1, big=300_001))
    target = full_state(5, big=300_001)
    mgr.load(1, target)
    assert canonical(target) == canonical(full_state(1, big=300_001))
    rawio.load_helper().submit(lambda: None).result()  # the unmap queued before this ran
    assert _maps_of(cat.step_dir(tmp_path, 1) / mf.DATA_FILE) == 0
    mgr.close()


def test_the_streamed_check_maps_everything_before_the_first_copy(tmp_path, monkeypatch):
    """A streamed pass 1 (``PASS1_MAPPED`` off) reads the bytes through two reused buffers,
    then maps them (a read error or a file cut short surfaces there, before any byte goes into
    the state): by the time the copies start, every range they read is mapped."""
    monkeypatch.setattr(h5read, "PASS1_MAPPED", False)
    path, m = _saved(tmp_path)
    with DatasetReader(path, m) as r:
        r.verify(_all_keys(r, m))
        fm = r._mapped()
        assert fm is not None
        for t in m["tensors"]:
            if t["nbytes"]:
                assert fm._covered(t["offset"], t["offset"] + t["nbytes"]), t["dataset"]
        dest = torch.zeros(300_001).numpy().view(np.uint8)
        big = next(t for t in m["tensors"] if t["dataset"].endswith("/big"))
        r.read_verified(big, dest)
        assert np.array_equal(dest, r.read_bytes(big, 0, big["nbytes"]))


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_ranks_of_a_node_each_check_one_contiguous_run_of_the_file(tmp_path, ranks):
    """The shards every rank of a node reads (replicated state) are dealt out as contiguous,
    byte-balanced runs of the file: each rank reads one sequential stream, the runs cover every
    shard once."""
    from coci_hpc.checkpoint.load import _my_checks

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(50 + 30 * i, 40) for i in range(6)])
    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(1, {"model": model})
    mgr.close()
    path, m = cat.step_dir(tmp_path, 1) / mf.DATA_FILE, cat.read_manifest(cat.step_dir(tmp_path, 1))
    node = list(range(ranks))
    rows: list[dict[str, int]] = [{} for _ in node]
    with DatasetReader(path, m) as r:
        replicated = {k for k in _all_keys(r, m) if k[0].startswith("replicated/")}
        order = sorted(replicated, key=r.shard_extent)
        runs = []
        for rank in node:
            mine, needed = _my_checks(rank, node, m, r, rows)
            assert needed >= replicated
            at = sorted(order.index(k) for k in mine & replicated)
            assert at == list(range(at[0], at[0] + len(at)))  # one contiguous run
            runs.append((at, sum(r.shard_extent(k)[1] for k in mine)))
    assert sorted(i for at, _ in runs for i in at) == list(range(len(order)))
    biggest = max(r.shard_extent(k)[1] for k in order)
    total = sum(n for _, n in runs)
    assert all(abs(n - total / ranks) <= biggest for _, n in runs)



@pytest.mark.mpi
def test_a_sharded_state_is_checked_in_contiguous_runs_over_the_whole_node(tmp_path_factory, monkeypatch):
    """Row-sharded state saved by the ranks interleaves in the file (each tensor's rows in rank
    order). The ranks of a node check it in one contiguous run of the file each, whoever reads the
    shards in it (their own shards and the others'), covering every shard the node reads once;
    with ``NODE_RUNS`` off each checked only its own, interleaved with the others' runs."""
    from coci_hpc.checkpoint import Sharded
    from coci_hpc.checkpoint import load as load_mod
    from coci_hpc.comm import Comm

    comm = Comm.world()
    base = Path(comm.bcast(str(tmp_path_factory.mktemp("noderuns")) if comm.rank == 0 else None))
    torch.manual_seed(comm.rank)
    state = {f"w{i}": Sharded(torch.randn(8 + 4 * i, 16)) for i in range(5)}
    with CheckpointManager(base, comm=comm) as cm:
        cm.save(1, state)
    m = cat.read_manifest(cat.step_dir(base, 1))
    rows = comm.allgather({f"replicated/w{i}": state[f"w{i}"].local.shape[0] for i in range(5)})
    node = list(range(comm.size))
    with DatasetReader(cat.step_dir(base, 1) / mf.DATA_FILE, m) as r:
        order = sorted(_all_keys(r, m), key=r.shard_extent)
        got = {}
        for flag in (True, False):
            monkeypatch.setattr(load_mod, "NODE_RUNS", flag)
            got[flag] = [load_mod._my_checks(rank, node, m, r, rows) for rank in node]
    mine = [sorted(order.index(k) for k in checks) for checks, _ in got[True]]
    assert sorted(i for at in mine for i in at) == list(range(len(order)))  # every shard once
    for at in mine:
        assert at == list(range(at[0], at[0] + len(at)))  # one contiguous run each
    for (_, needed), (old_checks, old_needed) in zip(got[True], got[False]):
        assert needed == old_needed and old_checks == needed
    if comm.size > 1:
        # rank 0's own shards lie in every tensor's first rows: its run holds others' too
        assert got[True][0][0] != got[True][0][1]

def test_rotated_jobs_begin_at_the_share_of_their_bytes_and_keep_file_order():
    from coci_hpc.checkpoint.h5read import _rotated

    jobs = [(None, n, at) for at, n in [(0, 10), (10, 30), (40, 20), (60, 40)]]  # 100 bytes
    size = lambda n: n  # noqa: E731
    assert _rotated(jobs, 0.0, size) == jobs
    assert [j[2] for j in _rotated(jobs, 0.5, size)] == [60, 0, 10, 40]   # 40 < 50 <= 60
    assert [j[2] for j in _rotated(jobs, 0.1, size)] == [10, 40, 60, 0]
    assert _rotated([], 0.5, size) == []
    assert sorted(_rotated(jobs, 0.99, size), key=lambda j: j[2]) == jobs


@pytest.mark.parametrize("start", [0.0, 0.5])
def test_a_check_begun_midway_reads_every_shard_and_still_names_a_bad_one(tmp_path, monkeypatch, start):
    """The ranks of a node begin their checks at different places of the file (``verify``'s
    ``start``): every shard is still read and checked against its own CRC, and a flipped byte
    names its dataset."""
    from coci_hpc.errors import CheckpointCorrupt

    path, m = _saved(tmp_path)
    seen: list[int] = []
    real_view = rawio.FileMap.view
    monkeypatch.setattr(rawio.FileMap, "view", lambda self, at, n: seen.append(at) or real_view(self, at, n))
    with DatasetReader(path, m) as r:
        keys = _all_keys(r, m)
        r.verify(keys, start)
        firsts = sorted(r.shard_extent(k)[0] for k in keys if r.shard_extent(k)[1])
    assert seen and set(firsts) <= set(seen)
    if start:
        assert seen[0] > firsts[0]  # begun midway, not at the file's first shard
    big = next(t for t in m["tensors"] if t["dataset"].endswith("/big"))
    with open(path, "r+b") as f:
        f.seek(big["offset"] + 12345)
        b = f.read(1)
        f.seek(big["offset"] + 12345)
        f.write(bytes([b[0] ^ 0xFF]))
    with DatasetReader(path, m) as r, pytest.raises(CheckpointCorrupt, match="big"):
        r.verify(_all_keys(r, m), start)


def test_scratch_copies_fill_the_pieces_parts_overlap():
    """The check hands each checked part (file bytes at an offset) to ScratchCopies: every piece
    it overlaps gets its bytes, and a piece counts as filled only once all of it came."""
    from coci_hpc.checkpoint.h5read import ScratchCopies

    src = np.arange(200, dtype=np.uint8)  # the file
    a, b, c = np.zeros(30, np.uint8), np.zeros(50, np.uint8), np.zeros(20, np.uint8)
    sc = ScratchCopies([(a, 10), (b, 40), (c, 150)])
    sc.copy(src[0:35], 0)        # the first 25 bytes of a
    sc.copy(src[35:100], 35)     # the rest of a, all of b
    sc.copy(src[140:160], 140)   # half of c
    assert sc.full(a, 10) and sc.full(b, 40) and not sc.full(c, 150)
    assert np.array_equal(a, src[10:40]) and np.array_equal(b, src[40:90])
    assert np.array_equal(c[:10], src[150:160]) and not c[10:].any()
    sc.copy(src[160:200], 160)
    assert sc.full(c, 150) and np.array_equal(c, src[150:170])
    assert not sc.full(np.zeros(30, np.uint8), 10)  # other memory at the same offset: not filled
    assert not sc.full(a[:10], 10)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "streamed"])
def test_a_fresh_optimizer_is_filled_by_the_check_not_copied_after_it(tmp_path, monkeypatch, mapped):
    """A restart loads into a fresh optimizer: its moments go into buffers nothing sees before
    every check passed, so the check fills them as it reads (issue 33), and the copy after the
    last check leaves them out. Either way the state is the saved one, bit for bit; checked
    over the file's mapping and streamed through the reused read buffers alike."""
    from coci_hpc.checkpoint import load as load_mod

    monkeypatch.setattr(h5read, "PASS1_MAPPED", mapped)

    big = 300_001
    saved = full_state(1, big=big)
    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(1, saved)
    copied: list[int] = []
    real = DatasetReader.copy_verified

    def counting(self, pieces, threads=1):
        copied.append(sum(d.nbytes for d, _ in pieces))
        return real(self, pieces, threads)

    monkeypatch.setattr(DatasetReader, "copy_verified", counting)
    after = {}
    for fill in (False, True):
        monkeypatch.setattr(load_mod, "FILL_IN_CHECK", fill)
        fresh = full_state(2, big=big, train_steps=0)
        assert not fresh["optimizer"].state  # no moments yet
        copied.clear()
        mgr.load(1, fresh)
        assert canonical(fresh) == canonical(saved)
        after[fill] = sum(copied)
    mgr.close()
    moments = 2 * big * 4  # exp_avg and exp_avg_sq of the big parameter (float32)
    assert after[False] - after[True] >= moments, after


def test_a_check_that_fails_leaves_the_fresh_optimizer_it_half_filled_empty(tmp_path):
    """The check fills the fresh optimizer's moments as it reads; a flipped byte in the last
    moment read fails the load, and neither the optimizer (still without state) nor the model
    changed."""
    from coci_hpc.errors import CheckpointError

    big = 300_001
    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(1, full_state(1, big=big))
    mgr.close()
    flip_last_moment_byte(tmp_path, 1, min_nbytes=big * 4)
    fresh = full_state(2, big=big, train_steps=0)
    before = canonical(fresh["model"])
    with pytest.raises(CheckpointError):
        CheckpointManager(tmp_path, comm=None).load(1, fresh)
    assert not fresh["optimizer"].state
    assert canonical(fresh["model"]) == before


def test_a_fresh_buffer_that_cannot_be_had_fails_inside_the_ranks_agreement(tmp_path, monkeypatch):
    """The load makes its fresh buffers before the check; a rank that cannot get one must fail
    inside the check's agreement (every rank then raises together), not before it, where the
    other ranks would wait in the check's collectives for a rank that left. Nothing changes."""
    from coci_hpc.checkpoint import load as load_mod

    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(1, full_state(1))
    fresh = full_state(2, train_steps=0)
    before = canonical(fresh["model"])

    def no_memory(dtype, shape):
        raise MemoryError(f"cannot allocate {shape}")

    monkeypatch.setattr(load_mod, "empty_like_leaf", no_memory)
    with pytest.raises(Exception, match="checking checkpoint step 1") as err:
        mgr.load(1, fresh)
    assert "MemoryError" in str(err.value)
    assert not fresh["optimizer"].state
    assert canonical(fresh["model"]) == before
    mgr.close()


@pytest.fixture
def one_rank_group():
    """A real one-rank gloo process group and CPU mesh (FSDP2 in this process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if owned:
            dist.destroy_process_group()


def _fsdp2(mesh, seed: int, steps: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    return model, opt


def _moments(opt) -> list[torch.Tensor]:
    return [v.to_local().clone() for st in opt.state.values() for k, v in sorted(st.items()) if k != "step"]


def test_a_restarted_optimizers_moments_are_live_for_the_next_load(tmp_path, one_rank_group):
    """A restart loads into a fresh FSDP2 optimizer: the moment targets the load made for it are
    filled by the check. Once the optimizer holds them they are its live moments: a later load
    into it (a fall back, survivors reloading) whose check fails must leave them as they were.
    It did not while those targets stayed marked as made for a load: the failing load's check
    wrote the checkpoint's moments into them before the bad byte was found."""
    from coci_hpc.comm import Comm
    from coci_hpc.errors import CheckpointCorrupt

    mgr = CheckpointManager(tmp_path, Comm.serial())
    m1, o1 = _fsdp2(one_rank_group, 1, 2)
    mgr.save(1, {"model": m1, "optimizer": o1})
    m2, o2 = _fsdp2(one_rank_group, 2, 3)
    mgr.save(2, {"model": m2, "optimizer": o2})
    flip_last_moment_byte(tmp_path, 2)  # step 2's last moment: a flipped bit at its end
    model, opt = _fsdp2(one_rank_group, 3, 0)
    mgr.load(1, {"model": model, "optimizer": opt})  # the restart: a fresh optimizer
    restarted = _moments(opt)
    assert all(torch.equal(a, b) for a, b in zip(restarted, _moments(o1)))
    with pytest.raises(CheckpointCorrupt):
        mgr.load(2, {"model": model, "optimizer": opt})
    assert all(torch.equal(a, b) for a, b in zip(restarted, _moments(opt)))
    mgr.close()


def _plain_moments(opt) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for k, v in sorted(st.items()) if k != "step"]


def test_a_failed_check_leaves_a_trained_optimizer_with_its_own_moments(tmp_path):
    """A load into an optimizer that already has state (a rollback in the same process): a flipped
    byte in the last moment read fails the load, and the optimizer keeps its own tensors, unchanged."""
    from coci_hpc.errors import CheckpointError

    big = 300_001
    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(1, full_state(1, big=big))
    mgr.close()
    flip_last_moment_byte(tmp_path, 1, min_nbytes=big * 4)
    trained = full_state(2, big=big)
    before = canonical(trained)
    old = _plain_moments(trained["optimizer"])
    with pytest.raises(CheckpointError):
        CheckpointManager(tmp_path, comm=None).load(1, trained)
    assert canonical(trained) == before
    assert all(a is b for a, b in zip(old, _plain_moments(trained["optimizer"])))


def test_a_refused_load_gives_a_trained_optimizer_its_own_moments_back(tmp_path):
    """An object loaded after the optimizer refuses its state: the optimizer is rolled back to
    the moment tensors it had, with their values, and no byte of the checkpoint reached them."""
    from coci_hpc.errors import CommError

    class Picky:
        def __init__(self) -> None:
            self.v = 1

        def state_dict(self) -> dict:
            return {"v": self.v}

        def load_state_dict(self, sd: dict) -> None:
            raise ValueError("refused")

    big = 300_001
    mgr = CheckpointManager(tmp_path, comm=None)
    mgr.save(1, {**full_state(1, big=big), "zz_picky": Picky()})
    trained = {**full_state(2, big=big), "zz_picky": Picky()}
    before = canonical({k: v for k, v in trained.items() if k != "zz_picky"})
    old = _plain_moments(trained["optimizer"])
    with pytest.raises(CommError, match="refused"):
        mgr.load(1, trained)
    mgr.close()
    assert canonical({k: v for k, v in trained.items() if k != "zz_picky"}) == before
    assert all(a is b for a, b in zip(old, _plain_moments(trained["optimizer"])))
