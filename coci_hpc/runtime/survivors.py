"""A survivors' save: when a peer rank vanished, the ranks still alive write the checkpoint of the
last step every rank finished, without any collective that includes the dead rank.

What it writes is an ordinary checkpoint (same HDF5 file and manifest as the collective writer,
world size N, so it loads through the normal path, N -> M reshard included, and counts for
retention); only the way it gets written differs:

1. each survivor posts into ``ROOT/.survivors-<step>/`` the per-rank state it holds for ``step``:
   its own (rolled back to the step boundary, :class:`BoundarySnapshot`) and the copy its dead
   partner sent it (:mod:`.partner`); JSON plus raw bytes, never pickle, written to a temporary
   name and renamed;
2. the first survivor to create ``claim`` (``O_EXCL``) gathers the posted states and hands the
   pieces to the save transaction (:func:`coci_hpc.checkpoint.transaction.save_whole`, one process,
   a serial writer): the replicated state once (every survivor holds all of it in data-parallel
   training), every rank's per-rank state from the posted states;
3. the transaction reads every shard back and checks its CRC-32C, then commits the manifest and
   applies retention (or discards the step directory). Any rank's state missing after ``window_s``, a
   ``Sharded`` tensor (its rows on the dead rank are gone), a model that moved past the step, or a
   failed check: nothing is committed and the previous regular checkpoint stays latest.

State held in parts across ranks (``Sharded`` rows, the DTensor shards of FSDP2 and tensor
parallel) cannot be rebuilt from the survivors and always falls back to the last regular
checkpoint; replicated (DDP) and ``PerRank`` state gain.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import transaction
from coci_hpc.checkpoint.h5_serial import SerialH5Writer
from coci_hpc.checkpoint.layout import REPLICATED_KINDS
from coci_hpc.checkpoint.leaves import LeafKind, PerRank
from coci_hpc.checkpoint.lustre import IOTuning
from coci_hpc.checkpoint.protocol import StorageWriter
from coci_hpc.checkpoint.rng import restore_rng
from coci_hpc.checkpoint.state import collect, is_stateful, with_generators
from coci_hpc.checkpoint.treecode import empty_like_leaf, unflatten
from coci_hpc.comm import Comm
from coci_hpc.runtime import events as ev
from coci_hpc.runtime import staged
from coci_hpc.runtime.partner import PackedCopy, RankState

BACKEND = "hdf5-survivors"
DRAIN_EVERY = 4        # boundaries between taking in the partner's copies (they wait in MPI's queue)


def make_writer() -> StorageWriter:
    """The survivors' writer: one process, serial HDF5 and ``pwrite``. (Fault-injection tests
    replace this function with one that wraps the writer: ``tests/faults/faulty.py``.)"""
    return SerialH5Writer(Comm.serial())


class BoundarySnapshot:
    """The state that changes inside a step before ``optimizer.step()``, taken at each boundary.

    A peer failure surfaces in the middle of the next step (in the gradient allreduce of
    ``loss.backward()``): by then the sampler has drawn the next batch and forward has used the
    RNG and updated module buffers, while parameters and optimizer state are still those of the
    boundary (only ``optimizer.step()`` changes them; :attr:`opt_steps` tells whether it ran).
    So every boundary keeps a copy of everything else: ``state_dict()`` of the stateful values
    that are not modules or optimizers (sampler, scheduler, the session's own state), plain
    trees, module buffers. :meth:`rollback` puts them back before the survivors' save collects.
    """

    def __init__(self, skip: frozenset[str] = frozenset()) -> None:
        # Values whose state_dict() is a collective (the session's planner broadcasts rank 0's
        # view): never called per step, and impossible once a peer is gone.
        self.skip = skip
        self.step = -1
        self.values: dict[str, Any] = {}
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}
        self.opt_steps = 0          # optimizer.step() calls seen when the snapshot was taken

    def take(self, state: Mapping[str, Any], step: int, opt_steps: int) -> None:
        self.step, self.opt_steps = step, opt_steps
        for key, value in with_generators(state).items():  # a generator: its state, not the object
            if key in self.skip:
                continue
            inner = value.value if isinstance(value, PerRank) else value
            if isinstance(inner, torch.optim.Optimizer):
                continue        # its state only changes in step(); param_groups after it (scheduler)
            if isinstance(inner, torch.nn.Module):
                bufs = self.buffers.setdefault(key, {})
                for name, b in inner.named_buffers():
                    if name in bufs and bufs[name].shape == b.shape:
                        bufs[name].copy_(b)   # same device, stream-ordered before any later use
                    else:
                        bufs[name] = b.detach().clone()
                continue
            self.values[key] = copy.deepcopy(inner.state_dict() if is_stateful(inner) else inner)

    def rollback(self, state: Mapping[str, Any]) -> None:
        for key, value in with_generators(state).items():
            if key in self.skip:
                continue
            inner = value.value if isinstance(value, PerRank) else value
            if isinstance(inner, torch.nn.Module):
                saved = self.buffers.get(key, {})
                with torch.no_grad():
                    for name, b in inner.named_buffers():
                        if name in saved:
                            b.copy_(saved[name])
            elif key in self.values:
                if is_stateful(inner):
                    inner.load_state_dict(copy.deepcopy(self.values[key]))
                elif isinstance(inner, dict):
                    inner.clear()
                    inner.update(copy.deepcopy(self.values[key]))


@dataclass
class Outcome:
    step: int
    committed: bool = False
    writer: bool = False            # this rank wrote the checkpoint
    reason: str = ""                # why nothing was committed
    ranks_from_partner: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)   # ranks that posted nothing: lost, as the writer saw it
    write_s: float = 0.0
    path: Path | None = None


def staging_dir(root: Path, step: int) -> Path:
    return cat.staging_dir(root, step)    # the layout is the step catalog's


def post(root: Path, step: int, me: int, states: list[RankState]) -> Path:
    """Put the per-rank states this survivor holds for ``step`` where the writer finds them."""
    staging = cat.Staging(root, step)
    for rs in states:
        staging.post(rs.rank, me, rs.pack())
    return staging.path


def claim(root: Path, step: int) -> bool:
    """Whether this survivor is the one to write ``step``'s save: the first to create ``claim``.
    The claim outlives the save (``Staging.drop_posted`` keeps it) until the next attempt's
    :func:`sweep_torn`, so a rank that runs again late cannot claim the step a second time."""
    return cat.Staging(root, step).claim()


def gather_posted(root: Path, step: int, size: int, window_s: float) -> dict[int, RankState]:
    """The posted states, waiting up to ``window_s`` for every rank of ``size`` to be covered."""
    staging = cat.Staging(root, step)
    end = time.monotonic() + window_s
    found: dict[int, RankState] = {}
    while True:
        for r, _holder, blob in staging.posted():
            if r not in found and 0 <= r < size:
                rs = RankState.unpack(blob)
                if rs.step == step and rs.rank == r:
                    found[r] = rs
        if len(found) == size or time.monotonic() > end:
            return found
        time.sleep(0.05)


def write_checkpoint(root: Path, step: int, state: Mapping[str, Any], per_rank: Mapping[int, RankState],
                     size: int, tuning: IOTuning, keep: int, catalog: cat.StepCatalog | None = None) -> Path:
    """Hand the save transaction the pieces of the N-rank checkpoint of ``step``: ``state``
    (already rolled back) gives the replicated part, ``per_rank`` every rank's own; one process
    writes, checks and commits it (:func:`coci_hpc.checkpoint.transaction.save_whole`).
    ``catalog``: the manager's (None: no manager in this process, one is opened on ``root``)."""
    skel, leaves = collect(state, rng=False)   # device tensors: blocking .cpu() copies (see NCCL in survivors.md)
    parts = held_in_parts(leaves)
    if parts:
        raise ValueError(parts_reason(parts))
    repl = [l for l in leaves if l.kind in REPLICATED_KINDS]
    return transaction.save_whole(make_writer(), cat.catalog_of(catalog if catalog is not None else root), step, (skel[LeafKind.REPLICATED], repl),
                                  [(per_rank[r].skeleton, per_rank[r].leaves) for r in range(size)],
                                  tuning, keep, backend=BACKEND, extra={"survivors_save": True})


def torn_steps(where: Path | cat.StepCatalog) -> list[int]:
    """The steps of earlier survivors' saves that did not commit (a fallback its writer recorded,
    or a writer killed mid-save: its data file without a manifest is an uncommitted leftover the
    catalog removes at the next save). Read only: :func:`sweep_torn` removes their staging.
    ``where``: the root (listed afresh), or the catalog of the restart (its one listing)."""
    return cat.catalog_of(where).torn_staging()


def sweep_torn(where: Path | cat.StepCatalog) -> list[int]:
    """Once a new attempt has recorded its ``attempt_start``: remove the staging directories of
    earlier survivors' saves (a claim left behind would otherwise keep a later survivors' save of
    the same step from being written) and return :func:`torn_steps`. Not before that record: a
    process of the replaced attempt that runs again late is stopped by the claim until then, and
    by the newer ``attempt_start`` after (``Session._peer_lost``). ``where``: as for
    :func:`torn_steps`."""
    return cat.catalog_of(where).sweep_staging()


class _Boundary:
    """The survivors' save of the last step boundary, as a :class:`~coci_hpc.runtime.staged.Source`."""

    def __init__(self, root: Path, step: int, state: Mapping[str, Any], me: int, size: int,
                 held: list[RankState], tuning: IOTuning, keep: int, window_s: float,
                 parts: Sequence[str] | None, catalog: cat.StepCatalog | None, out: Outcome) -> None:
        self.root, self.step, self.state, self.me, self.size, self.held = root, step, state, me, size, held
        self.tuning, self.keep, self.window_s, self.parts, self.catalog = tuning, keep, window_s, parts, catalog
        self.staging, self.out = cat.Staging(root, step), out
        self.found: dict[int, RankState] = {}

    def post(self) -> None:
        post(self.root, self.step, self.me, self.held)

    def known_step(self) -> int | None:
        return self.step

    def refusal(self) -> str:
        parts = self.parts
        if parts is None:
            parts = held_in_parts(collect(self.state, rng=False)[1])
        # decided before waiting for the partner copies: they cannot change it
        return parts_reason(parts) if parts else ""

    def wait(self) -> tuple[int | None, str]:
        self.found = gather_posted(self.root, self.step, self.size, self.window_s)
        missing = [r for r in range(self.size) if r not in self.found]
        if missing:
            return None, (f"no state of rank(s) {missing} for step {self.step} reached the survivors "
                          f"(their partner copy had not arrived)")
        return self.step, ""

    def gather(self, step: int) -> None:
        # The lost ranks: their state came only from a partner's copy.
        self.out.ranks_from_partner = sorted(r for r in self.found if not self.staging.has_own(r))

    def write(self, step: int) -> Path:
        return write_checkpoint(self.root, step, self.state, self.found, self.size, self.tuning, self.keep,
                                self.catalog)

    def already(self, step: int) -> None:
        # The regular save of this step had committed (its manifest is written last) before the
        # peer was lost in that save's last agreement: it is the checkpoint, complete and checked.
        self.out.committed, self.out.path = True, cat.step_dir(self.root, step)
        self.out.reason = f"the regular checkpoint of step {step} had committed"

    def wrote(self, step: int) -> None:
        pass


def save(root: Path, step: int, state: Mapping[str, Any], me: int, size: int, own: RankState,
         partner_copies: list[RankState], tuning: IOTuning, keep: int, window_s: float,
         parts: Sequence[str] | None = None, catalog: cat.StepCatalog | None = None) -> Outcome:
    """This survivor's part of the survivors' save of ``step`` (:func:`coci_hpc.runtime.staged.run`);
    see the module docstring.

    ``parts``: :func:`held_in_parts` of the state, as the session found it at its start on
    every rank (None: found here from the state). ``catalog``: the manager's (None: opened on
    ``root`` if this survivor writes)."""
    out = Outcome(step)
    staged.run(_Boundary(root, step, state, me, size, [own, *partner_copies], tuning, keep, window_s, parts,
                         catalog, out), out, root)
    return out


def held_in_parts(leaves: Sequence[Any]) -> list[str]:
    """The names of the leaves that only some ranks hold a part of (``Sharded`` rows, DTensor
    shards of FSDP2 / tensor parallel): a survivors' save cannot rebuild a lost rank's part, so it
    falls back. Taken from the flattened leaves' kinds, which every rank has after the same
    collective ``collect``: no ``state_dict()`` is ever called on one rank only for it (some are
    collective, and would hang)."""
    return [l.name for l in leaves if l.kind not in REPLICATED_KINDS and l.kind != LeafKind.PER_RANK]


def parts_reason(names: Sequence[str]) -> str:
    """Why a survivors' save of state with ``names`` (:func:`held_in_parts`) falls back."""
    return (f"state held in parts across ranks ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}: "
            f"Sharded tensors or DTensor shards such as FSDP2's) has parts only the lost rank held; "
            f"the run falls back to the last regular checkpoint")


def coverage_estimate(events: ev.Lines, eligible: bool) -> float:
    """The share of failures the planner may count on the survivors' save to cover (they lose
    ~one step instead of the work since the last checkpoint): 0 when the run cannot gain (saves
    off, no MPI, one rank, ``Sharded`` state), else Laplace's rule of succession over this run's
    ``peer_lost`` records, (committed + 1) / (records + 2): 1/2 before any failure, 0.9 after
    8 committed saves of 8, lower with every fallback."""
    if not eligible:
        return 0.0
    lost = [e for e in ev.records(events) if isinstance(e, ev.PeerLost)]
    committed = sum(1 for e in lost if e.committed)
    return (committed + 1) / (len(lost) + 2)


def _modules(state: Mapping[str, Any]) -> list[torch.nn.Module]:
    """The models at the top of the state (also inside ``PerRank``), each once."""
    found: list[torch.nn.Module] = []
    for value in state.values():
        inner = value.value if isinstance(value, PerRank) else value
        if isinstance(inner, torch.nn.Module) and not any(inner is m for m in found):
            found.append(inner)
    return found


def restore_own_rng(own: RankState) -> None:
    """Put this rank's RNG streams back to ``own`` (its boundary copy) before collecting."""
    rng_skel = own.skeleton.get("__rng__")
    if rng_skel is None:
        return
    tensors = {}
    for leaf in own.leaves:
        obj, view = empty_like_leaf(leaf.dtype, leaf.shape)
        if leaf.array is not None:
            view[:] = leaf.array
        tensors[leaf.name] = obj
    restore_rng(unflatten(rng_skel, tensors))


class Survival:
    """The session's side of a peer failure: the per-step copies and, when a peer is lost, the
    survivors' save, the event record, the requeue and the exit.

    Per step it costs one raw capture of the per-rank state (python/numpy/torch RNG: ~10 KB
    copied from the generators into a preallocated buffer, :class:`~.partner.Capturer`), its
    ``Isend`` to the partner in three pieces, ``Iprobe``/``Recv`` of the copy coming the other way
    into preallocated buffers, and the :class:`BoundarySnapshot` of the small replicated values.
    """

    def __init__(self, state: Mapping[str, Any], comm: Comm, *, ranks_per_node: int, enabled: bool = True,
                 skip: frozenset[str] = frozenset(), copy_at_forward: bool = True) -> None:
        from coci_hpc.checkpoint.state import find_optimizers
        from coci_hpc.runtime.partner import Capturer, PartnerCopy

        self.state = state
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.enabled = enabled and comm.is_mpi and comm.size > 1
        self.why_not = "" if self.enabled else (
            "survivors' saves are off (COCI_SURVIVORS=0)" if not enabled else
            "survivors' saves need MPI and 2 or more ranks (the partner copies travel over MPI)")
        self.partner = PartnerCopy(comm.mpi_comm.Dup(), ranks_per_node) if self.enabled else None
        self.capturer = Capturer(state, self.rank) if self.enabled else None
        self.snapshot = BoundarySnapshot(skip)
        self.own: PackedCopy | None = None    # this rank's last copy, undecoded
        # Its copy of the last boundary: at forward the next step's copy replaces ``own``, while a
        # failure surfacing in that step's backward still saves the boundary (:meth:`own_for`).
        self.own_boundary: PackedCopy | None = None
        self.opt_steps = 0
        self.memtier: Any = None         # state held in parts: the memory tier (runtime/memtier.py), set by the Session
        self._hook_mode = True          # copy at the optimizer step (see partner.py), else at the boundary
        self._forward_copies = copy_at_forward
        self._boundary = 0
        self._drains = 0
        self._hooks = []
        if self.enabled:
            opts = find_optimizers(dict(state))
            self._hook_mode = bool(opts)
            for opt in opts:
                self._hooks.append(opt.register_step_pre_hook(self._pre_hook))
            # The step's copy leaves at the end of each forward of a model in the state too, so
            # before the gradient allreduce that lets the peers finish the step (backward comes
            # after forward): a rank killed anywhere after that allreduce has sent its copy.
            # (copy_at_forward=False: the optimizer-step copy alone, as before; for the benchmark.)
            for module in _modules(state) if copy_at_forward else []:
                self._hooks.append(module.register_forward_hook(self._forward_hook))

    def _forward_hook(self, *_: Any) -> None:
        if self._hook_mode and self.opt_steps == self.snapshot.opt_steps:
            self._copy(self._boundary + 1)     # no optimizer step yet in this step

    def _pre_hook(self, *_: Any) -> None:
        self.opt_steps += 1
        if not self._hook_mode:
            return
        if self.opt_steps - self.snapshot.opt_steps > 1:
            self._hook_mode = False   # several optimizer steps per step: the boundary copy is the safe one
            return
        if self._forward_copies and self.own is not None and self.own.step == self._boundary + 1:
            return                    # sent at this step's forward: one capture per step, as before
        self._copy(self._boundary + 1)

    def _copy(self, step: int) -> None:
        assert self.partner is not None and self.capturer is not None
        self.own, sendable = self.capturer.capture(step, keep=self.partner.ref, hold=self.own_boundary)
        if sendable:
            self.partner.send(self.own)

    def boundary(self, step: int) -> None:
        """At each step boundary (and after the restore): ``step`` steps are done."""
        if not self.enabled:
            return
        if self.own is None or self.own.step != step or not self._hook_mode:
            self._copy(step)
        self.own_boundary = self.own
        self._boundary = step
        self.snapshot.take(self.state, step, self.opt_steps)
        assert self.partner is not None
        # What arrived waits in MPI's queue (eager: it stays there if its sender dies) and
        # copy_for() drains before it decodes, so taking it in every few steps is enough.
        self._drains += 1
        if self._drains >= DRAIN_EVERY:
            self._drains = 0
            self.partner.drain()
        if self.memtier is not None:     # every k steps the whole state of each rank to its partner
            self.memtier.boundary(step)

    @property
    def memory_every(self) -> int | None:
        """The memory tier's interval in steps, None without it."""
        return None if self.memtier is None else self.memtier.every

    def own_for(self, step: int) -> PackedCopy | None:
        """This rank's own copy of ``step`` (the last one taken, or the boundary's), or None."""
        for c in (self.own, self.own_boundary):
            if c is not None and c.step == step:
                return c
        return None

    def close(self) -> None:
        """The loop ended: the hooks come off and the partner links close (a peer still sending
        finds its link broken, which it ignores)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for link in (getattr(self.partner, "link", None), getattr(self.memtier, "link", None)):
            if link is not None:
                link.close()
