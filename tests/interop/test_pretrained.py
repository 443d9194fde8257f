"""load_pretrained / Session(init_from=...): every source format into DDP replicas and FSDP2
shards (1 and 2 ranks under mpiexec), bit-identical; name mismatches listed in one error;
strict=False; a run with its own checkpoint ignores init_from."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from coci_hpc.errors import UsageError
from coci_hpc.interop.export import export
from coci_hpc.interop.pretrained import import_to_checkpoint, load_pretrained
from tests.checkpoint.conftest import run_ranks
from tests.checkpoint.helpers import Net
from tests.interop.helpers import loaded_reference, same_bits, save_full

JOB = str(Path(__file__).resolve().parent / "scripts" / "pretrained_job.py")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("pretrained")
    root = tmp / "ckpt"
    save_full(root, step=3)
    out = {"coci": root, "hf": tmp / "hf", "dcp": tmp / "dcp", "torch": tmp / "model.pt"}
    export(root, out["hf"], to="hf", max_shard_size=3000)   # several shards: get_slice across files
    export(root, out["dcp"], to="dcp")
    export(root, out["torch"], to="torch")
    return out


def _ref(exported: dict[str, Path]) -> dict[str, torch.Tensor]:
    return loaded_reference(exported["coci"], 3)["model"].state_dict()


def _zero_net() -> Net:
    torch.manual_seed(99)
    return Net()


@pytest.mark.parametrize("fmt", ["hf", "dcp", "torch", "coci"])
def test_each_format_loads_bit_identical_into_a_plain_model(exported: dict[str, Path], fmt: str) -> None:
    net = _zero_net()
    report = load_pretrained(exported[fmt], net)
    ref = _ref(exported)
    assert sorted(report.loaded) == sorted(ref) and not report.missing and not report.unexpected
    for k, v in net.state_dict().items():
        assert same_bits(v, ref[k]), k


def test_single_safetensors_file_and_ddp_style_names(exported: dict[str, Path], tmp_path: Path) -> None:
    export(exported["coci"], tmp_path / "one", to="hf")
    target = {f"module.{k}": torch.zeros_like(v) for k, v in _ref(exported).items()}
    load_pretrained(tmp_path / "one" / "model.safetensors", target)
    assert all(same_bits(target[f"module.{k}"], v) for k, v in _ref(exported).items())


def test_mismatching_names_are_listed_in_one_error(exported: dict[str, Path]) -> None:
    net = torch.nn.Sequential()
    net.add_module("fc1", torch.nn.Linear(32, 64))
    net.add_module("fc2", torch.nn.Linear(64, 5))           # 5 outputs: the source has 4
    net.add_module("head", torch.nn.Linear(4, 4))           # not in the source
    before = net.fc1.weight.detach().clone()
    with pytest.raises(UsageError) as e:
        load_pretrained(exported["hf"], net)
    msg = e.value.message
    assert "missing from the source: head.weight, head.bias" in msg
    assert "not in the model (unexpected): bf16, count, mask" in msg
    assert "fc2.weight: source (4, 64) vs model (5, 64)" in msg and "fc2.bias" in msg
    assert "strict=False" in (e.value.hint or "")
    assert torch.equal(net.fc1.weight, before)              # nothing loaded before the check


def test_non_strict_loads_what_matches_and_logs_the_rest(exported: dict[str, Path]) -> None:
    net = torch.nn.Sequential()
    net.add_module("fc1", torch.nn.Linear(32, 64))
    net.add_module("head", torch.nn.Linear(4, 4))
    logged: list[str] = []
    report = load_pretrained(exported["hf"], net, strict=False, log=logged.append)
    assert sorted(report.loaded) == ["fc1.bias", "fc1.weight"]
    assert report.missing == ["head.weight", "head.bias"]
    assert same_bits(net.fc1.weight.detach(), _ref(exported)["fc1.weight"])
    assert len(logged) == 1 and "head.weight" in logged[0] and "loaded 2 tensors" in logged[0]


def test_import_writes_a_coci_checkpoint_that_init_from_reads(exported: dict[str, Path], tmp_path: Path) -> None:
    info = import_to_checkpoint(exported["hf"], tmp_path / "imported")
    assert info["step"] == 0 and info["kind"] == "hf-safetensors"
    net = _zero_net()
    load_pretrained(tmp_path / "imported", net)
    assert all(same_bits(v, _ref(exported)[k]) for k, v in net.state_dict().items())
    with pytest.raises(UsageError, match="never overwrites"):
        import_to_checkpoint(exported["hf"], tmp_path / "imported")


def test_session_init_from_then_its_own_checkpoint_wins(exported: dict[str, Path], tmp_path: Path,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    from coci_hpc.session import Session

    ref = _ref(exported)
    net = _zero_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    s = Session({"model": net, "optimizer": opt}, 2, ckpt_dir=tmp_path / "run", policy="fixed:1",
                environ={}, init_from=exported["hf"])
    first = True
    for _ in s.steps():
        if first:   # before any training step: exactly the pretrained weights
            assert all(same_bits(v, ref[k]) for k, v in net.state_dict().items())
            first = False
        loss = net(torch.randn(2, 32)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        s.observe(loss.item())
    trained = {k: v.clone() for k, v in net.state_dict().items()}
    assert "init_from: loaded 7 tensors" in capfd.readouterr().err

    net2 = _zero_net()
    s2 = Session({"model": net2, "optimizer": torch.optim.SGD(net2.parameters(), lr=0.1)}, 2,
                 ckpt_dir=tmp_path / "run", policy="fixed:1", environ={}, init_from=exported["hf"])
    for _ in s2.steps():
        pass
    assert all(same_bits(v, trained[k]) for k, v in net2.state_dict().items())
    err = capfd.readouterr().err
    assert "init_from=" in err and "ignored: resumed from this run's own checkpoint step 2" in err


@pytest.mark.parametrize("ranks", [1, 2])
def test_ddp_and_fsdp2_under_mpiexec(exported: dict[str, Path], ranks: int) -> None:
    p = run_ranks(ranks, JOB, str(exported["hf"]), str(exported["dcp"]), str(exported["torch"]),
                  str(exported["coci"]), timeout=300)
    # Two ranks print to one pipe: their lines can run into each other, so match records, not lines.
    oks = re.findall(r"ok \S+ rank \d+", p.stdout)
    assert len(oks) == 9 * ranks, p.stdout + p.stderr
    assert any("fsdp2<-dcp.load(CociStorageReader)" in ln for ln in oks)
