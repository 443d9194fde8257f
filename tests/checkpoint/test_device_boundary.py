"""The state matrix under the FAKE device boundary (tests/checkpoint/fake_device.py, issue 32).

What a GPU changes, on the CPU: ``from_local`` / ``.to`` / ``.cpu()`` copy, non-blocking copies
land only at the wait, reused pinned buffers are poisoned. Every layout (DDP-style plain tensors,
FSDP2, tensor parallel, HSDP) through the sync and async save, the memory tier's copy, the
survivors' save and export + import, loaded into a fresh state: every full tensor and one more
Adam step as the saver's. With the wrap-before-fill order of 50299f1 put back in
``load._install`` every DTensor case here fails (checked by hand; without the fake they pass).
Real processes under ``mpiexec`` (gloo), real FSDP2 / DTensor, real HDF5 files.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint.conftest import SCRIPTS, run_ranks

JOB = str(SCRIPTS / "boundary_job.py")
CASES = {
    1: ["sync-plain", "async-plain", "survivors-plain", "export-plain", "sync-fsdp", "async-fsdp", "memtier-fsdp",
        "export-fsdp", "sync-tp", "async-tp", "memtier-tp"],
}
CASES[2] = CASES[1] + ["sync-hsdp", "async-hsdp", "memtier-hsdp"]


def job(n: int, *args: Any) -> dict[str, Any]:
    p = run_ranks(n, JOB, *map(str, args), timeout=300)
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def matrix(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp(f"boundary{request.param}")
    return root, job(request.param, "matrix", root)


def test_state_matrix_under_the_fake_device_boundary(matrix: tuple[Path, dict[str, Any]]) -> None:
    _, result = matrix
    assert sorted(result["cases"]) == sorted(CASES[result["world"]])
    bad = {case: problems[:4] for case, problems in result["cases"].items() if problems}
    assert not bad, bad
    # the fake was in force: the paths a GPU takes were taken
    crossings = result["crossings"]
    assert crossings["from_local"] > 0 and crossings["side_stream"] > 0 and crossings["cpu"] > 0
    assert crossings["poisoned_buffers"] > 0 and crossings["to"] > 0
    # the snapshot's and the memory tier's device copies: on an ordered side stream, into page-locked memory
    assert crossings["side_stream_waits"] > 0 and crossings["registered"] > 0
    assert crossings["unordered"] == 0 and crossings["unpinned_dst"] == 0, crossings
    # the loads into device tensors went through the restore's staging buffers (reused, poisoned)
    assert crossings["uploads"] > 0 and crossings["poisoned_staging"] > 0


def test_resharded_and_plain_cpu_loads(matrix: tuple[Path, dict[str, Any]]) -> None:
    """The FSDP2 checkpoint of N ranks into FSDP2 on 1 rank under the fake, and into a plain
    model in a process without it (a CPU process reading what a device run wrote)."""
    root, saved = matrix
    for args in (("fsdp",), ("plain", "--no-fake")):
        got = job(1, "load", root, *args)
        assert got["step"] == 2
        assert got["hashes"] == saved["hashes"], args


def test_shards_on_another_device_than_their_mesh_are_refused(tmp_path: Path) -> None:
    errors = job(1, "mixed", tmp_path)["errors"]
    for what in ("save", "load"):
        assert errors[what] is not None, what
        assert "'replicated/extras/w'" in errors[what] and "device mesh" in errors[what], errors[what]
    assert errors["latest_after_save"] is None      # nothing written
    assert errors["unchanged"]                      # nothing loaded


def test_device_memory_a_load_needs_and_too_little_refused_naming_the_tensor(tmp_path: Path) -> None:
    """A fresh optimizer's moments are made on the mesh's device while the checkpoint is checked;
    where the device has too little free memory for them the load stops with a CheckpointError
    naming the tensor and its bytes, before anything of the state changed. With exactly that
    memory free it loads (the loaded moments go into those targets, not into second copies), and a
    model alone loads with none (into its own shards)."""
    cases = job(1, "oom", tmp_path)["errors"]
    for case in ("install", "model-only"):   # no device memory beyond the moments' own, none for a model
        assert cases[case]["error"] is None and cases[case]["loaded"], (case, cases[case])
    got = cases["check"]
    assert got["error"] is not None, got
    assert "not enough memory on the device" in got["error"] and "'replicated/optimizer/state/" in got["error"], got
    assert "bytes" in got["error"] and got["hint"] and "free device memory" in got["hint"], got
    assert got["unchanged"] and not got["has_optimizer_state"], got
