"""An FSDP2 checkpoint out and back in (issue 24's acceptance): saved by 2 ranks with uneven dim-0
shards (real fully_shard on a CPU mesh, gloo, mpiexec), exported to hf / torch / dcp; every export
read back by its own library, and every format loaded by a plain model, by a 1-rank and a 2-rank
DDP run and by a 1-rank and a 2-rank FSDP2 run (plus DCP's ``dcp.load`` through
CociStorageReader), all bit-identical to the FSDP2 model's ``full_tensor()``s."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.interop.export import export
from coci_hpc.interop.pretrained import load_pretrained
from tests.checkpoint.conftest import run_ranks
from tests.checkpoint.helpers import Net
from tests.interop.helpers import same_bits

JOB = str(Path(__file__).resolve().parent / "scripts" / "fsdp2_roundtrip_job.py")
STEP = 2
MODEL_KEYS = ["bf16", "count", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "mask"]
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]   # the optimizer's param order


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("fsdp2_roundtrip")
    p = run_ranks(2, JOB, "save", str(tmp / "coci"), str(tmp / "ref.safetensors"), timeout=300)
    assert p.stdout.count("ok save") == 2, p.stdout + p.stderr
    out = {"coci": tmp / "coci", "ref": tmp / "ref.safetensors", "hf": tmp / "hf", "torch": tmp / "model.pt",
           "dcp": tmp / "dcp", "torch_opt": tmp / "full.pt"}
    export(out["coci"], out["hf"], to="hf", max_shard_size=4000)   # several files
    r = export(out["coci"], out["torch"], to="torch")
    assert r.files == ["model.pt"] and r.step == STEP
    export(out["coci"], out["dcp"], to="dcp")
    export(out["coci"], out["torch_opt"], to="torch", with_optimizer=True)
    return out


def _ref(saved: dict[str, Path]) -> dict[str, torch.Tensor]:
    return load_file(str(saved["ref"]))


def test_the_checkpoint_is_fsdp2_with_uneven_shards(saved: dict[str, Path]) -> None:
    m = cat.read_step(saved["coci"], STEP)
    dt = {t["name"]: t for t in m["tensors"] if t["kind"] == "dtensor"}
    w = dt["replicated/model/fc1.weight"]
    assert w["shape"] == [63, 32]
    assert sorted((b[0], b[1][0], b[2][0]) for b in w["boxes"]) == [(0, 0, 32), (1, 32, 31)]


def test_hf_export_is_the_fsdp2_full_tensors(saved: dict[str, Path]) -> None:
    ref = _ref(saved)
    index = json.loads((saved["hf"] / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(index["weight_map"]) == MODEL_KEYS
    got = {k: v for f in files for k, v in load_file(str(saved["hf"] / f)).items()}
    assert sorted(got) == MODEL_KEYS
    for k, v in got.items():
        assert same_bits(v, ref[k]), k
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in got.values())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # no_dist=True is the intent
def test_torch_and_dcp_exports_are_the_fsdp2_full_tensors(saved: dict[str, Path]) -> None:
    import torch.distributed.checkpoint as dcp

    ref = _ref(saved)
    sd = torch.load(saved["torch"], weights_only=True)
    assert sorted(sd) == MODEL_KEYS and all(same_bits(v, ref[k]) for k, v in sd.items())

    full = torch.load(saved["torch_opt"], weights_only=True)   # Adam's moments, gathered
    assert all(same_bits(v, ref[k]) for k, v in full["model"].items())
    state = full["optimizer"]["state"]
    # keyed by parameter name, as torch.distributed.checkpoint.state_dict.get_state_dict gives it
    assert full["optimizer"]["param_groups"][0]["params"] == PARAMS
    for name in PARAMS:
        for k in ("exp_avg", "exp_avg_sq"):
            assert same_bits(state[name][k], ref[f"optimizer.{name}.{k}"]), (name, k)

    target = {k: torch.zeros_like(v) for k, v in ref.items() if k in MODEL_KEYS}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(saved["dcp"])), no_dist=True)
    assert all(same_bits(v, ref[k]) for k, v in target.items())


@pytest.mark.parametrize("fmt", ["hf", "torch", "dcp", "coci"])
def test_each_format_loads_into_a_plain_model(saved: dict[str, Path], fmt: str) -> None:
    torch.manual_seed(99)
    net = Net(h=63)
    report = load_pretrained(saved[fmt], net)
    assert sorted(report.loaded) == MODEL_KEYS
    ref = _ref(saved)
    for k, v in net.state_dict().items():
        assert same_bits(v, ref[k]), k


@pytest.mark.parametrize("ranks", [1, 2])
def test_ddp_and_fsdp2_runs_load_it_bit_identical(saved: dict[str, Path], ranks: int) -> None:
    p = run_ranks(ranks, JOB, "load", *(str(saved[k]) for k in ("ref", "coci", "hf", "torch", "dcp")),
                  timeout=300)
    # Two ranks print to one pipe: their lines can run into each other, so match records, not lines.
    oks = re.findall(r"(ok \S+?<-\S+?) rank \d+", p.stdout)
    checks = [f"ok {layout}<-{src}" for src in ("coci", "hf", "torch", "dcp") for layout in ("ddp", "fsdp2")]
    checks += ["ok fsdp2<-dcp.load(CociStorageReader)", "ok ddp<-dcp.load(CociStorageReader)"]
    assert sorted(oks) == sorted(checks * ranks), p.stdout + p.stderr
