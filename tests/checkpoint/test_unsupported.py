"""FSDP1 and ZeroRedundancyOptimizer are refused up front with a UsageError naming FSDP2, before
any state_dict() (collective for both) runs; nothing is written."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coci_hpc import Session
from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.comm import Comm
from coci_hpc.errors import UsageError


def _fsdp1() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)),
                                     device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_fsdp1_is_refused_at_session_and_at_save_naming_fsdp2(tmp_path: Path, group: None) -> None:
    model, opt = _fsdp1()
    with pytest.raises(UsageError, match="FullyShardedDataParallel") as exc:
        Session({"model": model, "optimizer": opt}, 4, ckpt_dir=tmp_path / "s", policy="fixed:2", environ={})
    assert exc.value.hint is not None and "fully_shard" in exc.value.hint
    mgr = CheckpointManager(tmp_path / "m", Comm.serial())
    with pytest.raises(UsageError, match="FSDP1"):
        mgr.save(1, {"optimizer": opt})            # the optimizer alone: its flat parameters
    with pytest.raises(UsageError, match="FullyShardedDataParallel"):
        mgr.save(1, {"model": model})
    assert mgr.list() == []
    mgr.close()


def test_zero_redundancy_optimizer_is_refused_naming_the_alternatives(tmp_path: Path, group: None) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = torch.nn.Linear(4, 1)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(UsageError, match="ZeroRedundancyOptimizer") as exc:
        Session({"model": model, "optimizer": opt}, 4, ckpt_dir=tmp_path / "s", policy="fixed:2", environ={})
    assert exc.value.hint is not None and "fully_shard" in exc.value.hint and "DDP" in exc.value.hint
    mgr = CheckpointManager(tmp_path / "m", Comm.serial())
    with pytest.raises(UsageError, match="consolidate_state_dict"):
        mgr.save(1, {"model": model, "optimizer": opt})
    assert mgr.list() == []
    mgr.close()
