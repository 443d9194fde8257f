"""The manifest's nesting limit (coci_hpc/checkpoint/manifest.py, ``_depth``): counted on the JSON
text since 2026-11-30 (issue 33), so brackets inside strings must not count and a manifest that
parses but nests past MAX_DEPTH must still be refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from coci_hpc.checkpoint import CheckpointManager, integrity
from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from coci_hpc.errors import CheckpointCorrupt
from tests.checkpoint.helpers import full_state


@pytest.mark.parametrize(("text", "depth"), [
    (b'{}', 1), (b'{"a":1}', 1), (b'[{}]', 2), (b'[[],[[]]]', 3), (b'[1,2,{"a":[3]}]', 3),
    (b'{"a":[{"b":"[[[["}]}', 3),            # brackets in a string
    (b'{"x":"\\\\\\"[","y":[1]}', 2),        # an escaped backslash, then an escaped quote
    (b'{"x":"\\n[\\\\","y":[{}]}', 3),       # a string ending in an escaped backslash
    (b'[' * 70 + b']' * 70, mf.MAX_DEPTH + 1),  # counted only to just past the limit
])
def test_depth_counts_the_nesting_of_arrays_and_objects_outside_strings(text: bytes, depth: int) -> None:
    json.loads(text)
    assert mf._depth(text) == depth


def _resealed(step_dir: Path, edit) -> None:
    path = step_dir / mf.MANIFEST
    m = json.loads(path.read_bytes())
    m.pop(integrity.MANIFEST_KEY)
    edit(m)
    path.write_text(json.dumps(integrity.seal(m), separators=(",", ":")))


def _nested(n: int) -> object:
    out: object = 0
    for _ in range(n):
        out = [out]
    return out


def test_a_manifest_nested_past_the_limit_is_refused_and_strings_of_brackets_are_not(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, comm=None, keep=3)
    mgr.save(1, full_state(1))
    mgr.save(2, full_state(2))
    mgr.close()
    # a string of brackets deeper than the limit: no nesting at all, still a valid manifest
    _resealed(cat.step_dir(tmp_path, 1), lambda m: m.update(note="[" * 200 + "{" * 200))
    assert mf.read(cat.step_dir(tmp_path, 1), step=1)["note"].startswith("[[[")
    # resealed, so only the nesting check can catch it
    _resealed(cat.step_dir(tmp_path, 2), lambda m: m.update(note=_nested(mf.MAX_DEPTH)))
    with pytest.raises(CheckpointCorrupt, match=f"nested deeper than {mf.MAX_DEPTH} levels"):
        mf.read(cat.step_dir(tmp_path, 2), step=2)
