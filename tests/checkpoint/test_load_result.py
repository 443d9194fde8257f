"""LoadResult's repr is one short line (issue 26 item 10): the manifest it carries lists every tensor."""
from __future__ import annotations

from coci_hpc.checkpoint.load import LoadResult


def test_repr_is_short_and_leaves_the_manifest_out() -> None:
    manifest = {"format_version": 2, "tensors": {f"model.layer{i}.weight": {"shape": [4096, 4096], "dtype": "f4",
                                                                          "crc32c": 123456 + i} for i in range(500)}}
    r = LoadResult(step=40, saved_world_size=2, missing=(), manifest=manifest)
    text = repr(r)
    assert text == "LoadResult(step=40, saved_world_size=2, missing=(), manifest=<500 tensor(s)>)"
    assert len(text) < 120 and "layer0" not in text
    assert r.manifest is manifest                  # still there for those who read it
