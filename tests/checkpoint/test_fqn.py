"""A module's state is saved under its keys without wrapper parts, and loads into the model
however it is wrapped now: torch.compile, DDP, activation checkpointing, or none (one process;
DDP on a real one-rank gloo group)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from coci_hpc.checkpoint import CheckpointManager, fqn
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint.leaves import LeafKind
from coci_hpc.checkpoint.state import collect
from coci_hpc.comm import Comm
from coci_hpc.errors import CheckpointError


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)   # buffers (running statistics) too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)).relu()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    """A real one-rank gloo process group (DDP needs one)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def _plain(net: Net) -> torch.nn.Module:
    return net


def _compiled(net: Net) -> torch.nn.Module:
    return torch.compile(net)   # only its state_dict is used: nothing is compiled


def _blocks_compiled(net: Net) -> torch.nn.Module:
    for i, layer in enumerate(net.layers):   # torchtitan's way: each block on its own
        net.layers[i] = torch.compile(layer)
    return net


def _ddp(net: Net) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(net)


def _checkpointed(net: Net) -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(net.layers):
        net.layers[i] = checkpoint_wrapper(layer)
    return net


WRAPS: dict[str, Callable[[Net], torch.nn.Module]] = {
    "plain": _plain, "compiled": _compiled, "blocks_compiled": _blocks_compiled, "ddp": _ddp,
    "checkpointed": _checkpointed}


def _trained(seed: int, wrap: Callable[[Net], torch.nn.Module], steps: int) -> tuple[Net, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    model = wrap(net)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(8, 6)).square().mean().backward()   # the bare net: nothing compiles
        opt.step()
    return net, model, opt


def _flat(net: Net, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(net.state_dict().values())
    for p in net.parameters():
        out += [v for k, v in sorted(opt.state[p].items())]
    return out


@pytest.mark.parametrize("saved_as", sorted(WRAPS))
@pytest.mark.parametrize("loaded_as", ["plain", "compiled", "ddp", "checkpointed", "blocks_compiled"])
def test_a_checkpoint_loads_into_the_model_however_it_is_wrapped(tmp_path: Path, group: None, saved_as: str,
                                                                  loaded_as: str) -> None:
    net, model, opt = _trained(1, WRAPS[saved_as], 3)
    mgr = CheckpointManager(tmp_path, Comm.serial())
    mgr.save(1, {"model": model, "optimizer": opt})
    names = {t["name"] for t in cat.read_manifest(cat.step_dir(tmp_path, 1))["tensors"]}
    kinds = {leaf.name: leaf.kind for leaf in collect({"model": model}, rng=False)[1]}
    assert kinds["replicated/model/layers.1.norm.running_mean"] == LeafKind.FROM_RANK0   # rank 0's buffers
    assert kinds["replicated/model/layers.0.lin.weight"] == LeafKind.REPLICATED
    assert "replicated/model/layers.1.norm.running_mean" in names
    assert not any(p in n for n in names for p in ("_orig_mod", "module.", "_checkpoint_wrapped"))
    net2, model2, opt2 = _trained(2, WRAPS[loaded_as], 1)
    assert not all(torch.equal(a, b) for a, b in zip(_flat(net, opt), _flat(net2, opt2)))
    mgr.load(1, {"model": model2, "optimizer": opt2})
    assert all(torch.equal(a, b) for a, b in zip(_flat(net, opt), _flat(net2, opt2), strict=True))
    mgr.close()


@pytest.mark.parametrize("loaded_as", ["compiled", "plain", "ddp"])
def test_a_checkpoint_written_under_the_wrapped_names_still_loads(tmp_path: Path, group: None,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 loaded_as: str) -> None:
    """Before 2026-11-30 a module's state was saved under its own keys (``_orig_mod.`` and
    all): such a checkpoint loads into the model wrapped as it was, and wrapped otherwise."""
    from coci_hpc.checkpoint import state as state_mod

    net, model, opt = _trained(1, _compiled, 2)
    mgr = CheckpointManager(tmp_path, Comm.serial())
    with monkeypatch.context() as m:
        m.setattr(state_mod, "state_names", lambda module, keys=None: {})   # the old naming
        mgr.save(1, {"model": model, "optimizer": opt})
    names = {t["name"] for t in cat.read_manifest(cat.step_dir(tmp_path, 1))["tensors"]}
    assert "replicated/model/_orig_mod.layers.0.lin.weight" in names
    net2, model2, opt2 = _trained(2, WRAPS[loaded_as], 1)
    mgr.load(1, {"model": model2, "optimizer": opt2})
    assert all(torch.equal(a, b) for a, b in zip(_flat(net, opt), _flat(net2, opt2), strict=True))
    mgr.close()


def test_another_model_is_still_refused_naming_the_keys(tmp_path: Path) -> None:
    net, model, opt = _trained(1, _compiled, 1)
    mgr = CheckpointManager(tmp_path, Comm.serial())
    mgr.save(1, {"model": model})
    other = torch.compile(torch.nn.Sequential(torch.nn.Linear(6, 6)))
    before = [v.clone() for v in other.state_dict().values()]
    with pytest.raises(CheckpointError, match=r"entries missing from the checkpoint \['0.bias', '0.weight'\]"):
        mgr.load(1, {"model": other})
    assert all(torch.equal(a, b) for a, b in zip(before, other.state_dict().values()))
    mgr.close()


def test_clean_drops_wrapper_parts_but_not_a_users_submodule_called_module(group: None) -> None:
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)   # the user's own name

    h = Holder()
    assert fqn.state_names(h) == {}
    ddp = torch.nn.parallel.DistributedDataParallel(Holder())
    assert fqn.state_names(ddp) == {"module.module.weight": "module.weight", "module.module.bias": "module.bias"}
    assert fqn.clean_saved("module._orig_mod.layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    assert fqn.clean_saved("layers.0._orig_mod.w") == "layers.0.w"


def test_names_that_would_collide_keep_the_modules_own_keys(tmp_path: Path) -> None:
    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3))
            self._orig_mod = torch.nn.Linear(3, 3, bias=False)   # '_orig_mod.weight' -> 'weight' too

    torch.manual_seed(0)
    a = Odd()
    assert fqn.state_names(a) == {}
    mgr = CheckpointManager(tmp_path, Comm.serial())
    mgr.save(1, {"model": a})
    b = Odd()
    mgr.load(1, {"model": b})
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    mgr.close()


def test_saved_to_live_maps_one_to_one_or_not_at_all() -> None:
    live = ["_orig_mod.a", "_orig_mod.b"]
    names = {"_orig_mod.a": "a", "_orig_mod.b": "b"}
    assert fqn.saved_to_live({"a", "b"}, live, names) == {"a": "_orig_mod.a", "b": "_orig_mod.b"}
    assert fqn.saved_to_live(set(live), live, names) == {k: k for k in live}
    assert fqn.saved_to_live({"module.a", "module.b"}, live, names) == {"module.a": "_orig_mod.a",
                                                                        "module.b": "_orig_mod.b"}
    assert fqn.saved_to_live({"a"}, live, names) is None                        # one missing
    assert fqn.saved_to_live({"a", "b", "c"}, live, names) is None              # one extra
    assert fqn.saved_to_live({"module.a", "_orig_mod.a"}, live, names) is None  # two onto one


@pytest.mark.parametrize("saved_as, loaded_as", [("checkpointed", "plain"), ("blocks_compiled", "checkpointed"),
                                                 ("plain", "blocks_compiled")])
def test_fsdp2_state_loads_across_wrappings(tmp_path: Path, group: None, saved_as: str, loaded_as: str) -> None:
    """torchtitan's way (each block wrapped, compiled or checkpointed, then ``fully_shard``): the
    DTensor parameters and moments are saved under the clean names and load into the model
    wrapped otherwise, on a one-rank CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))

    def build(seed: int, wrap: str, steps: int) -> tuple[Net, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        net = Net()
        WRAPS[wrap](net)
        for layer in net.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.AdamW(net.parameters(), lr=0.05)
        with torch._dynamo.config.patch(disable=True):   # the compiled blocks run eagerly: nothing compiles
            for _ in range(steps):
                opt.zero_grad()
                net(torch.randn(8, 6)).square().mean().backward()
                opt.step()
        return net, opt

    def flat(net: Net, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        out = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in net.state_dict().values()]
        for p in net.parameters():
            out += [v.full_tensor() if hasattr(v, "full_tensor") else v for _, v in sorted(opt.state[p].items())]
        return out

    net, opt = build(1, saved_as, 2)
    mgr = CheckpointManager(tmp_path, Comm.serial())
    mgr.save(1, {"model": net, "optimizer": opt})
    names = {t["name"] for t in cat.read_manifest(cat.step_dir(tmp_path, 1))["tensors"]}
    assert "replicated/model/layers.0.lin.weight" in names
    assert "replicated/optimizer/state/layers.0.lin.weight/exp_avg" in names
    net2, opt2 = build(2, loaded_as, 1)
    mgr.load(1, {"model": net2, "optimizer": opt2})
    assert all(torch.equal(a, b) for a, b in zip(flat(net, opt), flat(net2, opt2), strict=True))
    mgr.close()
