"""The per-step partner copy's packing (runtime/partner.py, runtime/rngstate.py): raw bytes in
preallocated buffers, decoded only when a failure needs them. Round trip against the checkpoint's
own collect(), bit-exact restore of torch, numpy and python RNG streams and PerRank values, no
pickle, and the transport between two real MPI ranks (full copies and "same as step k")."""
from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from coci_hpc.checkpoint import PerRank
from coci_hpc.errors import CommError
from coci_hpc.runtime import survivors as sv
from coci_hpc.runtime.partner import COPY_HEAD, MAGIC, Capturer, PackedCopy, RankState, capture, decode_copy, same_bytes
from coci_hpc.runtime.rngstate import RngBytes
from tests.conftest import run_ranks


def _leaf_bytes(rs: RankState) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {l.name: (l.dtype, tuple(l.shape), bytes(l.array.view(np.uint8))) for l in rs.leaves}


def _mix_rng(seed: int) -> None:
    """Every field the copy keeps moves: MT positions, python's and numpy's cached gaussians."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    random.gauss(0.0, 1.0)                  # leaves python's gauss_next set
    np.random.standard_normal()             # leaves numpy's has_gauss = 1
    torch.randn(3)


def _draws() -> tuple:
    return (random.random(), random.gauss(0.0, 1.0), np.random.standard_normal(), np.random.random(),
            torch.rand(4).tolist(), torch.randn(2).tolist())


@pytest.mark.parametrize("raw", [True, False])
def test_packed_copy_decodes_to_what_collect_gives(raw: bool) -> None:
    """The raw capture (and the public-API fallback) decode to the same skeleton and bytes as the
    checkpoint's collect() at the same moment, PerRank values included."""
    _mix_rng(11)
    state = {"model": torch.nn.Linear(2, 2), "extra": PerRank({"count": torch.tensor([7]), "name": "r1"})}
    cap = Capturer(state, rank=1, raw=raw)
    assert cap.rng is not None and cap.rng.raw is raw     # this CPython/numpy: the raw reads apply
    copy, sendable = cap.capture(42)
    ref = capture(state, rank=1, step=42)
    got = copy.state()
    assert sendable and (got.rank, got.step) == (1, 42)
    assert json.dumps(got.skeleton, sort_keys=True) == json.dumps(ref.skeleton, sort_keys=True)
    assert _leaf_bytes(got) == _leaf_bytes(ref)
    assert [l.name for l in got.leaves] == [l.name for l in ref.leaves]


def test_raw_and_public_api_captures_are_the_same_bytes() -> None:
    _mix_rng(3)
    fast, slow = RngBytes(raw=True), RngBytes(raw=False)
    a, b = np.zeros(fast.nbytes, np.uint8), np.full(slow.nbytes, 0xFF, np.uint8)
    fast.capture_into(a)
    slow.capture_into(b)
    assert fast.raw and not slow.raw and a.tobytes() == b.tobytes()


def test_decoded_copy_restores_every_stream_bit_exactly() -> None:
    _mix_rng(5)
    copy, _ = Capturer({}, rank=0).capture(9)
    expected = _draws()
    _mix_rng(99)                            # the streams move on (the next step's forward)...
    assert _draws() != expected
    sv.restore_own_rng(copy.state())        # ...and the survivors' save puts them back
    assert _draws() == expected


def test_copy_is_raw_bytes_no_pickle_and_damage_is_refused() -> None:
    copy, _ = Capturer({"extra": PerRank({"v": torch.arange(3)})}, rank=2).capture(8)
    data = bytes(copy.data)
    magic, rank, step, rng_len, extra_len = COPY_HEAD.unpack_from(data, 0)
    assert (magic, rank, step) == (MAGIC, 2, 8) and len(data) == COPY_HEAD.size + rng_len + extra_len
    assert b"pickle" not in data and b"\x80\x04\x95" not in data      # no pickle protocol-4 frame
    with pytest.raises(ValueError, match="truncated"):
        decode_copy(data[:-5])
    with pytest.raises(ValueError, match="not a per-rank copy"):
        decode_copy(b"XXXX" + data[4:])


def test_capture_reuses_buffers_and_keeps_the_one_compared_against() -> None:
    cap = Capturer({}, rank=0)
    first, _ = cap.capture(1)
    seen = set()
    for step in range(2, 12):
        c, _ = cap.capture(step, keep=first)
        assert c is not first and c.step == step
        seen.add(id(c))
    assert len(seen) <= len(cap.slots)      # preallocated: no new buffer per step
    assert first.step == 1 and first.state().step == 1
    again, _ = cap.capture(12, keep=first)
    assert same_bytes(again, first)         # nothing drew a random number since
    torch.rand(1)
    moved, _ = cap.capture(13, keep=first)
    assert not same_bytes(moved, first)
    assert isinstance(moved, PackedCopy)


PARTNER_SCRIPT = r"""
import json, sys
import numpy as np, torch
from mpi4py import MPI
from coci_hpc.runtime.partner import Capturer, PartnerCopy
comm = MPI.COMM_WORLD.Dup()
rank = comm.Get_rank()
torch.manual_seed(100 + rank)
cap = Capturer({}, rank)
pc = PartnerCopy(comm, 1)
sent = {}
for step in range(1, 8):
    if step in (3, 6):
        torch.rand(1)                           # the state changes: a full copy
    c, ok = cap.capture(step, keep=pc.ref)
    assert ok
    pc.send(c)
    sent[step] = torch.get_rng_state().numpy().tobytes().hex()
comm.Barrier()
import time
for _ in range(1000):
    pc.drain()
    if pc.held_steps == [6, 7]:
        break
    time.sleep(0.01)
got = {s: pc.copy_for(s) for s in (5, 6, 7)}
out = {"rank": rank, "held": pc.held_steps, "full": pc.sent_full, "same": pc.sent_same,
       "sent": sent, "missing_5": got[5] is None,
       "got": {s: None if rs is None else [rs.rank, rs.step, next(bytes(l.array.view(np.uint8)).hex()
               for l in rs.leaves if l.name == "per_rank/__rng__/torch")] for s, rs in got.items() if s != 5}}
comm.Barrier()
open(f"{sys.argv[1]}/rank{rank}.json", "w").write(json.dumps(out))
"""


def test_partner_copies_travel_between_two_ranks_full_and_same(tmp_path: Path) -> None:
    script = tmp_path / "partner.py"
    script.write_text(PARTNER_SCRIPT)
    run_ranks(2, str(script), str(tmp_path), timeout=120)
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    for me, r in res.items():
        other = res[1 - me]
        assert r["held"] == [6, 7] and r["missing_5"]          # the last two steps, undecoded until asked
        assert (r["full"], r["same"]) == (3, 4)                # steps 1, 3, 6 in full; the rest "same"
        for s in ("6", "7"):
            rank, step, torch_hex = r["got"][s]
            assert (rank, step) == (1 - me, int(s))
            assert torch_hex == other["sent"][s]               # the partner's torch stream at that step


WINDOW_SCRIPT = r"""
import json, sys, time
import numpy as np, torch
from mpi4py import MPI
from coci_hpc.comm import Comm
from coci_hpc.runtime.survivors import Survival
comm = Comm.world()
rank = comm.rank
torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(200 + rank)                   # per-rank dropout streams
sv = Survival({"model": model, "optimizer": opt}, comm, ranks_per_node=1)
sv.boundary(0)
for step in range(1, 4):
    loss = model(torch.randn(3, 4)).sum()       # forward draws: dropout, the batch
    after_forward = torch.get_rng_state().numpy().tobytes().hex()
    if rank == 1 and step == 3:
        break                                   # "killed" after forward: no backward, no optimizer step
    loss.backward()
    opt.step()
    sv.boundary(step)
out = {"after_forward": after_forward}
comm.mpi_comm.Barrier()
if rank == 0:
    got = None
    for _ in range(500):
        got = sv.partner.copy_for(3)
        if got is not None:
            break
        time.sleep(0.01)
    out["copy_3"] = None if got is None else next(bytes(l.array.view(np.uint8)).hex()
                                                  for l in got.leaves if l.name == "per_rank/__rng__/torch")
    out["full"], out["same"] = sv.partner.sent_full, sv.partner.sent_same
    at_boundary = torch.get_rng_state().numpy().tobytes().hex()
    model(torch.randn(3, 4))                    # the next step's forward replaces its own copy...
    own = sv.own_for(3)                         # ...but the boundary's stays for a survivors' save
    out["own_3"] = None if own is None else next(bytes(l.array.view(np.uint8)).hex()
                                                 for l in own.state().leaves if l.name == "per_rank/__rng__/torch")
    out["at_boundary"], out["own_step"] = at_boundary, sv.own.step
comm.mpi_comm.Barrier()
open(f"{sys.argv[1]}/rank{rank}.json", "w").write(json.dumps(out))
"""


def test_the_steps_copy_leaves_at_forward_before_the_gradient_allreduce(tmp_path: Path) -> None:
    """Issue 13's window: a rank killed after the gradient allreduce of step s but before
    ``optimizer.step()`` used to take its copy of step s with it (the survivors fell back). The
    copy now leaves at the end of forward, before backward starts any allreduce: rank 1 stops
    right after its forward of step 3, and rank 0 holds its step-3 copy, equal to its RNG there."""
    script = tmp_path / "window.py"
    script.write_text(WINDOW_SCRIPT)
    run_ranks(2, str(script), str(tmp_path), timeout=120)
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert res[0]["copy_3"] is not None, res[0]
    assert res[0]["copy_3"] == res[1]["after_forward"]
    assert (res[0]["full"], res[0]["same"]) == (4, 0)   # step 0, then one per step (at forward)
    assert res[0]["own_step"] == 4 and res[0]["own_3"] == res[0]["at_boundary"]


def test_one_transport_for_the_per_rank_copy_and_the_memory_tier() -> None:
    """PartnerLink carries both copies: a message sent with it arrives through it (probe, size,
    non-blocking receive), nothing is seen when nothing was sent, and the per-rank copy and the
    memory tier each hold one, with their own tags, on their own communicators."""
    from mpi4py import MPI

    from coci_hpc.runtime import memtier
    from coci_hpc.runtime.partner import TAG, PartnerCopy, PartnerLink

    comm = MPI.COMM_SELF.Dup()
    link = PartnerLink(comm, 1, TAG)
    assert (link.partner, link.source) == (0, 0) and link.arrived() is None
    out = np.arange(10_000, dtype=np.uint8)
    req = link.isend(link.spec(out))
    n = None
    while n is None:
        n = link.arrived()
    assert n == out.size
    got = np.zeros(n, dtype=np.uint8)
    link.irecv(got).Wait()
    req.Wait()
    assert np.array_equal(got, out) and link.arrived() is None
    pc = PartnerCopy(MPI.COMM_SELF.Dup(), 1)
    tier = memtier.MemoryTier(lambda: {}, MPI.COMM_SELF.Dup(), 1, 3)
    assert isinstance(pc.link, PartnerLink) and isinstance(tier.link, PartnerLink)
    assert pc.link.tag == TAG and tier.link.tag == memtier.TAG != TAG
    assert (pc.partner, pc.source) == (tier.partner, tier.source) == (0, 0)


ARRIVED_SCRIPT = r"""
import json, os, sys, time
import numpy as np
from mpi4py import MPI
from coci_hpc.runtime.partner import PartnerLink
d, n = sys.argv[1], int(sys.argv[2])
link = PartnerLink(MPI.COMM_WORLD.Dup(), 1, 77)
rank = link.rank

def mark(name):                     # the ranks' order, kept by files: no MPI call in between
    open(os.path.join(d, name), "w").close()

def after(name):
    while not os.path.exists(os.path.join(d, name)):
        time.sleep(0.01)
    time.sleep(0.2)                 # long past delivery: what is missing now is not in flight

out = {}
if rank == 0:
    req = link.isend(link.spec(np.full(n, 7, np.uint8)))
    mark("sent")
    after("taken")
    out["send_done"] = bool(req.Test())     # one test after the partner's one look: finished
else:
    after("sent")
    got = link.arrived()                    # ONE look, as the tier takes at one step boundary
    out["arrived"] = got
    if got is not None:
        buf = np.zeros(got, np.uint8)
        req = link.irecv(buf)
        out["recv_done"] = bool(req.Test())
        out["bytes_ok"] = bool((buf == 7).all())
    mark("taken")
json.dump(out, open(os.path.join(d, f"rank{rank}.json"), "w"))
MPI.COMM_WORLD.Barrier()
"""


@pytest.mark.parametrize("n", [3000, 17536])     # an eager piece; a memory-tier copy (rendezvous)
def test_a_copy_is_seen_at_the_first_look_after_it_was_sent(tmp_path: Path, n: int) -> None:
    """When the link was MPI, nothing called MPI between two step boundaries, and Open MPI's
    ``Iprobe`` looks for a match before it drives progress: one probe missed a copy that had long
    arrived and the tier took it a boundary late (the sender's request then still open at the next
    memory-tier step: that copy skipped, the HSDP survivors' test's driver waiting for it). Kept for
    the socket link: one look at a boundary must see it, and the sender's next test must find its
    send finished."""
    script = tmp_path / "arrived.py"
    script.write_text(ARRIVED_SCRIPT)
    run_ranks(2, str(script), str(tmp_path), str(n), timeout=120)
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert res[1]["arrived"] == n, res
    assert res[1]["recv_done"] and res[1]["bytes_ok"], res
    assert res[0]["send_done"], res


class _ThreadComm:
    """Two ranks as two threads of this process: what PartnerLink's setup asks of its communicator
    (rank, size, one allgather). A stand-in for MPI in the tests below, which are about the sockets."""

    def __init__(self, rank: int, shared: dict, barrier: threading.Barrier) -> None:
        self.rank, self.shared, self.barrier = rank, shared, barrier

    def Get_rank(self) -> int:     # noqa: N802 - mpi4py's names
        return self.rank

    def Get_size(self) -> int:     # noqa: N802
        return 2

    def allgather(self, obj: object) -> list:
        self.shared[self.rank] = obj
        self.barrier.wait()
        return [self.shared[0], self.shared[1]]


def _two_links() -> tuple:
    from coci_hpc.runtime.partner import PartnerLink

    shared: dict = {}
    barrier = threading.Barrier(2)
    links: dict = {}

    def make(r: int) -> None:
        links[r] = PartnerLink(_ThreadComm(r, shared, barrier), 1, 77)
    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return links[0], links[1]


def test_a_partner_reset_mid_stream_marks_the_link_broken_and_raises_nothing() -> None:
    """The receiver goes away with unread bytes in its socket (as a SIGKILLed process does: its
    kernel answers with a reset); the sender's next sends fail inside the link, which records why
    and never completes them, and no call raises: the sender lives on to its peer-loss path."""
    a, b = _two_links()
    assert (a.partner, a.source, b.partner, b.source) == (1, 1, 0, 0)
    data = np.ones(60_000, dtype=np.uint8)
    reqs = [a.isend(a.spec(data)) for _ in range(8)]
    while not any(r.Test() for r in reqs):
        time.sleep(0.01)
    b._in.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close = reset
    b.close()
    deadline = time.monotonic() + 10
    while a.broken is None and time.monotonic() < deadline:
        reqs.append(a.isend(a.spec(data)))
        [r.Test() for r in reqs]
        time.sleep(0.01)
    assert a.broken is not None and ("reset" in a.broken.lower() or "pipe" in a.broken.lower()), a.broken
    assert not reqs[-1].Test()          # never completes, like an MPI send to a dead rank
    with pytest.raises(CommError, match="partner copy to rank 1 failed"):
        reqs[-1].Wait()
    a.close()


def test_what_arrived_before_the_sender_went_stays_readable_in_order() -> None:
    """Three copies sent, then the sender closes (a process that died after sending): the receiver
    still takes in all three, whole and in order, and then sees the end."""
    a, b = _two_links()
    sent = [np.full(n, i + 1, dtype=np.uint8) for i, n in enumerate((10, 300_000, 7))]
    reqs = [a.isend(a.spec(x)) for x in sent]
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        [r.Test() for r in reqs]
        if all(r.done for r in reqs) and a._out.fileno() != -1:
            a.close()                     # everything handed to the kernel: the sender is gone
        n = b.arrived()
        if n is None:
            time.sleep(0.001)
            continue
        buf = np.zeros(n, dtype=np.uint8)
        b.recv(buf)
        got.append(buf)
    assert [g.size for g in got] == [x.size for x in sent]
    assert all(np.array_equal(g, x) for g, x in zip(got, sent))
    while b.closed is None and time.monotonic() < deadline:
        assert b.arrived() is None
        time.sleep(0.01)
    assert b.closed is not None and b.arrived() is None
    b.close()


def test_a_backlog_of_copies_is_taken_in_at_one_look() -> None:
    """The per-step copy is drained every few boundaries (and once more after a failure): every
    copy that arrived since must come in at that one look, in order, not one per look. (A version
    with a reader thread took one per look until that thread ran: the survivors then had no copy of
    the last step and fell back, in all four peer-failure cluster tests.)"""
    a, b = _two_links()
    sent = [np.full(5000 + i, i, dtype=np.uint8) for i in range(10)]
    reqs = [a.isend(a.spec(x)) for x in sent]
    deadline = time.monotonic() + 10
    while not all(r.Test() for r in reqs) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)                              # long past delivery
    got = []
    while (n := b.arrived()) is not None:       # one look: no sleep, no other thread's turn asked for
        buf = np.zeros(n, dtype=np.uint8)
        assert b.irecv(buf).Test()
        got.append(buf)
    assert [g.size for g in got] == [x.size for x in sent]
    assert all(np.array_equal(g, x) for g, x in zip(got, sent))
    a.close()
    b.close()


def test_a_large_copy_arrives_between_looks() -> None:
    """The link's own thread moves the bytes between the caller's looks: a 64 MB copy (16 socket
    buffers and more) is sent and, once its receiver posted a buffer, arrives whole while neither
    side calls the link (until 2026-11-30 one look moved about one socket buffer, ~4 MB here: a
    memory-tier copy of 500 MB took over a hundred step boundaries)."""
    a, b = _two_links()
    data = np.random.default_rng(3).integers(0, 255, 64 << 20, dtype=np.uint8)
    req = a.isend(a.spec(data))
    assert not req.done                          # far more than the socket takes at once
    deadline = time.monotonic() + 10
    while (n := b.arrived()) is None:            # the header is read here, by the caller
        assert time.monotonic() < deadline
        time.sleep(0.01)
    into = np.zeros(n, dtype=np.uint8)
    rreq = b.irecv(into)
    deadline = time.monotonic() + 30
    while not (rreq.done and req.done):           # no Test(), no arrived(): only the threads
        assert time.monotonic() < deadline, (rreq.have, req.sent)
        time.sleep(0.01)
    assert np.array_equal(into, data)
    assert rreq.Test() and req.Test() and b.arrived() is None   # and the link is ready for the next
    small = np.arange(100, dtype=np.uint8)
    a.isend(a.spec(small))
    deadline = time.monotonic() + 10
    while (n := b.arrived()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    got = np.zeros(n, dtype=np.uint8)
    b.recv(got)
    assert np.array_equal(got, small)
    a.close()
    b.close()
    for link in (a, b):
        link._thread.join(timeout=5)
        assert not link._thread.is_alive()      # close() ends the thread


def test_the_link_thread_leaves_an_unasked_message_to_the_caller() -> None:
    """With no receive posted, the receiver's thread does not touch the incoming socket: a
    per-step copy's header is read at the caller's next look (:meth:`arrived`), so the thread
    does not wake in the middle of every training step for it."""
    a, b = _two_links()
    msg = np.arange(300, dtype=np.uint8)
    req = a.isend(a.spec(msg))
    deadline = time.monotonic() + 10
    while not req.Test():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)                              # long past delivery: a reading thread would have read
    assert (b._head_have, b._next) == (0, None)  # nothing read: that is the caller's
    assert b.arrived() == msg.size
    got = np.zeros(msg.size, dtype=np.uint8)
    b.recv(got)
    assert np.array_equal(got, msg)
    a.close()
    b.close()
