"""State the store refuses before any ``state_dict()`` is called, naming what to use instead.

* FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``): its ``state_dict()`` is a
  collective whose result depends on the state-dict type (full tensors gathered on every rank,
  or ``ShardedTensor`` pieces), and its optimizer state is keyed by flattened parameters that
  differ per rank. FSDP2 (``fully_shard``) gives DTensors, which the store saves sharded and
  reshards on load.
* ``ZeroRedundancyOptimizer``: each rank holds the state of its own partition, and
  ``state_dict()`` refuses until ``consolidate_state_dict()`` gathered everything onto one rank.

The checks look only at classes already imported (``sys.modules``): a program that never
imported FSDP1 or ZeRO pays one dictionary lookup per state value.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from coci_hpc.errors import UsageError

FSDP_DOC = "see docs/how-to/fsdp.md"


def _cls(module: str, name: str) -> type | None:
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def check_value(key: str, value: Any) -> None:
    """Raise a UsageError if state value ``key`` is of a kind the store cannot save."""
    if isinstance(value, torch.nn.Module):
        fsdp1 = _cls("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel")
        if fsdp1 is not None and any(isinstance(m, fsdp1) for m in value.modules()):
            raise UsageError(
                f"state {key!r} is (or contains) a FullyShardedDataParallel (FSDP1) model, which the "
                f"checkpoint store does not save: its state_dict() is a collective whose tensors are "
                f"either gathered whole on every rank or ShardedTensor pieces",
                hint="wrap the model with FSDP2 instead (torch.distributed.fsdp.fully_shard): its "
                     "parameters and optimizer state are DTensors, saved sharded by every rank and "
                     f"resharded on load to any number of ranks; {FSDP_DOC}")
    elif isinstance(value, torch.optim.Optimizer):
        zero = _cls("torch.distributed.optim.zero_redundancy_optimizer", "ZeroRedundancyOptimizer")
        if zero is not None and isinstance(value, zero):
            raise UsageError(
                f"optimizer {key!r} is a ZeroRedundancyOptimizer, which the checkpoint store does not "
                f"save: each rank holds only its partition's state, and its state_dict() needs "
                f"consolidate_state_dict() to gather all of it onto one rank first",
                hint="shard the model and its optimizer state with FSDP2 (torch.distributed.fsdp."
                     "fully_shard) and a plain torch.optim optimizer: the state stays sharded as "
                     "under ZeRO and is saved by every rank in parallel; or use a plain optimizer "
                     f"under DDP (replicated state); {FSDP_DOC}")
        flat = _cls("torch.distributed.fsdp._flat_param", "FlatParameter")
        if flat is not None and any(isinstance(p, flat) for g in value.param_groups for p in g["params"]):
            raise UsageError(
                f"optimizer {key!r} steps the flattened parameters of an FSDP1 model: its state is "
                f"each rank's own shard of them, which the checkpoint store does not save",
                hint="wrap the model with FSDP2 instead (torch.distributed.fsdp.fully_shard) and build "
                     f"the optimizer from its parameters; {FSDP_DOC}")
