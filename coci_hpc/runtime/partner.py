"""Each rank's per-rank state, kept every step by a partner rank on another node.

A survivors' save (:mod:`.survivors`) writes the state of the last step every rank finished without
the dead rank. Replicated state is on every survivor; the dead rank's *per-rank* state (its RNG
streams, ``PerRank`` values) exists only in its memory, so every rank sends a copy of it to its
partner each step: ~10 KB (python's Mersenne Twister, numpy's and torch's generator states),
sent without blocking over a TCP connection of its own (:class:`PartnerLink`, which says why not
MPI), and taken in from what has already arrived: nothing on the critical path waits for it.

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

import collections
import contextlib
import ctypes
import json
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from coci_hpc.checkpoint import devices
from coci_hpc.checkpoint.leaves import LeafKind, PerRank, storage_dtype
from coci_hpc.checkpoint.state import collect
from coci_hpc.checkpoint.treecode import Leaf, flatten
from coci_hpc.errors import CommError
from coci_hpc.runtime import rngstate

TAG = 0xC0C1          # on a communicator of our own (Dup), so any tag would do
SEND_SLOTS = 8        # copies that may still be in flight; a partner this far behind is not draining
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
        self.requests: list[Any] = []   # sends still reading buf
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        self.buf: Any = np.zeros(capacity, dtype=np.uint8)   # Any: struct and the link take it as a buffer
        self.addr = self.buf.ctypes.data

    def busy(self) -> bool:
        if not self.requests:
            return False
        if all(r.Test() for r in self.requests):
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


def partner_of(rank: int, size: int, ranks_per_node: int) -> int:
    k = ranks_per_node if 0 < ranks_per_node < size else 1
    return (rank + k) % size


class PartnerLink:
    """The transport both partner copies use: the per-step per-rank copy (:class:`PartnerCopy`)
    and the memory tier's copy of the whole local state (:mod:`.memtier`). One rank sends to its
    ``partner`` (:func:`partner_of`) and receives from its ``source`` (the rank whose partner it
    is), each way over a TCP connection of its own, non-blocking; never a wait that a dead peer
    could hold. Messages are framed (an 8-byte length, then the bytes) and arrive in order.

    Why not MPI (it was, until 2026-11-29): Open MPI 4.1's ob1 layer aborts the *sending* process
    when a TCP write to a peer fails (``writev failed: Connection reset by peer``, then
    ``pml_ob1_sendreq.c:190 FATAL``, exit 255), whatever the error handler. A rank killed while
    a copy was streaming to it then took its survivor with it (seen in CI; reproduced with a
    SIGKILLed receiver: every sender that reached the kill gone, 7 of 7). Over a socket of our own
    the same failure is an ``OSError`` here: the link is marked ``broken``, its sends never
    complete (as MPI's to a dead peer never did), and the peer-loss path goes on. Bytes that had
    arrived before the sender died stay readable (the kernel keeps them; the dead sender's side
    closes with FIN: nothing is ever sent back on a connection, so it holds no unread data that
    would make it a reset).

    Setup is collective over ``mpi_comm`` (each rank's host and port, one ``allgather``): every
    rank connects to its partner's listening socket, then accepts its source's connection, which
    proves itself with the listener's random token.

    Progress: the calls here (``Test``, ``arrived``) move what the sockets take at once, and a
    thread of the link's own (:meth:`_run`) moves the rest between them: it sends queued bytes
    as the socket drains and fills the buffer a posted :meth:`irecv` gave it, never reading past
    the message it was given a buffer for. It does not read the next message's header
    (:meth:`arrived` does, at the caller's step boundary): until 2026-11-30 it did, and so woke
    once per message, in the middle of a training step, for 8 bytes. Until
    2026-11-30 only the calls moved bytes (as MPI's progress did): about one socket buffer, ~4 MB
    here, per step boundary, so a memory-tier copy of 500 MB took over a hundred steps to arrive.
    Every state change happens under one lock; the thread waits in ``select`` without it."""

    HELLO = struct.Struct("<4sIIQ")       # magic, the connecting rank, the tag, the listener's token
    MAGIC = b"CPL1"
    CONNECT_S = 60.0                      # connecting and accepting at setup (every rank is there)

    def __init__(self, mpi_comm: Any, ranks_per_node: int, tag: int) -> None:
        self.comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.tag = tag
        self.partner = partner_of(self.rank, self.size, ranks_per_node)
        # The rank that sends to us: the inverse of partner_of.
        self.source = next(r for r in range(self.size) if partner_of(r, self.size, ranks_per_node) == self.rank)
        self.broken: str | None = None    # why the outgoing connection failed (the partner is gone)
        self.closed: str | None = None    # why the incoming one ended (the source is gone)
        self._sends: collections.deque[SendRequest] = collections.deque()
        self._head = bytearray(_HEAD.size)
        self._head_have = 0
        self._next: int | None = None     # the size of the next message, once its header is in
        self._recv: RecvRequest | None = None
        self._out, self._in = self._connect(mpi_comm)
        self._lock = threading.RLock()
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()   # tells the thread its work changed
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"coci-partner-link-{tag}", daemon=True)
        self._thread.start()

    # -- the progress thread -------------------------------------------------------------------------
    def _run(self) -> None:
        """Move bytes while the caller trains: wait (without the lock) until a socket the link
        has work for is ready or the caller changed the work, then do it under the lock."""
        try:
            while True:
                with self._lock:
                    if self._stop:
                        return
                    rd: list[socket.socket] = [self._wake_r]
                    wr: list[socket.socket] = []
                    if self.broken is None and self._sends:
                        wr.append(self._out)
                    if self.closed is None and self._recv is not None:
                        # only a posted receive: the next header is read by the caller's
                        # arrived(), so the thread does not wake once per message to read it
                        rd.append(self._in)
                try:
                    ready_r, ready_w, _ = select.select(rd, wr, [], 1.0)
                except (OSError, ValueError):     # a socket closed under us: the link was closed
                    return
                with self._lock:
                    if self._stop:
                        return
                    if self._wake_r in ready_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    if ready_w:
                        self._push()
                    if self._in in ready_r and self._recv is not None:
                        self._recv.Test()
        finally:
            for sock in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    sock.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):   # full (a wake-up is pending anyway) or closed (thread gone)
            self._wake_w.send(b"\0")

    # -- setup -----------------------------------------------------------------------------------
    def _connect(self, mpi_comm: Any) -> tuple[socket.socket, socket.socket]:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("", 0))
            listener.listen(4)
            token = int.from_bytes(os.urandom(8), "little")
            here = (socket.gethostname(), listener.getsockname()[1], token)
            every = mpi_comm.allgather(here)
            host, port, their_token = every[self.partner]
            try:
                out = socket.create_connection((host, port), timeout=self.CONNECT_S)
                out.sendall(self.HELLO.pack(self.MAGIC, self.rank, self.tag, their_token))
                out.setblocking(False)
                out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # a small copy leaves at once
            except OSError as exc:
                raise CommError(
                    f"rank {self.rank} could not connect to its partner rank {self.partner} at {host}:{port} "
                    f"for the partner copy ({exc})",
                    hint="the survivors' save needs TCP between the job's nodes; COCI_SURVIVORS=0 turns it off") from exc
            return out, self._accept(listener, token)
        finally:
            listener.close()

    def _accept(self, listener: socket.socket, token: int) -> socket.socket:
        """The source's connection: the first one that says it is the source with our token."""
        listener.settimeout(self.CONNECT_S)
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                raise CommError(f"rank {self.rank}: its source rank {self.source} did not connect for the "
                                f"partner copy within {self.CONNECT_S:.0f}s ({exc})") from exc
            conn.settimeout(self.CONNECT_S)
            got = bytearray()
            try:
                while len(got) < self.HELLO.size:
                    chunk = conn.recv(self.HELLO.size - len(got))
                    if not chunk:
                        break
                    got += chunk
            except OSError:
                pass
            if len(got) == self.HELLO.size and self.HELLO.unpack(bytes(got)) == (self.MAGIC, self.source, self.tag, token):
                conn.setblocking(False)
                return conn
            conn.close()                  # not our source (a stray connection): wait for the right one

    def close(self) -> None:
        """End both connections (the loop ended); sends still queued are dropped."""
        with self._lock:
            self._stop = True
            self._wake()
            for s in (self._out, self._in):
                try:
                    s.close()
                except OSError:
                    pass
            self.broken = self.broken or "closed"
            self.closed = self.closed or "closed"

    # -- sending -----------------------------------------------------------------------------------
    def spec(self, buf: Any) -> memoryview:
        """What :meth:`isend` takes: the buffer's bytes (read when sent; not to change until done)."""
        return memoryview(buf).cast("B")

    def isend(self, spec: memoryview) -> SendRequest:
        """Queue ``spec`` (:meth:`spec`) for the partner and send what the socket takes now: the
        request, done once every byte was handed to the kernel."""
        req = SendRequest(self, spec)
        with self._lock:
            self._sends.append(req)
            self._push()
            if not req.done:
                self._wake()             # the rest leaves from the thread
        return req

    def _push(self) -> None:
        with self._lock:
            while self._sends and self.broken is None:
                req = self._sends[0]
                try:
                    n = self._out.sendmsg(req.remaining())
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:       # the partner is gone (reset, broken pipe): never an abort
                    self.broken = f"{type(exc).__name__}: {exc}"
                    return
                if req.advance(n):
                    self._sends.popleft()

    # -- receiving ---------------------------------------------------------------------------------
    def arrived(self) -> int | None:
        """The size in bytes of the next message from the source once it has started to arrive
        (its header is in), else None. Take it with :meth:`irecv` (or :meth:`recv`)."""
        with self._lock:
            self._push()
            if self._recv is not None:
                self._recv.Test()
                if self._recv is not None:
                    return None
            self._read_head()
            return self._next

    def _read_head(self) -> None:
        """Read the next message's header as far as it has arrived (``_next`` once it is in)."""
        with self._lock:
            if self._next is None and self._recv is None and self.closed is None:
                while self._head_have < _HEAD.size:
                    got = self._read(memoryview(self._head)[self._head_have:])
                    if not got:
                        return
                    self._head_have += got
                (self._next,) = _HEAD.unpack(self._head)

    def irecv(self, buf: Any) -> RecvRequest:
        """Start taking in the message :meth:`arrived` saw, into ``buf`` (its size): the request."""
        with self._lock:
            if self._next is None or self._recv is not None:
                raise RuntimeError("irecv without a message announced by arrived()")
            mv = memoryview(buf).cast("B")
            if mv.nbytes != self._next:
                raise ValueError(f"irecv into {mv.nbytes} bytes for a message of {self._next}")
            req = self._recv = RecvRequest(self, mv)
            req.Test()
            if not req.done:
                self._wake()             # the rest comes in from the thread
            return req

    def recv(self, buf: Any) -> None:
        """Take in the message :meth:`arrived` saw, waiting for the rest of it (bounded by the
        source: a source gone mid-message raises ``CommError``)."""
        self.irecv(buf).Wait()

    def _wait(self, test: Callable[[], bool], outgoing: bool) -> None:
        """Call ``test`` until it is true, sleeping on the socket it needs between calls; CommError
        once that connection has ended (``broken`` outgoing, ``closed`` incoming)."""
        sock = self._out if outgoing else self._in
        while not test():
            if outgoing and self.broken is not None:
                raise CommError(f"rank {self.rank}: the partner copy to rank {self.partner} failed ({self.broken})")
            if not outgoing and self.closed is not None:
                raise CommError(f"rank {self.rank}: the partner copy from rank {self.source} ended mid-message "
                                f"({self.closed})")
            select.select([] if outgoing else [sock], [sock] if outgoing else [], [], 0.05)

    def _read(self, into: memoryview) -> int:
        """Non-blocking: bytes read into ``into`` (0 when none are there; the end is ``closed``)."""
        if self.closed is not None or not into.nbytes:
            return 0
        try:
            n = self._in.recv_into(into)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self.closed = f"{type(exc).__name__}: {exc}"
            return 0
        if n == 0:
            self.closed = f"rank {self.source} closed the connection"
        return n

    def _received(self, req: RecvRequest) -> None:
        self._recv, self._next, self._head_have = None, None, 0


class SendRequest:
    """One message queued on a :class:`PartnerLink`; ``Test()`` pushes and says whether it left."""

    def __init__(self, link: PartnerLink, data: memoryview) -> None:
        self.link = link
        self.head = memoryview(_HEAD.pack(data.nbytes))
        self.data = data
        self.sent = 0                 # of header + data
        self.done = False

    def remaining(self) -> list[memoryview]:
        h = self.head.nbytes
        if self.sent < h:
            return [self.head[self.sent:], self.data] if self.data.nbytes else [self.head[self.sent:]]
        return [self.data[self.sent - h:]]

    def advance(self, n: int) -> bool:
        self.sent += n
        self.done = self.sent >= self.head.nbytes + self.data.nbytes
        return self.done

    def Test(self) -> bool:     # noqa: N802 - the name mpi4py's requests have (callers test both alike)
        if not self.done:
            self.link._push()
        return self.done

    def Wait(self) -> None:     # noqa: N802
        self.link._wait(self.Test, outgoing=True)


class RecvRequest:
    """One message being taken in from a :class:`PartnerLink`; ``Test()`` reads what is there."""

    def __init__(self, link: PartnerLink, into: memoryview) -> None:
        self.link = link
        self.into = into
        self.have = 0
        self.done = into.nbytes == 0

    def Test(self) -> bool:     # noqa: N802
        if self.done and self.link._recv is not self:   # filled (by the link's thread, perhaps)
            return True
        with self.link._lock:
            while not self.done:
                got = self.link._read(self.into[self.have:])
                if not got:
                    break
                self.have += got
                self.done = self.have >= self.into.nbytes
            if self.done and self.link._recv is self:
                self.link._received(self)
        return self.done

    def Wait(self) -> None:     # noqa: N802
        self.link._wait(self.Test, outgoing=False)


class PartnerCopy:
    """Send this rank's copies to its partner; keep the last two received from the rank whose
    partner this one is, undecoded. With MPI only (``mpi_comm``, a duplicate of the world, sets
    the link up)."""

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
        self._bufs: list[Any] = [np.zeros(capacity, dtype=np.uint8) for _ in range(self.RECV_SLOTS)]
        self._cur = 0                      # the buffer being filled
        self._taking: RecvRequest | None = None   # the copy arriving into it
        self._have = 0                     # its size
        self._held: dict[int, tuple[int, int, int]] = {}   # step -> (buffer, bytes, its step), the last two
        self._full: tuple[int, int, int] | None = None      # the last full copy: (step, buffer, bytes)

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
        copy.requests = [self.link.isend(self.link.spec(copy.data))]
        self.sent_step = copy.step
        self.ref = copy
        self.sent_full += 1

    def drain(self) -> None:
        """Take in every copy that has arrived (non-blocking), into preallocated buffers; one
        still arriving is finished at a later call."""
        if self.size == 1:
            return
        link = self.link
        while True:
            if self._taking is None:
                n = link.arrived()
                if n is None:
                    return
                buf = self._bufs[self._cur]
                if n > buf.size:
                    buf = self._bufs[self._cur] = np.zeros(max(2 * buf.size, n), dtype=np.uint8)
                self._taking = link.irecv(buf[:n])
                self._have = n
            if not self._taking.Test():
                return
            self._taking = None
            self._take(self._bufs[self._cur], self._have)

    def _take(self, buf: Any, n: int) -> None:
        """A whole message in ``buf[:n]``: a full copy (held; its buffer is kept) or a "same" one."""
        if n < SAME_HEAD.size:
            return                         # not a copy: skip it
        magic = bytes(buf[:4])
        if magic == SAME:
            _, _, step, ref_step = SAME_HEAD.unpack_from(buf, 0)
            if self._full is not None and self._full[0] == ref_step:
                self._hold(step, self._full[1], self._full[2], ref_step)
            return
        if magic != MAGIC or n < COPY_HEAD.size:
            return
        _, _, step, a, b = COPY_HEAD.unpack_from(buf, 0)
        if n < COPY_HEAD.size + a + b:
            return                         # damaged: decode_copy would refuse it too
        self._full = (step, self._cur, n)
        self._hold(step, self._cur, n, step)
        used = {h[0] for h in self._held.values()} | {self._cur}
        self._cur = next(i for i in range(self.RECV_SLOTS) if i not in used)

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
