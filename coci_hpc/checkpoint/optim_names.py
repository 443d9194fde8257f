"""Optimizer state keyed by fully qualified parameter names, so it survives a change of wrapping.

``Optimizer.state_dict()`` keys its state by the position of each parameter in its param groups,
and ``load_state_dict`` maps positions back blindly: an optimizer built over the parameters in
another order (another wrapping, a model whose parameters were grouped differently) silently
gets another parameter's moments. When the state holds the optimizer's model beside it, the store
saves the optimizer the way ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives it:
``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``, with the names of
``model.named_parameters()`` cleaned of wrapper prefixes (DDP's ``module.``, ``torch.compile``'s
``_orig_mod.``, activation checkpointing's: :mod:`.fqn`) as DCP cleans them, the names the
model's own state is saved under. Sharded (DTensor) moments stay
sharded: only the keys change, no tensor is gathered, nothing collective runs.

Loading maps the names back to the *target* optimizer's positions, group by group, so the order
of parameters in the loading optimizer does not matter. A checkpoint written before this
(index-keyed) loads as before; an optimizer without its model in the state stays index-keyed.
Unlike DCP's ``set_state_dict`` nothing steps the optimizer to create its state first.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from coci_hpc.checkpoint.fqn import clean_names
from coci_hpc.errors import CheckpointError


def _models(state: Mapping[str, Any]) -> list[torch.nn.Module]:
    from coci_hpc.checkpoint.leaves import PerRank

    out = []
    for value in state.values():
        inner = value.value if isinstance(value, PerRank) else value
        if isinstance(inner, torch.nn.Module):
            out.append(inner)
    return out


def param_names(state: Mapping[str, Any], opt: torch.optim.Optimizer) -> list[str] | None:
    """The FQN of each of ``opt``'s parameters in its index order, from the first model of the
    state (top level or in PerRank) that holds all of them; None when there is none (the
    optimizer's state stays index-keyed)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if not params:
        return None
    for model in _models(state):
        named = list(model.named_parameters(remove_duplicate=True))
        by_id: dict[int, str] = {}
        for (_, p), name in zip(named, clean_names(model, [n for n, _ in named])):
            by_id.setdefault(id(p), name)
        names = [by_id.get(id(p)) for p in params]
        if all(n is not None for n in names) and len(set(names)) == len(names):
            return [str(n) for n in names]
    return None


def is_fqn_keyed(tree: Any) -> bool:
    """A saved optimizer tree (or its skeleton) whose param groups list names, not positions."""
    groups = tree.get("param_groups") if isinstance(tree, Mapping) else None
    if not isinstance(groups, list) or not groups:
        return False
    return all(isinstance(g, Mapping) and isinstance(g.get("params"), list) and g["params"]
               and all(isinstance(p, str) for p in g["params"]) for g in groups)


def to_fqn(tree: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """An index-keyed ``Optimizer.state_dict()`` keyed by parameter names instead."""
    out = dict(tree)
    out["state"] = {names[i]: v for i, v in tree.get("state", {}).items()}
    out["param_groups"] = [{**g, "params": [names[i] for i in g["params"]]} for g in tree["param_groups"]]
    return out


def to_index(tree: Mapping[str, Any], opt: torch.optim.Optimizer, names: list[str] | None,
             key: str) -> Mapping[str, Any]:
    """A name-keyed tree as ``opt.load_state_dict`` takes it: its state and groups in ``opt``'s
    own order (``names``: the FQNs of ``opt``'s parameters). An index-keyed tree is returned as
    it is (checkpoints written before optimizer state was keyed by name)."""
    if not is_fqn_keyed(tree):
        return tree
    hint = "load into an optimizer over the same parameters (same names) as the one that was saved"
    if names is None:
        raise CheckpointError(f"optimizer {key!r} was saved keyed by parameter names, but the state passed to "
                              f"load holds no model with all of its parameters to map the names to",
                              hint="pass the model in the same state as its optimizer (e.g. "
                                   "{'model': model, 'optimizer': opt})")
    saved_group: dict[str, int] = {}
    for gi, g in enumerate(tree["param_groups"]):
        for n in g["params"]:
            saved_group[n] = gi
    pos = {n: i for i, n in enumerate(names)}
    missing = sorted(set(names) - set(saved_group))
    extra = sorted(set(saved_group) - set(names))
    if missing or extra:
        raise CheckpointError(f"optimizer {key!r}: parameters {missing[:3]} have no saved state and the "
                              f"checkpoint's {extra[:3]} are not parameters of this optimizer", hint=hint)
    groups = []
    at = 0
    for g in opt.param_groups:
        mine = names[at:at + len(g["params"])]
        at += len(g["params"])
        src = {saved_group[n] for n in mine}
        if len(src) != 1 or len(tree["param_groups"][src.pop()]["params"]) != len(mine):
            raise CheckpointError(f"optimizer {key!r}: the parameter groups differ from the saved ones "
                                  f"(a group of this optimizer holds {mine[:3]}...)", hint=hint)
        saved = tree["param_groups"][saved_group[mine[0]]]
        group = {**saved, "params": [pos[n] for n in mine]}
        if "param_names" in saved:
            # An optimizer built over named_parameters() (torch >= 2.6) lists the names beside
            # the parameters, in their order; load_state_dict keeps the saved list when there is
            # one, which would name another parameter at each place of a reordered group. Keep
            # this optimizer's own list (load_state_dict then leaves it), else the saved names
            # in this optimizer's order.
            del group["param_names"]
            names_saved = saved["param_names"]
            if "param_names" not in g and isinstance(names_saved, list) and len(names_saved) == len(saved["params"]):
                by_fqn = dict(zip(saved["params"], names_saved))
                group["param_names"] = [by_fqn[n] for n in mine]
        groups.append(group)
    out = dict(tree)
    out["state"] = {pos[n]: v for n, v in tree.get("state", {}).items()}
    out["param_groups"] = groups
    return out
