"""The memory tier: every ``k`` steps, each rank's state is copied to a partner rank on another
node, so that a lost rank's *shards* (FSDP2 / tensor-parallel DTensor parameters and optimizer
moments, which exist nowhere else) survive a node failure, and the survivors' save can write the
newest step every rank's state is held for (:func:`survivors_save`).

Per memory-tier step (at the step boundary, where the state is that of the step's end):

1. the rank's state is flattened (:func:`~coci_hpc.checkpoint.state.collect`, all ranks at the same
   boundary, so a ``state_dict()`` that is a collective is fine) and its bytes are copied into one
   of two REUSED host buffers (:class:`Slot`: a JSON header of the skeletons and leaf
   descriptions, then the raw leaf bytes; never pickle). Device tensors go straight into the
   slot's page-locked memory, queued on a side copy stream and waited for once before the send
   (:func:`copy_state`); host tensors are copied as they are;
2. a non-blocking send of that buffer to the partner starts (over a TCP connection of our own,
   :class:`~coci_hpc.runtime.partner.PartnerLink`, the per-rank copy's transport too, which says
   why not MPI); the copy coming the other way is taken in, as it arrives, into one of two reused
   receive buffers, and both are only *tested* at later boundaries (never waited on: a dead peer
   would block a wait forever). The transfer overlaps the next steps; a new memory-tier step
   whose previous exchange has not finished is skipped (counted in :attr:`MemoryTier.skipped`).

Host memory: two slots of the rank's own state and two of its source's (the newest complete
copy is kept while the next one arrives), i.e. about 4x the rank's share of the state (its shards
plus the small replicated and per-rank values). Fewer would open a window: two mutual partners
both sending step S, one dies before its S has arrived; the survivor can write the previous step
only if it still holds its own copy of it (docs/explanation/memory-tier.md, "What it costs"). A slot grows only when the state does (the first
step that creates optimizer moments); in steady state nothing is allocated per step.

Partner of rank r: :func:`~coci_hpc.runtime.partner.partner_of` (the same local rank on the next
node when Slurm says how many ranks run per node), as for the per-step per-rank copy; with HSDP
that partner is the rank's replica in the next node's group when the replicate dimension spans
nodes (its shards are the same, the copy costs one more buffer but keeps one code path).

A data-parallel run (no DTensor / ``Sharded`` state) has nothing here: its survivors hold the
replicated state at the last step and the per-step per-rank copy (:mod:`.partner`) covers the rest.
Except under NCCL, where the survivors never read device memory after a lost peer
(:mod:`.ncclwatch`): there the tier holds every state.
"""
from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coci_hpc import settings
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import devices, transaction
from coci_hpc.checkpoint.layout import REPLICATED_KINDS
from coci_hpc.checkpoint.leaves import LeafKind, storage_dtype
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.state import collect
from coci_hpc.checkpoint.treecode import Leaf
from coci_hpc.comm import Comm
from coci_hpc.errors import UsageError
from coci_hpc.runtime import staged
from coci_hpc.runtime.partner import PartnerLink

TAG = 0xC0C2
HEAD = struct.Struct("<4sIqQ")      # magic, rank, step, header JSON bytes
MAGIC = b"MEM1"
ALIGN = 64                          # each leaf's bytes start on a 64-byte boundary in a slot
SLOTS_PER_SIDE = 2
REPLAN_EVERY = 200      # steps between two-tier plans on rank 0
PLAN_MARGIN = 10        # steps between a plan's message and the step every rank applies it at
OFF_EVERY = 1 << 62     # "every" when the plan drops the memory tier
BACKEND = "hdf5-memtier"


QUIET_S = 1.0   # survivors' save from the tier: no new copy for this long -> decide (see survivors_save)

def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Snapshot:
    """One rank's state at ``step``, decoded from a slot (leaf arrays are views of its bytes)."""

    rank: int
    step: int
    skeletons: dict[str, Any]
    leaves: list[Leaf]


def pack_into(slot: Slot, rank: int, step: int, skeletons: Mapping[str, Any], leaves: list[Leaf],
              copies: devices.HostCopies | None = None) -> None:
    """Copy the state (``collect``'s skeletons and leaves) into ``slot``, growing it only if needed.

    Leaves left on the device (``collect(defer_device=True)``) need ``copies``: their copies are
    only queued, straight into the slot's page-locked buffer (no host tensor per leaf), and the
    slot's bytes are whole only after ``copies.wait()``."""
    descs = [[l.name, l.dtype, list(l.shape), l.kind, l.nbytes,
              [list(l.box[0]), list(l.box[1])] if l.box else None] for l in leaves]
    head = json.dumps({"skeletons": skeletons, "leaves": descs}, separators=(",", ":")).encode()
    pos = _pad(HEAD.size + len(head))
    offsets = []
    for l in leaves:
        offsets.append(pos)
        pos = _pad(pos + l.nbytes)
    on_device = any(l.array is None and l.nbytes for l in leaves)
    if on_device and copies is None:
        name = next(l.name for l in leaves if l.array is None and l.nbytes)
        raise ValueError(f"{name} is not in host memory (a device tensor left for a later copy)")
    slot.ensure(pos, pin=on_device)
    buf = slot.buf
    HEAD.pack_into(buf, 0, MAGIC, rank, step, len(head))
    buf[HEAD.size:HEAD.size + len(head)] = np.frombuffer(head, dtype=np.uint8)
    for l, o in zip(leaves, offsets):
        if l.nbytes:
            if l.array is None:
                assert copies is not None and slot.tensor is not None and l.source is not None
                # Safe: queued after the step's work (HostCopies orders its stream after the current
                # one) into a slot whose last send completed; the caller waits before sending it.
                copies.copy(slot.tensor[o:o + l.nbytes], l.source)
            else:
                buf[o:o + l.nbytes] = l.array.view(np.uint8)
    slot.nbytes, slot.rank = pos, rank
    # With device copies queued the slot is not whole yet (a survivors' save must not post it):
    # the caller marks it after their wait (copy_state).
    slot.step = step if copies is None or not copies.issued else -1


def copy_state(slot: Slot, rank: int, step: int, state: Mapping[str, Any],
               whole: Callable[[], bool] = lambda: True) -> bool:
    """The state now into ``slot`` (one memory-tier copy): device tensors straight into its
    page-locked buffer with non-blocking copies on the side stream, waited for once here; host
    tensors copied as before. The slot is marked whole (``slot.step``), and may be sent, only after
    the wait and only if ``whole()`` still says so then (False: a lost peer froze the tier while the
    copy waited; the slot stays not whole). Returns whether it was marked."""
    skeletons, leaves = collect(state, rng=True, defer_device=True)
    copies = devices.HostCopies()
    slot.step = -1
    pack_into(slot, rank, step, skeletons, leaves, copies)
    copies.wait()       # before the send reads the slot (and before the next pack rewrites it)
    if not whole():
        slot.step = -1
        return False
    slot.step = step
    return True


def decode(data: Any) -> Snapshot:
    """A slot's bytes as a :class:`Snapshot`; ValueError when they are not a whole copy."""
    if data.size < HEAD.size:
        raise ValueError("truncated memory-tier copy (no header)")
    magic, rank, step, hlen = HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError(f"not a memory-tier copy (magic {magic!r})")
    head = json.loads(bytes(data[HEAD.size:HEAD.size + hlen]))
    pos = _pad(HEAD.size + hlen)
    leaves = []
    for name, dtype, shape, kind, nbytes, box in head["leaves"]:
        if pos + nbytes > data.size:
            raise ValueError(f"truncated memory-tier copy of rank {rank} (leaf {name})")
        raw = data[pos:pos + nbytes]
        arr = raw.view(storage_dtype(dtype)) if nbytes else raw
        b = (tuple(box[0]), tuple(box[1])) if box else ()
        leaves.append(Leaf(name, dtype, tuple(shape), arr, kind, int(nbytes), box=b))
        pos = _pad(pos + nbytes)
    return Snapshot(int(rank), int(step), head["skeletons"], leaves)


class Slot:
    """A reused host buffer holding one packed copy: its bytes are ``buf[:nbytes]``."""

    def __init__(self) -> None:
        self.buf: Any = np.zeros(0, dtype=np.uint8)
        self.tensor: torch.Tensor | None = None   # a torch view of buf when page-locked (device copies land there)
        self.nbytes = 0
        self.step = -1
        self.rank = -1
        self.allocations = 0        # how often the buffer was (re)allocated: steady state adds none

    def ensure(self, n: int, pin: bool = False) -> None:
        """At least ``n`` bytes; page-locked when ``pin`` (the state has device tensors). Only when
        the slot is not being sent or read (its send completed, its copies were waited for)."""
        grow = self.buf.size < n
        if grow or pin != (self.tensor is not None):
            size = n + n // 16 if grow else self.buf.size    # a little headroom: skeletons vary
            old, old_pinned = self.buf, self.tensor is not None
            self.buf = devices.pinned_host(size) if pin else np.zeros(size, dtype=np.uint8)
            self.tensor = torch.from_numpy(self.buf) if pin else None
            if old_pinned:
                devices.release_host(old)
            self.allocations += 1

    def snapshot(self) -> Snapshot:
        return decode(self.buf[:self.nbytes])


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def estimate_bytes(leaves: list[Leaf], optimizer_state_empty: bool) -> int:
    """Host memory the tier needs on this rank: 2 own slots + 2 of the partner's (~equal share).
    Before the first optimizer step Adam's moments do not exist yet: counted as 2x the rest."""
    state = sum(l.nbytes for l in leaves)
    if optimizer_state_empty:
        state *= 3
    return 2 * SLOTS_PER_SIDE * state


def switch_step(step: int, every: int, phase: int) -> int:
    """The step a k planned at ``step`` takes over from, under copies every ``every`` steps from
    ``phase``: at least ``PLAN_MARGIN`` steps on (every rank has the small eager message by then;
    twice a small k, so a copy or two under the old k come first), not before ``phase``, and a
    copy step of the old k unless the tier is off (``OFF_EVERY``): the copies just before and just
    after the switch are then the old and the new k apart, never a step apart."""
    if every >= OFF_EVERY:          # no copies to keep apart (a margin of twice "off" never came)
        return max(step + PLAN_MARGIN, phase)
    at = max(step + max(PLAN_MARGIN, 2 * every), phase)
    return at + -(at - phase) % every


class MemoryTier:
    """One rank's side of the memory tier; MPI only (``mpi_comm`` a duplicate of the world)."""

    def __init__(self, state_fn: Callable[[], Mapping[str, Any]], mpi_comm: Any, ranks_per_node: int,
                 every: int) -> None:
        from mpi4py import MPI

        self.state_fn = state_fn
        self.comm = mpi_comm
        self.link = PartnerLink(mpi_comm, ranks_per_node, TAG)      # the per-rank copy's transport too
        self.rank, self.size = self.link.rank, self.link.size
        self.every = max(1, int(every))
        # Copies at the steps s with (s - phase) % every == 0. A plan's k takes over at a copy step
        # of the old k, which becomes the new phase: the copy before and the one after are then
        # exactly the old and the new k apart. At the new k's own multiples they could be a step
        # apart, and the second would find the first still in flight (skipped: CI, 2026-11-29).
        self.phase = 0
        self.partner, self.source = self.link.partner, self.link.source
        self.own = [Slot() for _ in range(SLOTS_PER_SIDE)]
        self.recv = [Slot() for _ in range(SLOTS_PER_SIDE)]
        self._send_req: Any = None
        self._recv_req: Any = None
        self._recv_slot: Slot | None = None
        self.complete: Slot | None = None      # the newest complete copy from ``source``
        self.skipped = 0
        self.copies = 0
        self.copy_s: list[float] = []          # what each copy blocked the step for (flatten + pack + send)
        # The two-tier plan (rank 0 computes it off the loop, every rank applies it at one step):
        self.plan_fn: Callable[[list[float]], tuple[int | None, int] | None] | None = None
        self._plan_thread: Any = None
        self._plan_result: list[Any] = []
        self._plan_buf = np.zeros(2, dtype=np.int64)    # (k, from step) as received
        self._plan_sends: list[Any] = []
        self._next_k: tuple[int, int] | None = None      # (k, from step)
        self.planned: tuple[int | None, int] | None = None
        self._byte = MPI.BYTE
        # Set by the peer-loss path under NCCL before it aborts the communicator (runtime/ncclwatch.py):
        # a device copy that returns after that may hold a half-finished step, and must never become a slot.
        self.frozen = False
        self._poll_lock = threading.Lock()     # poll() from the main thread and a survivors' save on another

    # -- per step ------------------------------------------------------------------------------
    def boundary(self, step: int) -> None:
        """At each step boundary: progress the exchange in flight; every ``every`` steps start one."""
        if self.frozen:
            return
        self.poll()
        self._plan_progress(step)
        if (step - self.phase) % self.every:
            return
        if self._send_req is not None:
            self.skipped += 1          # the partner has not taken the last copy yet: keep it
            return
        t0 = time.perf_counter()
        slot = min(self.own, key=lambda s: s.step)   # the older own copy; its send has finished
        # The slot is reused only once its last send completed (_send_req is None above), and
        # pack_into rewrites every byte: host leaves now, device leaves queued on the side stream.
        slot.step = -1      # not a whole copy while it is rewritten: a survivors' save skips it
        # A peer lost while the device copy waited (frozen): its bytes may be garbage, never whole.
        if not copy_state(slot, self.rank, step, self.state_fn(), whole=lambda: not self.frozen):
            return
        self._send_req = self.link.isend(self.link.spec(slot.buf[:slot.nbytes]))
        self.copies += 1
        self.poll()
        self.copy_s.append(time.perf_counter() - t0)
        del self.copy_s[:-20]

    # -- k from the two-tier planner -------------------------------------------------------------
    def _plan_progress(self, step: int) -> None:
        """Rank 0 plans (``plan_fn``, in a thread: the simulation takes a second or two) every
        ``REPLAN_EVERY`` steps once a copy was timed, and sends every rank (k, the step it applies
        from: :func:`switch_step`); every rank switches at that same step, so the memory-tier steps
        stay the same on all ranks."""
        if self.rank == 0 and self.plan_fn is not None:
            if self._plan_thread is None and self.copy_s and step % REPLAN_EVERY == 0:
                import threading

                fn, costs = self.plan_fn, list(self.copy_s)
                self._plan_thread = threading.Thread(target=lambda: self._plan_result.append(fn(costs)),
                                                     name="coci-memtier-plan", daemon=True)
                self._plan_thread.start()
            elif self._plan_thread is not None and not self._plan_thread.is_alive():
                self._plan_thread = None
                got = self._plan_result.pop() if self._plan_result else None
                k = 0 if got is None else (got[0] or 0)      # None: the plan drops the memory tier
                every, phase = self._in_force()
                if got is not None and (k or OFF_EVERY) != every:   # only a change travels
                    self.planned = got
                    msg = np.array([k, switch_step(step, every, phase)], dtype=np.int64)
                    self._plan_sends = [self.comm.Isend([msg, self._byte], r, TAG + 1) for r in range(self.size)]
                    self._plan_msg = msg
        if self.comm.Iprobe(source=0, tag=TAG + 1):
            self.comm.Recv([self._plan_buf, self._byte], source=0, tag=TAG + 1)
            self._next_k = (int(self._plan_buf[0]), int(self._plan_buf[1]))
        if self._next_k is not None and step >= self._next_k[1]:
            k, self.phase = self._next_k
            self._next_k = None
            # k = 0: the plan says the tier does not pay; copies stop (the buffers stay for a
            # later plan that brings it back)
            self.every = k if k > 0 else OFF_EVERY

    def _in_force(self) -> tuple[int, int]:
        """(every, phase) once what is planned has applied: a plan sent but not applied yet counts
        (what a new plan is compared with, and switches from)."""
        if self._next_k is not None:
            return self._next_k[0] or OFF_EVERY, self._next_k[1]
        return self.every, self.phase

    def poll(self) -> None:
        """Non-blocking: finish what has finished, take in a copy that has started to arrive."""
        with self._poll_lock:
            self._poll()

    def _poll(self) -> None:
        if self._send_req is not None and self._send_req.Test():
            self._send_req = None
        if self._recv_req is None and (n := self.link.arrived()) is not None:
            slot = next(s for s in self.recv if s is not self.complete)
            slot.ensure(n)
            slot.nbytes, slot.step = n, -1
            self._recv_slot = slot
            self._recv_req = self.link.irecv(slot.buf[:n])
        if self._recv_req is not None and self._recv_req.Test():
            got = self._recv_slot
            assert got is not None
            self._recv_req, self._recv_slot = None, None
            _, rank, step, _ = HEAD.unpack_from(got.buf, 0)
            got.rank, got.step = int(rank), int(step)
            self.complete = got

    # -- after a failure -----------------------------------------------------------------------
    def held(self) -> list[tuple[int, Slot]]:
        """(rank, slot) of every copy this rank holds whole: its own and its source's newest."""
        self.poll()
        out = [(self.rank, s) for s in self.own if s.step >= 0]
        if self.complete is not None:
            out.append((self.complete.rank, self.complete))
        return out

    def allocations(self) -> int:
        return sum(s.allocations for s in (*self.own, *self.recv))


# -- the survivors' save from the memory tier ------------------------------------------------------
@dataclass
class TierOutcome:
    """What the memory tier's survivors' save did. ``tier``: "memory" when it committed, else
    "disk" (the run falls back to the last disk checkpoint)."""

    boundary: int
    step: int | None = None
    committed: bool = False
    writer: bool = False
    tier: str = "disk"
    reason: str = ""
    ranks_from_partner: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)   # ranks that posted nothing: lost, as the writer saw it
    write_s: float = 0.0
    path: Path | None = None


def newest_whole(found: Mapping[int, Mapping[int, Any]], size: int) -> int | None:
    """The newest step that a copy of every rank's state is posted for."""
    whole = [s for s, ranks in found.items() if all(r in ranks for r in range(size))]
    return max(whole) if whole else None


class _TierSource:
    """The survivors' save from the memory tier, as a :class:`~coci_hpc.runtime.staged.Source`."""

    def __init__(self, root: Path, boundary: int, tier: MemoryTier, tuning: IOTuning, keep: int, window_s: float,
                 catalog: cat.StepCatalog | None, out: TierOutcome) -> None:
        self.root, self.tier, self.tuning, self.keep, self.window_s = root, tier, tuning, keep, window_s
        self.catalog, self.out, self.size = catalog, out, tier.size
        self.staging = cat.TierStaging(root, boundary)
        self.found: dict[int, dict[int, tuple[int, Path]]] = {}
        self.snaps: dict[int, Snapshot] = {}

    def post(self) -> None:
        for rank, slot in sorted(self.tier.held(), key=lambda x: -x[1].step):     # newest first
            self.staging.post_at(slot.step, rank, self.tier.rank, memoryview(slot.buf)[:slot.nbytes])

    def known_step(self) -> int | None:
        return None   # the newest step that turns out whole

    def refusal(self) -> str:
        return ""     # state held in parts is what the tier is for

    def wait(self) -> tuple[int | None, str]:
        staging, end = self.staging, time.monotonic() + self.window_s
        seen: set[tuple[int, int]] = set()
        quiet_since = time.monotonic()
        while True:
            found = staging.posted_at()
            step = newest_whole(found, self.size)
            # Wait for the newest step any survivor holds to become whole (or the window to end).
            now = time.monotonic()
            if (step is not None and step == max(found)) or now > end:
                break
            # The survivors post as soon as they see the loss, and Slurm kills them KillWait after a
            # node failure (30 s by default, 5 s on the local cluster): once no copy has arrived for
            # QUIET_S and none is being written, the missing one is not coming (a rank and its
            # partner both lost), so decide now and leave time to record it.
            posted = {(s, r) for s, ranks in found.items() for r in ranks}
            if posted != seen:
                seen, quiet_since = posted, now
            elif now - quiet_since > QUIET_S and not staging.writing():
                break
            time.sleep(0.05)
        self.found = found
        if step is None:
            missing = sorted(set(range(self.size)) - {r for ranks in found.values() for r in ranks})
            return None, (f"no memory-tier copy of rank(s) {missing} survived (a rank and its partner were both "
                          f"lost, or the first copy had not arrived): the disk tier serves")
        self.out.step = step
        return step, ""

    def gather(self, step: int) -> None:
        self.snaps = {r: decode(np.frombuffer(p.read_bytes(), dtype=np.uint8)) for r, (_, p) in self.found[step].items()}
        self.out.ranks_from_partner = sorted(r for r, (holder, _) in self.found[step].items() if holder != r)

    def write(self, step: int) -> Path:
        return write_snapshots(self.root, step, self.snaps, self.size, self.tuning, self.keep, self.catalog)

    def already(self, step: int) -> None:
        self.out.committed, self.out.tier, self.out.path = True, "memory", cat.step_dir(self.root, step)
        self.out.reason = f"the disk checkpoint of step {step} had committed"

    def wrote(self, step: int) -> None:
        self.out.tier = "memory"


def survivors_save(root: Path, boundary: int, tier: MemoryTier, tuning: IOTuning, keep: int,
                   window_s: float, catalog: cat.StepCatalog | None = None) -> TierOutcome:
    """This survivor's part of a save from the memory tier (:func:`coci_hpc.runtime.staged.run`):
    post what it holds (the step catalog's :class:`~coci_hpc.checkpoint.catalog.TierStaging`);
    the first to claim waits up to ``window_s`` for a step that every rank's state is posted for
    and hands its pieces to the save transaction (:func:`write_snapshots`). No step whole (a rank
    and its partner both lost): nothing is written, the run falls back to the disk tier, and the
    outcome says so. ``catalog``: the manager's (None: opened on ``root`` if this survivor writes)."""
    out = TierOutcome(boundary)
    staged.run(_TierSource(root, boundary, tier, tuning, keep, window_s, catalog, out), out, root)
    return out


def write_snapshots(root: Path, step: int, snaps: Mapping[int, Snapshot], size: int, tuning: IOTuning,
                    keep: int, catalog: cat.StepCatalog | None = None) -> Path:
    """Hand the save transaction (:func:`coci_hpc.checkpoint.transaction.save_whole`: one process
    writes, reads back, seals, aborts on failure) the N-rank checkpoint of ``step`` from every
    rank's memory-tier copy: the replicated leaves from rank 0's copy, each rank's per-rank
    leaves and parts (DTensor boxes, ``Sharded`` rows) from its own. ``catalog``: the manager's
    (None: one is opened on ``root``)."""
    from coci_hpc.runtime.survivors import make_writer

    missing = [r for r in range(size) if r not in snaps]
    if missing:
        raise KeyError(f"no memory-tier copy of rank(s) {missing} for step {step}")
    base = snaps[0]
    repl = [l for l in base.leaves if l.kind in REPLICATED_KINDS]
    per_rank = [(snaps[r].skeletons[LeafKind.PER_RANK], [l for l in snaps[r].leaves if l.kind not in REPLICATED_KINDS])
                for r in range(size)]
    return transaction.save_whole(make_writer(), cat.catalog_of(catalog if catalog is not None else root), step,
                                  (base.skeletons[LeafKind.REPLICATED], repl), per_rank, tuning, keep, backend=BACKEND,
                                  extra={"survivors_save": True, "memory_tier": True})


# -- the session's choice ------------------------------------------------------------------------
DEFAULT_EVERY = settings.MEMTIER_EVERY   # until the planner has measured costs (``COCI_MEMTIER_K`` unset)


def for_session(state_fn: Callable[[], Mapping[str, Any]], comm: Comm, ranks_per_node: int, parts: list[str],
                enabled: bool, environ: Mapping[str, str] | None, say: Callable[[str], None],
                plan_fn: Callable[[list[float]], tuple[int | None, int] | None] | None = None,
                available: Callable[[], int | None] = host_available_bytes,
                host_copies: bool = False) -> MemoryTier | None:
    """The memory tier of a Session, or None: only for state held in parts (DTensor / ``Sharded``
    leaves; data-parallel state is covered by the survivors and the per-step per-rank copy), with
    survivors' saves on (MPI, 2+ ranks). ``host_copies`` (under NCCL, where the survivors never
    read device memory after a lost peer, :mod:`.ncclwatch`): for every state, data-parallel too.
    Collective (every rank at ``Session()``): when the host
    memory of ANY rank would not hold the tier's buffers (:func:`estimate_bytes` against
    MemAvailable), the tier is turned off on every rank and rank 0 says so; the run goes on with
    the disk tier alone. ``plan_fn`` (:func:`plan_with`) sets ``k`` from the two-tier planner
    unless ``COCI_MEMTIER_K`` fixes it."""
    try:
        fixed = settings.MEMTIER_K.get(environ)
    except ValueError as exc:
        raise UsageError(str(exc), hint=f"set {settings.MEMTIER_K.name} to a step count (0: no memory tier), "
                                        f"or unset it to let the two-tier planner choose") from None
    every = DEFAULT_EVERY if fixed is None else fixed
    if (not parts and not host_copies) or not enabled:
        return None
    if every <= 0:
        if host_copies and comm.rank == 0:
            say(f"memory tier off ({settings.MEMTIER_K.name}=0): under NCCL a lost peer leaves no host copy to "
                f"save from, and the run falls back to its last disk checkpoint")
        return None
    from coci_hpc.checkpoint.state import find_optimizers

    leaves = collect(state_fn(), rng=True)[1]
    empty = any(not opt.state for opt in find_optimizers(dict(state_fn())))
    need = estimate_bytes(leaves, empty)
    have = available()
    short = have is not None and need > have
    all_short = comm.allgather((short, need, have))
    if any(s for s, _, _ in all_short):
        if comm.rank == 0:
            r = next(i for i, (s, _, _) in enumerate(all_short) if s)
            _, n, h = all_short[r]
            say(f"memory tier off: rank {r} would need ~{n / 2**30:.3g} GiB of host memory for it (2 copies of "
                f"its state and 2 of its partner's) and {(h or 0) / 2**30:.3g} GiB are available; a lost rank falls back "
                f"to the last disk checkpoint")
        return None
    tier = MemoryTier(state_fn, comm.mpi_comm.Dup(), ranks_per_node, every)
    tier.plan_fn = None if fixed is not None else plan_fn
    if comm.rank == 0:
        say(f"memory tier on: every {tier.every} step(s) each rank's state goes to its partner "
            f"(rank r -> {tier.partner - tier.rank:+d} mod {tier.size}); ~{need / 2**30:.3g} GiB host memory per rank")
    return tier


def plan_with(schedule: Any, horizon_s: float, say: Callable[[str], None],
              environ: Mapping[str, str] | None = None, events_path: Any = None, log: Any = None,
              ) -> Callable[[list[float]], tuple[int | None, int] | None]:
    """The session's ``plan_fn``: the two-tier plan (:mod:`coci_hpc.planner.two_tier`) for the
    schedule's nodes from its failure model and measured costs (disk save stall, restart, step
    time) and the copies' measured stall; None until a disk save has been timed. Says the plan
    when it changes, with why each interval is what it is. The whole-job model
    (:mod:`coci_hpc.planner.whole_job`): ``COCI_WHOLE_JOB_SHARE``/``COCI_OUTAGE_RATE`` from
    ``environ`` (checked here, on every rank: a bad value stops the start, naming it), the run's
    own event log (``events_path``: its attempts that ended whole), the priors. ``log`` (the
    Session's :class:`~coci_hpc.runtime.events.EventLog`) gets a ``two_tier_plan`` record per
    change, for coci-status."""
    from coci_hpc.planner import whole_job as wjm
    given = wjm.given_from_settings(environ)
    last: list[Any] = [None]
    learned: list[Any] = []

    def whole_job() -> dict:
        if not learned:      # once per attempt: the log's earlier attempts do not change
            from coci_hpc.runtime import events as ev
            share = None
            try:
                if events_path is not None and os.path.isfile(events_path):
                    share = ev.whole_job_ends(ev.read_records(events_path))
            except OSError:
                share = None     # the log is the run's record, not the plan's input: plan without it
            learned.append(share)
        return {**given, "learned_share": learned[0]}

    def plan(copy_s: list[float]) -> tuple[int | None, int] | None:
        from coci_hpc.planner import two_tier

        model = getattr(schedule, "failure_model", None)
        if model is None or not schedule.measured:
            return None
        c = schedule.costs()
        if not c.step_time_s:
            return None
        mem = float(np.median(copy_s))
        tc = two_tier.TierCosts(mem, c.ckpt_s, c.restart_s, c.restart_s, c.step_time_s)
        p = two_tier.plan_two_tier(tc, two_tier.profile_from_model(model, schedule.nodes, whole_job=whole_job()),
                                   horizon_s)
        out = (p.mem_every_steps, p.disk_every_steps)
        if out != last[0]:
            last[0] = out
            say(f"two-tier plan: {p.reason}; memory copy every {p.mem_every_steps or '-'} step(s), "
                f"disk save every {p.disk_every_steps} step(s): {p.disk_reason}")
            if log is not None:
                from coci_hpc.runtime.events import TwoTierPlan
                log.write(TwoTierPlan(memory_every=p.mem_every_steps, disk_every=p.disk_every_steps,
                                      reason=p.reason, disk_reason=p.disk_reason))
        return out
    return plan
