"""Each rank's per-rank state, kept every step by a partner rank on another node.

A survivors' save (:mod:`.survivors`) writes the state of the last step every rank finished without
the dead rank. Replicated state is on every survivor; the dead rank's *per-rank* state (its RNG
streams, ``PerRank`` values) exists only in its memory, so every rank sends a copy of it to its
partner each step: a few KB (python's Mersenne Twister, numpy's and torch's generator states),
packed as JSON plus raw bytes (never pickle), sent with a non-blocking MPI ``Isend`` on a
duplicate of the world communicator (its messages never match the training's), received with
``Iprobe``/``Recv`` of what has already arrived: nothing on the critical path waits for it
(sent in eager-sized pieces, see ``CHUNK``).

When it is sent: at the first ``optimizer.step()`` of a step (a pre-hook), not at the step
boundary. A rank killed after the gradient allreduce of step s+1 has let its peers finish step
s+1; a copy sent only at the boundary would then stop at step s and the survivors, holding step
s+1's model, could not save. Taken at the optimizer step, the copy already is the state of the
end of step s+1 as long as nothing after ``optimizer.step()`` in the loop body draws random
numbers or changes ``PerRank`` state (true of the usual loop: zero_grad, forward, backward, step,
scheduler step, logging). A loop that calls several optimizers per step, or none, gets its copy at
the boundary instead (the window above is then open: a failure inside it falls back to the last
regular checkpoint, and says so).

Partner of rank r: the rank with the same local index on the next node,
``(r + ranks_per_node) % size`` (with one node, the next rank), so a node failure never takes
a rank and its copy together unless two nodes fail.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from coci_hpc.checkpoint.state import Leaf, PerRank, collect, storage_dtype

TAG = 0xC0C1          # on a communicator of our own (Dup), so any tag would do
MAX_PENDING_SENDS = 16  # a partner this far behind is not draining: stop queueing more copies
# Sent in pieces below Open MPI's eager limit (4 KB in shared memory, 64 KB over TCP): an eager
# message is delivered into the receiver's queue at once and stays there if the sender then dies.
# One larger message would go rendezvous: the receiver's Recv waits for the sender to hand over
# the data (measured: ~2.7 ms per step on this machine), and a dead sender never does.
CHUNK = 3072
_HEAD = struct.Struct("<Q")


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
            leaves.append(Leaf(name, dtype, tuple(shape), arr, "per_rank", int(nbytes)))
            pos += nbytes
        return cls(int(head["rank"]), int(head["step"]), head["skeleton"], tuple(leaves))


def capture(state: Mapping[str, Any], rank: int, step: int, rng: bool = True) -> RankState:
    """This rank's per-rank state now (RNG streams and ``PerRank`` values), copied."""
    per_rank = {k: v for k, v in state.items() if isinstance(v, PerRank)}
    skel, leaves = collect(per_rank, rng=rng)
    owned = tuple(Leaf(l.name, l.dtype, l.shape, None if l.array is None else l.array.copy(), l.kind, l.nbytes)
                  for l in leaves)
    return RankState(rank, step, skel["per_rank"], owned)


def partner_of(rank: int, size: int, ranks_per_node: int) -> int:
    k = ranks_per_node if 0 < ranks_per_node < size else 1
    return (rank + k) % size


class PartnerCopy:
    """Send this rank's :class:`RankState` to its partner; keep the last two received from the
    rank whose partner this one is. MPI only (``mpi_comm`` a duplicate of the world)."""

    def __init__(self, mpi_comm: Any, ranks_per_node: int) -> None:
        self.comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.partner = partner_of(self.rank, self.size, ranks_per_node)
        # The rank that sends to us: the inverse of partner_of.
        self.source = next(r for r in range(self.size) if partner_of(r, self.size, ranks_per_node) == self.rank)
        self._sends: list[tuple[Any, bytes]] = []
        self.held: dict[int, RankState] = {}     # step -> the source rank's state, last two steps
        self.sent_step = -1
        self._want: int | None = None      # bytes of the copy being reassembled
        self._parts: list[bytes] = []
        self._have = 0
        from mpi4py import MPI

        self._status = MPI.Status()
        self._mpi = MPI

    def send(self, rs: RankState) -> None:
        if self.size == 1:
            return
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        if len(self._sends) >= MAX_PENDING_SENDS:
            return
        data = rs.pack()
        # First piece: the total length; the rest in order (MPI keeps one sender's order per tag).
        pieces = [_HEAD.pack(len(data))] + [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
        for piece in pieces:
            self._sends.append((self.comm.Isend([piece, self._mpi.BYTE], dest=self.partner, tag=TAG), piece))
        self.sent_step = rs.step

    def drain(self) -> None:
        """Take in every copy that has arrived (non-blocking)."""
        if self.size == 1:
            return
        mpi = self._mpi
        while self.comm.Iprobe(source=self.source, tag=TAG, status=self._status):
            n = self._status.Get_count(mpi.BYTE)
            buf = bytearray(n)
            self.comm.Recv([buf, mpi.BYTE], source=self.source, tag=TAG)   # already here: no wait
            if self._want is None:
                (self._want,) = _HEAD.unpack(bytes(buf))
                self._parts, self._have = [], 0
                continue
            self._parts.append(bytes(buf))
            self._have += n
            if self._have >= self._want:
                rs = RankState.unpack(b"".join(self._parts))
                self._want, self._parts = None, []
                self.held[rs.step] = rs
                for old in sorted(self.held)[:-2]:
                    del self.held[old]

    def copy_for(self, step: int) -> RankState | None:
        self.drain()
        return self.held.get(step)
