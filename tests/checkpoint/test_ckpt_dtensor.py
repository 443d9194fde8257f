"""DTensor state (FSDP2, tensor parallel, HSDP) in the checkpoint store, resharded on load.

Real processes: ``mpiexec -n 1/2/3/4 --oversubscribe``, torch.distributed on gloo (CPU), real
``fully_shard`` / ``parallelize_module``, real parallel HDF5 files. Every layout change compares
the full tensors (gathered with ``full_tensor()``) after the load with the ones saved.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.checkpoint import manifest as mf
from tests.checkpoint.conftest import SCRIPTS, run_ranks
from tests.checkpoint.helpers import flip_shard_byte

JOB = str(SCRIPTS / "dtensor_job.py")


def job(n: int, *args: Any) -> dict[str, Any]:
    p = run_ranks(n, JOB, *map(str, args), timeout=180)
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def check_loaded(saved: dict[str, Any], loaded: dict[str, Any], *, optimizer: bool = True,
                 continues: bool = False) -> None:
    want = saved["hashes"] if optimizer else {k: v for k, v in saved["hashes"].items() if k.startswith("model/")}
    got = loaded["hashes"] if optimizer else {k: v for k, v in loaded["hashes"].items() if k.startswith("model/")}
    assert got == want
    assert loaded["step"] == saved["step"]
    # the fresh optimizer's moments have the parameter's mesh and placements
    assert set(loaded["placements"].values()) <= {"same"}, loaded["placements"]
    # each rank read exactly the bytes its own state holds (its new boxes), no more
    for read, held in loaded["read"]:
        assert read == held
    if continues:  # one more Adam step from the loaded state gives the saver's next parameters
        assert loaded["next"] == saved["next"]


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("fsdp2")
    return root, job(2, "save", root, "fsdp", 1)


def test_fsdp2_saves_one_global_dataset_per_tensor(fsdp2: tuple[Path, dict[str, Any]]) -> None:
    root, saved = fsdp2
    m = cat.read_step(root, 1)
    dt = {t["name"]: t for t in m["tensors"] if t["kind"] == "dtensor"}
    w = dt["replicated/model/fc1.weight"]
    assert w["shape"] == [7, 10]
    # uneven FSDP2 chunks: 4 + 3 rows, each written by the rank that holds it
    assert sorted(map(tuple, [[b[0], *b[1], *b[2]] for b in w["boxes"]])) == [(0, 0, 0, 4, 10), (1, 4, 0, 3, 10)]
    # the optimizer's state is keyed by parameter name (as DCP's get_state_dict gives it)
    assert "replicated/optimizer/state/fc1.weight/exp_avg" in dt
    groups = m["skeletons"]["replicated"]["optimizer"]["param_groups"]
    assert groups[0]["params"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    # every byte of the dataset is written once: bytes in the file = unique state bytes
    shards = [s for s in m["shards"] if s["dataset"] == w["dataset"]]
    assert sum(s["stop"] - s["start"] for s in shards) == w["nbytes"] == 7 * 10 * 4
    with h5py.File(cat.step_dir(root, 1) / mf.DATA_FILE, "r") as f:  # h5py reads it whole
        assert f[w["dataset"]].shape == (7, 10)
        assert np.isfinite(f[w["dataset"]][()]).all()


def test_fsdp2_same_mesh(fsdp2: tuple[Path, dict[str, Any]]) -> None:
    root, saved = fsdp2
    check_loaded(saved, job(2, "load", root, "fsdp"), continues=True)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_fsdp2_other_world_size(fsdp2: tuple[Path, dict[str, Any]], n: int) -> None:
    root, saved = fsdp2
    loaded = job(n, "load", root, "fsdp")
    # on 1 rank the step is bit-identical; 3 and 4 ranks average the gradients in another order
    check_loaded(saved, loaded, continues=n == 1)
    if n > 1:  # a rank reads its new shards, not the whole state
        total = sum(held for _, held in loaded["read"])
        assert all(read < total / 2 for read, _ in loaded["read"])


def test_fsdp2_to_tensor_parallel(fsdp2: tuple[Path, dict[str, Any]]) -> None:
    root, saved = fsdp2
    check_loaded(saved, job(2, "load", root, "tp"))


def test_fsdp2_to_plain_model_in_one_process(fsdp2: tuple[Path, dict[str, Any]]) -> None:
    root, saved = fsdp2
    check_loaded(saved, job(1, "load", root, "plain"), continues=True)


def test_optimizer_state_follows_parameter_names(fsdp2: tuple[Path, dict[str, Any]]) -> None:
    """An optimizer over the parameters in another order (as another wrapping may build it) gets
    each parameter's own moments: the state is keyed by name, not position."""
    root, saved = fsdp2
    check_loaded(saved, job(1, "load", root, "plain-rev"), continues=True)


def test_index_keyed_optimizer_state_still_loads(tmp_path: Path) -> None:
    """A checkpoint written before optimizer state was keyed by name (its manifest rewritten
    to the old index-keyed skeleton and names) loads as before."""
    root = tmp_path / "old"
    saved = job(2, "save", root, "fsdp", 1)
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    _rewrite_index_keyed(root, 1, names)
    m = cat.read_step(root, 1)
    assert m["skeletons"]["replicated"]["optimizer"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    check_loaded(saved, job(2, "load", root, "fsdp"), continues=True)
    check_loaded(saved, job(1, "load", root, "plain"), continues=True)


def test_hsdp_to_fsdp2(tmp_path: Path) -> None:
    saved = job(4, "save", tmp_path, "hsdp", 2)
    m = cat.read_step(tmp_path, 2)
    w = next(t for t in m["tensors"] if t["name"] == "replicated/model/fc1.weight")
    assert w["kind"] == "dtensor" and len(w["boxes"]) == 2  # each shard once, not once per replica
    writers = [b[0] for t in m["tensors"] if t["kind"] == "dtensor" for b in t["boxes"]]
    assert len(set(writers)) == 4  # the writing is spread over the replicas
    check_loaded(saved, job(2, "load", tmp_path, "fsdp"))


def test_plain_and_sharded_checkpoints_to_fsdp2(tmp_path: Path) -> None:
    plain = job(1, "save", tmp_path / "plain", "plain", 1)
    check_loaded(plain, job(2, "load", tmp_path / "plain", "fsdp"))
    sharded = job(2, "save", tmp_path / "sharded", "sharded", 1)
    check_loaded(sharded, job(3, "load", tmp_path / "sharded", "fsdp", "model-only"), optimizer=False)


def test_flipped_byte_in_a_shard_falls_back(tmp_path: Path) -> None:
    first = job(2, "save", tmp_path, "fsdp", 1)
    job(2, "save", tmp_path, "fsdp", 2)
    flip_shard_byte(tmp_path, 2, lambda name: name == "replicated/model/fc1.weight", 1, 5, 0x10)
    loaded = job(3, "load", tmp_path, "fsdp")
    assert loaded["step"] == 1
    check_loaded(first, loaded)


def test_load_into_a_live_optimizer_is_all_or_nothing(tmp_path: Path) -> None:
    """Loading into a live FSDP2 optimizer (trained past the step loaded): a damaged step leaves
    its moments the same tensors with the same values; a good one loads with the parameter's
    placements, and training goes on as the saver's did."""
    got = job(2, "live", tmp_path)
    assert got["error"] == "CheckpointCorrupt"
    assert got["unchanged"]
    assert got["step"] == 1 and got["loaded"]
    assert set(got["placements"].values()) == {"same"}, got["placements"]
    assert got["continues"]


def test_async_two_phase_save_of_fsdp2(tmp_path: Path) -> None:
    saved = job(2, "asave", tmp_path)
    assert saved["changed"]  # training went on after the snapshot ...
    check_loaded(saved, job(3, "load", tmp_path, "fsdp"))  # ... the checkpoint holds the snapshot


def test_cached_layout_and_shape_change(tmp_path: Path) -> None:
    got = job(2, "cache", tmp_path)
    assert got["sources"][:3] == ["planned", "cached", "cached"]
    assert got["sources"][3] == "planned"  # a shape change plans again
    assert got["step"] == 4 and got["same"]


@pytest.mark.parametrize("case,error,words", [
    ("partial", "UsageError", ["Partial", "extras/w", "redistribute"]),
    ("subclass", "UsageError", ["extras/w", "subclass", "Odd"]),
    ("mesh", "UsageError", ["device mesh of 1 rank", "extras/w", "covers every rank"]),
    ("shape", "CheckpointError", ["global shape [8, 10]", "[7, 10]", "fc1.weight"]),
])
def test_bad_input(tmp_path: Path, case: str, error: str, words: list[str]) -> None:
    got = job(2, "bad", tmp_path, case)
    assert got["error"] is not None and got["error"][0] == error, got
    for w in words:
        assert w in got["error"][1], (w, got["error"][1])
    if case != "shape":
        assert got["latest"] is None  # nothing was written
    else:
        assert got["latest"] == 1


def test_replicas_of_a_dtensor_shard_that_differ_are_refused(tmp_path: Path) -> None:
    """HSDP on a 2 x 2 mesh: one replica of a shard changed on rank 2 only. One replica writes a
    replicated box, so the save would drop a rank's values silently: refused, naming the tensor
    and the ranks, before anything is written."""
    got = job(4, "bad", tmp_path, "replica")
    assert got["error"] is not None and got["error"][0] == "UsageError", got
    msg = got["error"][1]
    for w in ("'replicated/model/fc1.weight'", "ranks [0, 2]", "[[0], [2]]", "nothing was written"):
        assert w in msg, (w, msg)
    assert got["latest"] is None


def test_differing_boxes_groups_replicas_by_box() -> None:
    from coci_hpc.checkpoint.replicas import differing_boxes

    a, b = ((0, 0), (4, 10)), ((4, 0), (3, 10))
    same = [[(a, 7)], [(b, 8)], [(a, 7)], [(b, 8)]]   # 2 x 2: equal replicas, different shards
    assert differing_boxes(["w"], same) is None
    bad = [[(a, 7)], [(b, 8)], [(a, 9)], [(b, 8)]]
    assert differing_boxes(["w"], bad) == ("w", a, {7: [0], 9: [2]})


def test_runs_of_boxes() -> None:
    from coci_hpc.checkpoint.dtensor import runs

    # Shard(0): one run
    assert runs((7, 10), ((4, 0), (3, 10)), 4) == [(160, 0, 120)]
    # Shard(1) of a (3, 4) tensor, columns 2..3: one run per row
    assert runs((3, 4), ((0, 2), (3, 2)), 1) == [(2, 0, 2), (6, 2, 2), (10, 4, 2)]
    # a 2-D box of a 3-D tensor spanning the last dim whole: rows coalesce
    r = runs((4, 3, 5), ((1, 1, 0), (2, 2, 5)), 1)
    assert r == [(20, 0, 10), (35, 10, 10)]
    assert sum(n for _, _, n in r) == math.prod((2, 2, 5))
    assert runs((), ((), ()), 8) == [(0, 0, 8)]
    assert runs((4, 0), ((0, 0), (4, 0)), 4) == []


def _rewrite_index_keyed(root: Path, step: int, names: list[str]) -> None:
    """Make a checkpoint's optimizer look as the store wrote it before name-keying: leaf names
    ``.../state/<index>/...``, an index-keyed ``state`` and ``params`` (manifest re-sealed; the
    datasets keep their paths, which the manifest maps the names to)."""
    prefix = "replicated/optimizer/state/"
    index = {n: i for i, n in enumerate(names)}

    def rename(name: str) -> str:
        if name.startswith(prefix):
            fqn, _, rest = name[len(prefix):].partition("/")
            return f"{prefix}{index[fqn]}/{rest}"
        return name

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {"__tensor__"}:
                return {"__tensor__": rename(x["__tensor__"])}
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    d = cat.step_dir(root, step)
    m = mf.read(d)
    for t in m["tensors"]:
        t["name"] = rename(t["name"])
    opt = walk(m["skeletons"]["replicated"]["optimizer"])
    opt["state"] = {"__dict__": [[index[k], v] for k, v in opt["state"].items()]}
    for g in opt["param_groups"]:
        g["params"] = [index[n] for n in g["params"]]
    m["skeletons"]["replicated"]["optimizer"] = opt
    mf.commit(d, m)
