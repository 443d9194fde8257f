"""Each rank's per-rank state, kept every step by a partner rank on another node.

A survivors' save (:mod:`.survivors`) writes the state of the last step every rank finished without
the dead rank. Replicated state is on every survivor; the dead rank's *per-rank* state (its RNG
streams, ``PerRank`` values) exists only in its memory, so every rank sends a copy of it to its
partner each step: ~10 KB (python's Mersenne Twister, numpy's and torch's generator states),
sent with non-blocking MPI ``Isend`` on a duplicate of the world communicator (its messages never
match the training's), received with ``Iprobe``/``Recv`` of what has already arrived: nothing on
the critical path waits for it (sent in eager-sized pieces, see ``CHUNK``).

What travels is raw bytes, never pickle, and nothing is converted per step (:class:`Capturer`):
a fixed header, the RNG streams as the generators hold them (:mod:`.rngstate`), and, only when
the state has ``PerRank`` values, their :class:`RankState` packing (JSON skeleton + raw leaves).
Both sides use preallocated buffers; a received copy is only decoded into a :class:`RankState`
(the form the survivors' writer and checkpoints use) when a failure needs it
(:meth:`PartnerCopy.copy_for`), off the per-step path.

When it is sent: at the end of each forward of a model in the state (a forward hook), or, in a
step with no such forward, at the first ``optimizer.step()`` (a pre-hook). A rank killed after the
gradient allreduce of step s+1 has let its peers finish step s+1; a copy sent only at the
boundary would then stop at step s and the survivors, holding step s+1's model, could not save.
Sent at forward, the copy has left before backward starts any gradient allreduce (the window of
the optimizer-step copy, the rest of ``backward()`` plus the capture, is closed), and it is the
state of the end of step s+1 as long as nothing after the last forward in the loop body draws
random numbers or changes ``PerRank`` state (true of the usual loop: zero_grad, forward,
backward, step, scheduler step, logging; with gradient accumulation every micro-batch's forward
sends, the last one wins). One capture per step, as with the optimizer-step copy alone: checking
again at the optimizer step would catch a loop that draws between forward and step, at the cost of
a second capture every step (measured: benchmarks/partner_copy_bench.py). A loop that calls
several optimizers per step gets its copy at the boundary instead (the window above is then open:
a failure inside it falls back to the last regular checkpoint, and says so).

Partner of rank r: the rank with the same local index on the next node,
``(r + ranks_per_node) % size`` (with one node, the next rank), so a node failure never takes
a rank and its copy together unless two nodes fail.
"""
from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from coci_hpc.checkpoint import devices
from coci_hpc.checkpoint.leaves import LeafKind, PerRank, storage_dtype
from coci_hpc.checkpoint.state import collect
from coci_hpc.checkpoint.treecode import Leaf, flatten
from coci_hpc.runtime import rngstate

TAG = 0xC0C1          # on a communicator of our own (Dup), so any tag would do
# Sent in pieces below Open MPI's eager limit (4 KB in shared memory including its own header,
# 64 KB over TCP): an eager message is delivered into the receiver's queue at once and stays
# there if the sender then dies. One larger message would go rendezvous: the receiver's Recv waits
# for the sender to hand over the data (measured: ~2.7 ms per step on this machine), and a dead
# sender never does.
CHUNK = 4000
SEND_SLOTS = 8        # copies whose pieces may still be in flight; a partner this far behind is not draining
_HEAD = struct.Struct("<Q")
# The copy on the wire: magic, rank, step, RNG section bytes, PerRank section bytes.
COPY_HEAD = struct.Struct("<4sIqII")
MAGIC = b"CPY1"
# A copy whose bytes equal the last one sent travels as this alone: magic, rank, step, and the
# step of that last full copy (most steps of a loop without dropout draw no random numbers).
SAME_HEAD = struct.Struct("<4sIqq")
SAME = b"SAME"
SAME_SLOTS = 8


@dataclass(frozen=True)
class RankState:
    """One rank's per-rank state at the end of ``step``: the skeleton and the leaves' bytes."""

    rank: int
    step: int
    skeleton: dict[str, Any]         # the "per_rank" section of collect()'s skeletons
    leaves: tuple[Leaf, ...]         # kind "per_rank", arrays owned by this object

    def pack(self) -> bytes:
        head = {"rank": self.rank, "step": self.step, "skeleton": self.skeleton,
                "leaves": [[l.name, l.dtype, list(l.shape), l.nbytes] for l in self.leaves]}
        hb = json.dumps(head, separators=(",", ":")).encode()
        parts = [_HEAD.pack(len(hb)), hb]
        parts.extend(l.array.view(np.uint8).tobytes() for l in self.leaves if l.array is not None)
        return b"".join(parts)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> RankState:
        buf = memoryview(data)
        (n,) = _HEAD.unpack_from(buf, 0)
        head = json.loads(bytes(buf[_HEAD.size:_HEAD.size + n]))
        pos = _HEAD.size + n
        leaves = []
        for name, dtype, shape, nbytes in head["leaves"]:
            raw = np.frombuffer(bytes(buf[pos:pos + nbytes]), dtype=np.uint8)
            if raw.size != nbytes:
                raise ValueError(f"truncated per-rank state of rank {head['rank']} (leaf {name})")
            arr = raw.view(storage_dtype(dtype)) if nbytes else raw
            leaves.append(Leaf(name, dtype, tuple(shape), arr, LeafKind.PER_RANK, int(nbytes)))
            pos += nbytes
        return cls(int(head["rank"]), int(head["step"]), head["skeleton"], tuple(leaves))


def capture(state: Mapping[str, Any], rank: int, step: int, rng: bool = True,
            stage: devices.PinnedStage | None = None) -> RankState:
    """This rank's per-rank state now (RNG streams and ``PerRank`` values), copied, through the
    checkpoint's own :func:`collect` (the reference :class:`Capturer` is checked against).

    ``stage``: device tensors go into its reused page-locked buffers, with non-blocking copies on
    the side stream and one wait (no host tensor per copy); the returned state's arrays for them
    are views of those buffers, valid until the next capture with the same stage. Without it a
    device tensor is copied by a blocking ``.cpu()``."""
    per_rank = {k: v for k, v in state.items() if isinstance(v, PerRank)}
    skel, leaves = collect(per_rank, rng=rng, defer_device=stage is not None)
    staged: dict[str, np.ndarray] = {}
    if stage is not None:
        copies = devices.HostCopies()
        for l in leaves:
            if l.array is None and l.source is not None:
                buf, t = stage.get(l.name, l.nbytes)
                if l.nbytes:
                    # Safe: queued after the step's work, into a buffer no earlier capture's
                    # bytes are read from any more (packed before this capture); waited for below.
                    copies.copy(t, l.source)
                staged[l.name] = buf.view(storage_dtype(l.dtype))
        copies.wait()       # every staged array is whole before anything reads it
        stage.drop_unused(set(staged))
    # copies: the arrays may be views of live (host) tensors
    owned = tuple(Leaf(l.name, l.dtype, l.shape, staged[l.name] if l.name in staged
                       else None if l.array is None else l.array.copy(), l.kind, l.nbytes) for l in leaves)
    return RankState(rank, step, skel[LeafKind.PER_RANK], owned)


def decode_copy(data: bytes | memoryview | np.ndarray) -> RankState:
    """A packed copy (:class:`Capturer`'s bytes) as a :class:`RankState`; ValueError if damaged."""
    b: Any = np.frombuffer(data, dtype=np.uint8)
    if b.size < COPY_HEAD.size:
        raise ValueError("truncated per-rank copy (no header)")
    magic, rank, step, rng_len, extra_len = COPY_HEAD.unpack_from(b, 0)
    if magic != MAGIC:
        raise ValueError(f"not a per-rank copy (magic {magic!r})")
    if b.size < COPY_HEAD.size + rng_len + extra_len:
        raise ValueError(f"truncated per-rank copy of rank {rank} ({b.size} of "
                         f"{COPY_HEAD.size + rng_len + extra_len} bytes)")
    skeleton: dict[str, Any] = {}
    leaves: list[Leaf] = []
    if extra_len:
        o = COPY_HEAD.size + rng_len
        extra = RankState.unpack(b[o:o + extra_len].tobytes())
        skeleton.update(extra.skeleton)
        leaves.extend(extra.leaves)
    if rng_len:
        rng = rngstate.decode(b[:COPY_HEAD.size + rng_len], COPY_HEAD.size)
        skeleton["__rng__"] = flatten(rng, f"{LeafKind.PER_RANK}/__rng__", LeafKind.PER_RANK, leaves)
    return RankState(int(rank), int(step), skeleton, tuple(leaves))


class PackedCopy:
    """One captured copy in a preallocated buffer: its bytes are ``buf[:nbytes]``. The buffer is
    reused once its sends are done, so decode (:meth:`state`) before capturing again."""

    def __init__(self, capacity: int) -> None:
        self.nbytes = 0
        self.step = -1
        self.rank = -1
        self.requests: list[Any] = []   # MPI requests still reading buf
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        self.buf: Any = np.zeros(capacity, dtype=np.uint8)   # Any: struct and MPI take it as a buffer
        self.addr = self.buf.ctypes.data
        self._pieces: tuple[int, list[Any]] = (-1, [])

    def pieces(self, byte: Any) -> list[Any]:
        """The buffer specs of the pieces to send (made once per size: mpi4py parses a spec per call)."""
        if self._pieces[0] != self.nbytes:
            n = self.nbytes
            self._pieces = (n, [[self.buf[i:min(i + CHUNK, n)], byte] for i in range(0, n, CHUNK)])
        return self._pieces[1]

    def busy(self) -> bool:
        if not self.requests:
            return False
        if _testall(self.requests):
            self.requests = []
            return False
        return True

    @property
    def data(self) -> memoryview:
        return memoryview(self.buf)[:self.nbytes]

    def state(self) -> RankState:
        return decode_copy(self.buf[:self.nbytes])


class Capturer:
    """Captures this rank's per-rank state into preallocated :class:`PackedCopy` buffers, raw:
    nothing per step builds python objects for the RNG streams or JSON (unless the state has
    ``PerRank`` values: those are packed as :class:`RankState` each time)."""

    def __init__(self, state: Mapping[str, Any], rank: int, *, rng: bool = True, raw: bool = True,
                 slots: int = SEND_SLOTS) -> None:
        self.state = state
        self.rank = rank
        self.rng = rngstate.RngBytes(raw=raw) if rng else None
        self.rng_len = self.rng.nbytes if self.rng is not None else 0
        self.per_rank = [k for k, v in state.items() if isinstance(v, PerRank)]
        cap = COPY_HEAD.size + self.rng_len + (4096 if self.per_rank else 0)
        self.slots = [PackedCopy(cap) for _ in range(slots)]
        self.spare = PackedCopy(cap)    # captured into when every slot is still being sent
        self.stage = devices.PinnedStage()   # page-locked buffers for PerRank device tensors, reused
        self.last: PackedCopy | None = None

    def capture(self, step: int, keep: PackedCopy | None = None,
                hold: PackedCopy | None = None) -> tuple[PackedCopy, bool]:
        """This rank's per-rank state now, as of ``step``; and whether the copy may be sent (False
        when every send slot is still in flight: the partner is not draining). ``keep``: a copy
        whose buffer must not be reused (the last one sent in full, compared against); ``hold``:
        another (the copy of the last boundary, while the next step's is taken at forward)."""
        slot = None
        last = self.last
        for s in self.slots:
            if s is not last and s is not keep and s is not hold and not s.busy():
                slot = s
                break
        sendable = slot is not None
        if slot is None:
            slot = self.spare if self.last is not self.spare and hold is not self.spare \
                else PackedCopy(self.spare.buf.size)
        extra = b""
        if self.per_rank:
            # packed (copied out of the stage's buffers) before the next capture reuses them
            extra = capture({k: self.state[k] for k in self.per_rank}, self.rank, step, rng=False,
                            stage=self.stage).pack()
        n = COPY_HEAD.size + self.rng_len + len(extra)
        if n > slot.buf.size:
            slot.resize(n + 1024)
        COPY_HEAD.pack_into(slot.buf, 0, MAGIC, self.rank, step, self.rng_len, len(extra))
        if self.rng is not None:
            self.rng.capture_into(slot.buf, COPY_HEAD.size, slot.addr)
        if extra:
            o = COPY_HEAD.size + self.rng_len
            slot.buf[o:o + len(extra)] = np.frombuffer(extra, dtype=np.uint8)
        slot.nbytes, slot.step, slot.rank = n, step, self.rank
        self.last = slot
        return slot, sendable


def _memcmp() -> Any:
    try:
        f = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    f.restype = ctypes.c_int
    f.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return f


_MEMCMP = _memcmp()


def same_bytes(a: PackedCopy, b: PackedCopy) -> bool:
    """Whether two copies hold the same state (their bytes after the header, which has the step)."""
    n = a.nbytes
    if n != b.nbytes or n < COPY_HEAD.size:
        return False
    h = COPY_HEAD.size
    if _MEMCMP is not None:
        return _MEMCMP(a.addr + h, b.addr + h, n - h) == 0
    return bool(np.array_equal(a.buf[h:n], b.buf[h:n]))


def _testall(requests: list[Any]) -> bool:
    from mpi4py import MPI

    return bool(MPI.Request.Testall(requests))


def partner_of(rank: int, size: int, ranks_per_node: int) -> int:
    k = ranks_per_node if 0 < ranks_per_node < size else 1
    return (rank + k) % size


class PartnerLink:
    """The transport both partner copies use: the per-step per-rank copy (:class:`PartnerCopy`)
    and the memory tier's copy of the whole local state (:mod:`.memtier`). One rank sends to its
    ``partner`` (:func:`partner_of`) and receives from its ``source`` (the rank whose partner it
    is), on a communicator of its own (a duplicate of the world: its messages never match the
    training's), with non-blocking sends and probes; never a wait that a dead peer could hold.
    What travels and in how many messages is the user's business (eager pieces for the small
    per-rank copy, one message for the tier)."""

    def __init__(self, mpi_comm: Any, ranks_per_node: int, tag: int) -> None:
        from mpi4py import MPI

        self.comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.tag = tag
        self.partner = partner_of(self.rank, self.size, ranks_per_node)
        # The rank that sends to us: the inverse of partner_of.
        self.source = next(r for r in range(self.size) if partner_of(r, self.size, ranks_per_node) == self.rank)
        self.status = MPI.Status()
        self.byte = MPI.BYTE

    def spec(self, buf: Any) -> list[Any]:
        """A buffer spec for :meth:`isend` (made once and kept: mpi4py parses a spec per call)."""
        return [buf, self.byte]

    def isend(self, spec: list[Any]) -> Any:
        """Start sending ``spec`` (:meth:`spec`) to the partner: the request, tested later."""
        return self.comm.Isend(spec, self.partner, self.tag)

    def arrived(self) -> int | None:
        """The size in bytes of the next message from the source if it has started to arrive, else None.

        Probed twice: Open MPI's ``Iprobe`` looks for a match *before* it drives progress, so a
        lone call only sees what an earlier MPI call took in, and nothing else here calls MPI
        between boundaries. With one probe a copy was taken in a boundary late, its sender's
        request was still open at the next memory-tier step (k = 2), and that copy was skipped."""
        if (self.comm.Iprobe(source=self.source, tag=self.tag, status=self.status)
                or self.comm.Iprobe(source=self.source, tag=self.tag, status=self.status)):
            return int(self.status.Get_count(self.byte))
        return None

    def recv(self, buf: Any) -> None:
        """Take in the message :meth:`arrived` saw (eager-sized: already here, no wait)."""
        self.comm.Recv([buf, self.byte], source=self.source, tag=self.tag)

    def irecv(self, buf: Any) -> Any:
        """Start taking in the message :meth:`arrived` saw: the request, tested later."""
        return self.comm.Irecv([buf, self.byte], source=self.source, tag=self.tag)


class PartnerCopy:
    """Send this rank's copies to its partner; keep the last two received from the rank whose
    partner this one is, undecoded. MPI only (``mpi_comm`` a duplicate of the world)."""

    RECV_SLOTS = 4      # two held, the last full copy (a "same" refers to it), one being filled

    def __init__(self, mpi_comm: Any, ranks_per_node: int, capacity: int = 16384) -> None:
        self.link = PartnerLink(mpi_comm, ranks_per_node, TAG)
        self.comm = mpi_comm
        self.rank, self.size = self.link.rank, self.link.size
        self.partner, self.source = self.link.partner, self.link.source
        self.sent_step = -1
        self.ref: PackedCopy | None = None     # the last copy sent in full
        self._same = np.zeros((SAME_SLOTS, SAME_HEAD.size), dtype=np.uint8)
        self._same_specs = [self.link.spec(self._same[i]) for i in range(SAME_SLOTS)]
        self._same_reqs: list[Any] = [None] * SAME_SLOTS
        self._same_i = 0
        self.sent_full = self.sent_same = 0
        self._bufs: list[Any] = [np.zeros(max(capacity, CHUNK), dtype=np.uint8) for _ in range(self.RECV_SLOTS)]
        self._cur = 0                      # the buffer being filled
        self._want = 0                     # bytes of the copy being reassembled (0: none started)
        self._have = 0
        self._held: dict[int, tuple[int, int, int]] = {}   # step -> (buffer, bytes, its step), the last two
        self._full: tuple[int, int, int] | None = None      # the last full copy: (step, buffer, bytes)
        self._byte = self.link.byte

    @property
    def held_steps(self) -> list[int]:
        return sorted(self._held)

    def send(self, copy: PackedCopy) -> None:
        if self.size == 1:
            return
        ref = self.ref
        if ref is not None and same_bytes(copy, ref):
            if self.sent_step == copy.step:
                return            # the partner holds these bytes for this step already (sent at forward)
            i = self._same_i
            req = self._same_reqs[i]
            if req is None or req.Test():
                self._same_i = (i + 1) % SAME_SLOTS
                SAME_HEAD.pack_into(self._same[i], 0, SAME, copy.rank, copy.step, ref.step)
                self._same_reqs[i] = self.link.isend(self._same_specs[i])
                self.sent_step = copy.step
                self.sent_same += 1
            return
        # MPI keeps one sender's order per tag: the receiver reassembles the pieces in order.
        isend = self.link.isend
        copy.requests = [isend(p) for p in copy.pieces(self._byte)]
        self.sent_step = copy.step
        self.ref = copy
        self.sent_full += 1

    def drain(self) -> None:
        """Take in every piece that has arrived (non-blocking), into preallocated buffers."""
        if self.size == 1:
            return
        link = self.link
        while (n := link.arrived()) is not None:
            buf = self._bufs[self._cur]
            if self._have + n > buf.size:
                grown = np.zeros(max(2 * buf.size, self._have + n), dtype=np.uint8)
                grown[:self._have] = buf[:self._have]
                buf = self._bufs[self._cur] = grown
            link.recv(buf[self._have:self._have + n])  # here: no wait
            if self._want == 0:            # the first piece of a copy starts with its header
                if n < COPY_HEAD.size:
                    continue               # not the start of a copy: skip it
                magic, _, step, a, b = COPY_HEAD.unpack_from(buf, 0)
                if magic == SAME:
                    ref_step = SAME_HEAD.unpack_from(buf, 0)[3]
                    if self._full is not None and self._full[0] == ref_step:
                        self._hold(step, self._full[1], self._full[2], ref_step)
                    continue
                if magic != MAGIC:
                    continue
                self._want = COPY_HEAD.size + a + b
            self._have += n
            if self._have >= self._want:
                step = COPY_HEAD.unpack_from(buf, 0)[2]
                self._full = (step, self._cur, self._want)
                self._hold(step, self._cur, self._want, step)
                used = {h[0] for h in self._held.values()} | {self._cur}
                self._cur = next(i for i in range(self.RECV_SLOTS) if i not in used)
                self._want = self._have = 0

    def _hold(self, step: int, buf: int, nbytes: int, of_step: int) -> None:
        self._held[step] = (buf, nbytes, of_step)
        for old in sorted(self._held)[:-2]:
            del self._held[old]

    def copy_for(self, step: int) -> RankState | None:
        """The source rank's state at ``step``, decoded now (after a failure), or None."""
        self.drain()
        held = self._held.get(step)
        if held is None:
            return None
        b, n, of_step = held
        try:
            rs = decode_copy(self._bufs[b][:n])
        except ValueError:
            return None
        if rs.step != of_step or rs.rank != self.source:
            return None
        return rs if of_step == step else RankState(rs.rank, step, rs.skeleton, rs.leaves)
