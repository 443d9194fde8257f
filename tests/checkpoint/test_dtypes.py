"""Tensor dtypes real models hold beyond the common ones (a Llama's complex ``freqs_cis`` buffer,
8-bit floats, torch's wide unsigned integers) save and load bit-exactly and export; tensors that
are not a dense block of memory (sparse, nested, meta) are refused naming the tensor and the fix,
before anything is written; a load into a model still on the meta device is refused, not sent
down the device path."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint.leaves import storage_dtype
from coci_hpc.errors import CheckpointError, UsageError

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                      "float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, n)]
RARE = [torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64, *FLOAT8]


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (5, 3), seed: int = 0) -> torch.Tensor:
    """Random bytes of ``dtype`` (every bit pattern, NaNs included: compared as bytes)."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", RARE, ids=str)
def test_rare_dtypes_round_trip_bit_exact_in_place(tmp_path: Path, dtype: torch.dtype) -> None:
    saved = _sample(dtype)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"x": {"t": saved}})
    target = _sample(dtype, seed=1)
    assert _bytes(target) != _bytes(saved)
    mgr.load(1, {"x": {"t": target}})
    assert target.dtype == dtype and _bytes(target) == _bytes(saved)


class _Rotary(torch.nn.Module):
    """A torchtitan-style Llama block: a persistent complex ``freqs_cis`` buffer beside the weights."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wq = torch.nn.Linear(8, 8)
        self.register_buffer("freqs_cis", torch.polar(torch.ones(16, 4), torch.randn(16, 4)))
        self.register_buffer("scale_f8", torch.randn(4).to(torch.float8_e4m3fn))


def test_a_complex_rotary_buffer_saves_loads_and_exports(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from coci_hpc.interop.export import export

    saved = _Rotary(0)
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(3, {"model": saved})
    fresh = _Rotary(1)
    assert not torch.equal(fresh.freqs_cis, saved.freqs_cis)
    mgr.load_latest({"model": fresh})
    for k, v in saved.state_dict().items():
        assert fresh.state_dict()[k].dtype == v.dtype and _bytes(fresh.state_dict()[k]) == _bytes(v), k
    mgr.close()
    export(tmp_path / "ck", tmp_path / "hf", to="hf")
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert got["freqs_cis"].dtype == torch.complex64 and torch.equal(got["freqs_cis"], saved.freqs_cis)
    assert got["scale_f8"].dtype == torch.float8_e4m3fn and _bytes(got["scale_f8"]) == _bytes(saved.scale_f8)


def test_numpy_complex_arrays_round_trip(tmp_path: Path) -> None:
    a = (np.arange(6) + 1j * np.arange(6)[::-1]).astype(np.complex64).reshape(2, 3)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"x": {"a": a}})
    out = np.zeros_like(a)
    mgr.load(1, {"x": {"a": out}})
    assert out.dtype == np.complex64 and np.array_equal(out, a)
    assert storage_dtype("numpy.complex128") == np.dtype("<c16")
    with pytest.raises(CheckpointError, match="numpy.object_"):
        storage_dtype("numpy.object_")


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested", "meta"])
def test_tensors_without_dense_values_are_refused_naming_tensor_and_fix(tmp_path: Path, kind: str) -> None:
    bad = {"sparse_coo": lambda: torch.eye(3).to_sparse(),
           "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
           "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
           "meta": lambda: torch.empty(3, device="meta")}[kind]()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"x": {"ok": torch.ones(2)}})
    with pytest.raises(UsageError) as err:
        mgr.save(2, {"x": {"ok": torch.ones(2), "bad": bad}})
    text = str(err.value)
    assert "'replicated/x/bad'" in text
    assert ("meta device" in text and "to_empty" in text) if kind == "meta" else "to_dense()" in text
    assert mgr.latest_step() == 1


def test_a_load_into_a_model_on_the_meta_device_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"model": torch.nn.Linear(3, 3), "opt": {"lr": 0.5}})
    with torch.device("meta"):
        model = torch.nn.Linear(3, 3)
    opt = {"lr": 0.1}
    with pytest.raises(UsageError, match=r"'replicated/model/weight' is on the meta device.*to_empty"):
        mgr.load(1, {"model": model, "opt": opt})
    assert opt == {"lr": 0.1} and model.weight.is_meta
    model.to_empty(device="cpu")
    mgr.load(1, {"model": model, "opt": opt})
    assert opt == {"lr": 0.5}


def test_fsdp2_on_the_meta_device_is_refused_on_save_and_load(tmp_path: Path, group: None) -> None:
    """The FSDP2 recipe builds the model on the meta device, shards it, then materialises it with
    ``to_empty``: a save or load before that is refused naming the DTensor, not a numpy error."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model, mesh=mesh)
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(UsageError, match=r"is on the meta device"):
        mgr.save(1, {"model": model})
    assert mgr.latest_step() is None
    model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.ones_(p)
    mgr.save(1, {"model": model})
    with torch.device("meta"):
        again = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(again, mesh=mesh)
    with pytest.raises(UsageError, match=r"is on the meta device.*to_empty"):
        mgr.load(1, {"model": again})
    again.to_empty(device="cpu")
    mgr.load(1, {"model": again})
    assert all(torch.equal(p.full_tensor(), torch.ones_like(p.full_tensor())) for p in again.parameters())


@pytest.mark.mpi
def test_rare_dtypes_through_the_parallel_file_and_across_ranks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Replicated, per-rank and row-sharded complex / 8-bit-float / uint16 tensors through the
    MPI writer (collective dataset creation with HDF5's complex compound type), loaded on the
    same ranks bit-exactly."""
    from coci_hpc.checkpoint import PerRank, Sharded
    from coci_hpc.comm import Comm

    comm = Comm.world()
    base = comm.bcast(str(tmp_path_factory.mktemp("dtypes")) if comm.rank == 0 else None)
    state = {"rep": {str(d): _sample(d) for d in (torch.complex64, torch.float8_e5m2, torch.uint16)},
             "mine": PerRank({"c": _sample(torch.complex128, seed=10 + comm.rank)}),
             "rows": Sharded(_sample(torch.complex64, (2, 3), seed=20 + comm.rank))}
    with CheckpointManager(base, comm=comm) as cm:
        cm.save(1, state)
        got = {"rep": {k: torch.zeros_like(v) for k, v in state["rep"].items()},
               "mine": PerRank({"c": torch.zeros(5, 3, dtype=torch.complex128)}),
               "rows": Sharded(torch.zeros(2, 3, dtype=torch.complex64))}
        cm.load(1, got)
    for k, v in state["rep"].items():
        assert _bytes(got["rep"][k]) == _bytes(v), k
    assert _bytes(got["mine"].value["c"]) == _bytes(state["mine"].value["c"])
    assert _bytes(got["rows"].local) == _bytes(state["rows"].local)
