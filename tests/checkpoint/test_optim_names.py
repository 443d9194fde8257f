"""Optimizer state keyed by parameter names: the mapping to and from positions (pure, one process)."""
from __future__ import annotations

import pytest
import torch

from coci_hpc.checkpoint.optim_names import is_fqn_keyed, param_names, to_fqn, to_index
from coci_hpc.errors import CheckpointError


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _stepped(model: torch.nn.Module, params: list) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(params, lr=1e-2)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return opt


def test_names_come_from_the_model_in_the_state_without_wrapper_prefixes() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert param_names({"model": model, "optimizer": opt}, opt) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    compiled = torch.nn.Module()
    compiled._orig_mod = model   # the attribute torch.compile's wrapper holds the model under
    assert param_names({"m": compiled}, opt) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert param_names({"optimizer": opt}, opt) is None                         # no model: by position
    assert param_names({"model": torch.nn.Linear(3, 4), "optimizer": opt}, opt) is None   # not its model


def test_a_reordered_optimizer_gets_each_parameters_own_state() -> None:
    a = _net()
    opt_a = _stepped(a, list(a.parameters()))
    named = to_fqn(opt_a.state_dict(), param_names({"model": a}, opt_a) or [])
    assert is_fqn_keyed(named) and not is_fqn_keyed(opt_a.state_dict())
    b = _net()
    opt_b = torch.optim.Adam(list(b.parameters())[::-1], lr=1e-2)   # another order
    opt_b.load_state_dict(to_index(named, opt_b, param_names({"model": b}, opt_b), "optimizer"))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a.state[pa][k], opt_b.state[pb][k]), (na, k)
    # an index-keyed tree (an older checkpoint) passes through unchanged
    old = opt_a.state_dict()
    assert to_index(old, opt_b, None, "optimizer") is old


def test_other_parameters_or_groups_are_refused_naming_them() -> None:
    a = _net()
    opt_a = _stepped(a, list(a.parameters()))
    named = to_fqn(opt_a.state_dict(), param_names({"model": a}, opt_a) or [])
    b = _net()
    fewer = torch.optim.Adam(list(b.parameters())[:2], lr=1e-2)
    with pytest.raises(CheckpointError, match=r"2\.bias"):
        to_index(named, fewer, ["0.weight", "0.bias"], "optimizer")
    ps = list(b.parameters())
    split = torch.optim.Adam([{"params": ps[:2]}, {"params": ps[2:]}], lr=1e-2)
    with pytest.raises(CheckpointError, match="parameter groups differ"):
        to_index(named, split, param_names({"model": b}, split), "optimizer")
    with pytest.raises(CheckpointError, match="holds no model"):
        to_index(named, split, None, "optimizer")


@pytest.mark.parametrize("loader_named", [True, False])
def test_a_reordered_optimizer_over_named_parameters_keeps_each_name_at_its_parameter(loader_named) -> None:
    # torch >= 2.6: an optimizer over model.named_parameters() keeps "param_names" in its groups
    a = _net()
    opt_a = _stepped(a, list(a.named_parameters()))
    named = to_fqn(opt_a.state_dict(), param_names({"model": a}, opt_a) or [])
    b = _net()
    order = list(b.named_parameters())[::-1]
    opt_b = torch.optim.Adam(order if loader_named else [p for _, p in order], lr=1e-2)
    opt_b.load_state_dict(to_index(named, opt_b, param_names({"model": b}, opt_b), "optimizer"))
    name_of = {id(p): n for n, p in b.named_parameters()}
    group = opt_b.param_groups[0]
    assert group["param_names"] == [name_of[id(p)] for p in group["params"]]
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(opt_a.state[pa]["exp_avg"], opt_b.state[pb]["exp_avg"]), na
