"""A torch.distributed.checkpoint ``StorageReader`` over a coci checkpoint.

    import torch.distributed.checkpoint as dcp
    from coci_hpc.interop import CociStorageReader

    sd = model.state_dict()                  # plain tensors, or DTensors of any mesh/placements
    dcp.load(sd, storage_reader=CociStorageReader("/scratch/ckpt"))     # newest committed step
    model.load_state_dict(sd)                # (FSDP2/DTensor: already loaded in place)

Each tensor of the model (state key ``model``, or ``model_key=``) is published as ONE chunk of
its global shape under its cleaned state-dict name (``fc.weight``; wrapper prefixes removed, see
:mod:`.names`). DCP's planner then asks for the slice each rank needs (a DTensor target: only
its local box); the reader reads the rows that box spans from the HDF5 dataset, checked against
their shards' CRCs, and narrows the other dims. ``with_others=True`` also publishes every other
replicated state value under ``<key>.<path>`` (``optimizer.state.fc1.weight.exp_avg``).
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.errors import UsageError
from coci_hpc.interop.source import MODEL_KEY, CheckpointSource, Entry, export_name, torch_dtype


class CociStorageReader(StorageReader):
    """Read step ``step`` (default: newest committed) of the coci checkpoint under ``path``."""

    def __init__(self, path: str | os.PathLike, step: int | None = None, *, model_key: str = MODEL_KEY,
                 with_others: bool = False) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.step = step
        self.model_key = model_key
        self.with_others = with_others
        self._source: CheckpointSource | None = None
        self._entries: dict[str, Entry] = {}

    # -- StorageReader -------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.close()

    def _open(self) -> CheckpointSource:
        if self._source is None:
            src = CheckpointSource(self.path, self.step)
            entries = {export_name(e, []): e for e in src.model(self.model_key)}
            if self.with_others:
                for k in src.keys():
                    if k != self.model_key:
                        entries.update({export_name(e, [], prefix=True): e for e in src.entries(k)})
            self._source, self._entries = src, entries
        return self._source

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._open()
        md: dict[str, Any] = {}
        for name, e in self._entries.items():
            size = torch.Size(e.shape)
            md[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(e.dtype)), size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        src = self._open()
        src.will_need([(self._entries[r.storage_index.fqn], tuple(r.storage_offsets), tuple(r.lengths))
                       for r in plan.items if r.type != LoadItemType.BYTE_IO and r.storage_index.fqn in self._entries])
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise UsageError(f"{req.storage_index.fqn!r} is not a tensor of this coci checkpoint",
                                 hint="CociStorageReader serves tensors only")
            entry = self._entries[req.storage_index.fqn]
            box = tuple(req.storage_offsets), tuple(req.lengths)
            target = planner.resolve_tensor(req).detach()
            if src.read_box_into(entry, *box, target):   # no intermediate copy
                planner.commit_tensor(req, target)
                continue
            data = src.read_box(entry, *box)
            if target.size() != data.size():
                raise UsageError(f"{req.storage_index.fqn!r}: DCP asked for {tuple(target.size())}, the "
                                 f"slice read is {tuple(data.size())}", hint="report this")
            target.copy_(data)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        p = os.fspath(checkpoint_id)
        return os.path.isdir(p) and cat.latest_step(p) is not None

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
        self._source, self._entries = None, {}

