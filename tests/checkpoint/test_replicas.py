"""Replicated state is never mixed across ranks: module buffers are written from rank 0 (the
value DDP treats as authoritative), every other replicated leaf is compared by checksum."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coci_hpc.checkpoint.layout import FROM_RANK0, LeafDesc, make_layout
from coci_hpc.checkpoint.replicas import checksums
from coci_hpc.checkpoint.state import collect
from tests.conftest import run_ranks

SCRIPT = "tests/checkpoint/scripts/replicas_job.py"


def _result(stdout: str) -> dict:
    line = next(l for l in stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_module_buffers_are_marked_and_only_rank_0_writes_them() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    _, leaves = collect({"model": model}, rng=False)
    kinds = {l.name.rsplit("/", 1)[1]: l.kind for l in leaves}
    assert kinds["1.running_mean"] == kinds["1.running_var"] == kinds["1.num_batches_tracked"] == FROM_RANK0
    assert kinds["0.weight"] == kinds["1.weight"] == "replicated"
    descs = [LeafDesc(l.name, l.dtype, l.shape, l.kind, l.nbytes) for l in leaves]
    layout = make_layout([descs, descs, descs], align=64)
    by_name = {d.name: i for i, d in enumerate(layout.datasets)}
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        idx = by_name[f"replicated/model/{name}"]
        pieces = [p for p in layout.pieces if p.dataset == idx]
        assert [(p.rank, p.start, p.stop) for p in pieces] == [(0, 0, layout.datasets[idx].nbytes)]
        assert layout.datasets[idx].kind == "replicated"   # the manifest's kinds are unchanged
    assert {p.rank for p in layout.pieces} == {0, 1, 2}   # the parameters are still spread


def test_checksums_cover_replicated_leaves_only_and_see_a_one_bit_difference() -> None:
    a = {"model": torch.nn.BatchNorm1d(4), "w": torch.zeros(8)}
    names = [n for n, _ in checksums(collect(a, rng=False)[1])]
    assert names == ["replicated/model/weight", "replicated/model/bias", "replicated/w"]
    b = {"model": torch.nn.BatchNorm1d(4), "w": torch.zeros(8)}
    b["w"].view(torch.int32)[3] = 1
    assert checksums(collect(a, rng=False)[1])[:2] == checksums(collect(b, rng=False)[1])[:2]
    assert checksums(collect(a, rng=False)[1])[2] != checksums(collect(b, rng=False)[1])[2]


@pytest.mark.parametrize("mode", ["bn", "bn_wrapped"])
def test_ddp_with_batchnorm_resumes_bit_exactly_like_an_uninterrupted_run(tmp_path: Path, mode: str) -> None:
    """2 ranks, gloo: each rank's running statistics differ at the save; DDP goes on with rank
    0's (broadcast at the next forward), so the checkpoint must hold rank 0's. Also with the
    DDP wrapper saved and the BatchNorm under activation checkpointing's wrapper (its
    ``state_dict`` drops the wrapper's name, its ``named_buffers`` does not): the state is saved
    under the clean names."""
    out = _result(run_ranks(2, "-m", "mpi4py", SCRIPT, mode, str(tmp_path / "ck"), timeout=240).stdout)
    assert "replicated/model/1.running_mean" in out["names"]
    assert out["stats_at_save"][0] != out["stats_at_save"][1]   # the case the test is about
    assert out["resumed"] == out["straight"]            # each rank: parameters and buffers, bit for bit
    assert out["running_mean_written_by"] == [0]


def test_replicated_values_that_differ_between_ranks_are_refused_naming_the_leaf(tmp_path: Path) -> None:
    out = _result(run_ranks(2, "-m", "mpi4py", SCRIPT, "moments", str(tmp_path / "ck"), timeout=240).stdout)
    assert out["saved"] is False
    assert "'replicated/optimizer/state/weight/exp_avg'" in out["message"]   # keyed by parameter name
    assert "rank(s) [1]" in out["message"]
    assert "PerRank" in out["hint"] and "Sharded" in out["hint"]
    assert out["steps_after_refusal"] == []            # nothing was written
    assert out["steps_after_fix"] == [1]               # the refusal left no stale cached layout


def test_the_check_runs_when_the_layout_is_planned_and_never_on_a_cached_save(tmp_path: Path, monkeypatch) -> None:
    from coci_hpc.checkpoint import CheckpointManager, coordinator
    from coci_hpc.comm import Comm

    calls: list[int] = []
    real = coordinator.replicas.check_equal
    monkeypatch.setattr(coordinator.replicas, "check_equal", lambda comm, leaves: calls.append(len(leaves)) or
                        real(comm, leaves))
    state = {"w": torch.zeros(8), "model": torch.nn.BatchNorm1d(4)}
    mgr = CheckpointManager(tmp_path, Comm.serial())
    mgr.save(1, state)
    mgr.save(2, state)                       # same shapes: the cached layout, no bytes read
    assert len(calls) == 1
    state["w"] = torch.zeros(9)              # a shape change plans again, and checks again
    mgr.save(3, state)
    assert len(calls) == 2
    mgr.close()
    again = CheckpointManager(tmp_path, Comm.serial())   # a requeued job: layout from the manifest
    again.save(4, state)
    assert len(calls) == 3
    again.close()
