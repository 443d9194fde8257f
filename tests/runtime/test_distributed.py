"""init_distributed's backend choice, on the CPU: torch.cuda and init_process_group mocked."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from coci_hpc.runtime import distributed
from coci_hpc.runtime.distributed import NCCL_WITH_CPU, init_distributed


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.update(device=d))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(distributed.errorexit, "install", lambda: None)
    monkeypatch.setattr(distributed, "rendezvous",
                        lambda comm=None: ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "3",
                                            "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "env"))
    return seen


def test_nccl_comes_with_a_cpu_backend(calls: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # DCP's async save refuses NCCL alone ("A CPU backend must be enabled for async save"), seen
    # on the first GPU run; control paths on host tensors must not queue behind NCCL either
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    info = init_distributed()
    assert calls["backend"] == NCCL_WITH_CPU == "cpu:gloo,cuda:nccl"
    assert info.backend == "cpu:gloo,cuda:nccl" and "nccl" in info.backend
    assert calls["device"] == 3                     # the local rank's GPU
    assert (info.rank, info.world_size, info.local_rank) == (1, 2, 3)


def test_gloo_without_cuda(calls: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert init_distributed().backend == "gloo"
    assert calls["backend"] == "gloo" and "device" not in calls


def test_an_explicit_backend_is_kept(calls: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert init_distributed("nccl").backend == "nccl"
    assert calls["backend"] == "nccl" and calls["device"] == 3
