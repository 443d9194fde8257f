"""A module whose loaded bytes were written straight into its own tensors skips
``load_state_dict`` (a self-copy of every parameter); anything that could make that wrong keeps it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.checkpoint.restore import _loaded_in_place


def _tree(m: torch.nn.Module) -> tuple[dict[str, Any], frozenset[int]]:
    sd = dict(m.state_dict())
    return sd, frozenset(id(v) for v in sd.values())


def test_plain_module_written_in_place_skips_load_state_dict() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    tree, ids = _tree(m)
    assert _loaded_in_place(m, tree, ids)
    # one tensor not written in place (a fresh buffer): the ordinary path
    assert not _loaded_in_place(m, tree, ids - {id(tree["0.weight"])})
    # a copy with the same values is not the module's memory
    assert not _loaded_in_place(m, {**tree, "0.bias": tree["0.bias"].clone()},
                                ids | {id(tree["0.bias"].clone())})


def test_user_hooks_and_copies_keep_load_state_dict() -> None:
    m = torch.nn.Linear(3, 4)
    m.register_load_state_dict_post_hook(lambda *a: None)
    tree, ids = _tree(m)
    assert not _loaded_in_place(m, tree, ids)

    class Copies(torch.nn.Linear):  # state_dict() hands out copies: writing them changes nothing
        def _save_to_state_dict(self, dest: Any, prefix: str, keep_vars: bool) -> None:
            super()._save_to_state_dict(dest, prefix, keep_vars)
            if not keep_vars:
                for k in list(dest):
                    dest[k] = dest[k].clone()

    c = Copies(3, 4)
    tree, ids = _tree(c)
    assert not _loaded_in_place(c, tree, ids)


def test_round_trip_with_and_without_the_skip(tmp_path: Path) -> None:
    torch.manual_seed(0)

    class Copies(torch.nn.Linear):
        def _save_to_state_dict(self, dest: Any, prefix: str, keep_vars: bool) -> None:
            super()._save_to_state_dict(dest, prefix, keep_vars)
            if not keep_vars:
                for k in list(dest):
                    dest[k] = dest[k].clone()

    for make in (lambda: torch.nn.Linear(5, 3), lambda: Copies(5, 3)):
        m = make()
        want = {k: v.clone() for k, v in m.state_dict().items()}
        mgr = CheckpointManager(tmp_path / type(m).__name__, rng=False)
        mgr.save(1, {"model": m})
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        mgr.load(1, {"model": m})
        mgr.close()
        for k, v in m.state_dict().items():
            assert torch.equal(v, want[k]), k
