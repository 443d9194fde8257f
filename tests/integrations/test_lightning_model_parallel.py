"""coci_hpc.integrations.lightning_model_parallel: Lightning's ModelParallelStrategy (FSDP2) with
coci's store. examples/lightning_train.py --strategy fsdp2 under mpiexec -n 2 (gloo), stopped by a
signal after a checkpoint and started again, ends bit-identical to an uninterrupted run, with the
model's and Adam's state in the store as DTensor shards (each rank wrote its own); the strategy
brings its CociCheckpointIO and leaves the store to CociCallback. (Lightning's own strategy refused
with this one named: tests/integrations/test_lightning.py.) The 2-node run through coci-submit is in
tests/integrations/test_lightning_cluster.py."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

from coci_hpc.checkpoint import catalog  # noqa: E402
from coci_hpc.errors import UsageError  # noqa: E402
from coci_hpc.integrations.lightning import CociCallback, CociCheckpointIO  # noqa: E402
from coci_hpc.integrations.lightning_model_parallel import CociModelParallelStrategy  # noqa: E402
from coci_hpc.runtime.events import read_events  # noqa: E402
from tests.conftest import ROOT, clean_env, reference_hash, reference_run, run_ranks  # noqa: E402

TRAIN = str(ROOT / "examples" / "lightning_train.py")
# 64 batches of 32 per epoch on 2 ranks: 40 steps cross an epoch end; the stop comes after step 8
ARGS = ["--strategy", "fsdp2", "--steps", "40", "--policy", "fixed:8", "--seed", "1"]
MPIEXEC = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2"]


def test_fsdp2_stopped_and_resumed_ends_bit_identical(tmp_path: Path) -> None:
    ref = reference_hash(reference_run(2, "-m", "mpi4py", TRAIN, *ARGS, ckpt_dir=tmp_path / "ref",
                                       timeout=300).stdout)
    run = tmp_path / "run"
    cmd = [*MPIEXEC, sys.executable, "-m", "mpi4py", TRAIN, *ARGS, "--ckpt-dir", str(run), "--step-time", "0.1"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not any(e["event"] == "checkpoint" for e in read_events(run)):
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()[0][-3000:]
            time.sleep(0.2)
        p.send_signal(signal.SIGUSR1)            # mpiexec forwards it to both ranks
        out = p.communicate(timeout=180)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "final_params_sha256" not in out, out[-3000:]
    stops = [e for e in read_events(run) if e["event"] == "stop"]
    assert len(stops) == 1 and stops[0]["saved"] and stops[0]["signal"] == "SIGUSR1", stops
    stopped = stops[0]["step"]
    assert 8 <= stopped < 40

    # The store holds the model and Adam's moments as DTensors: one global dataset each, of which
    # each rank wrote its half; Lightning's own dict beside them has no model or optimizer state.
    m = catalog.read_step(run, stopped)
    tensors = {t["name"]: t for t in m["tensors"]}
    weight, moment = "replicated/model/net.0.weight", "replicated/optimizer/state/net.0.weight/exp_avg"
    for name in (weight, moment):
        t = tensors[name]
        assert t["kind"] == "dtensor" and t["shape"] == [64, 16], t
        assert sorted((b[0], tuple(b[1]), tuple(b[2])) for b in t["boxes"]) == [(0, (0, 0), (32, 16)),
                                                                                 (1, (32, 0), (32, 16))], t
    shared = m["skeletons"]["replicated"]["lightning"]
    assert shared["state_dict"] == {} and shared["optimizer_states"] == [{}], shared.keys()

    out = run_ranks(2, "-m", "mpi4py", TRAIN, *ARGS, "--ckpt-dir", str(run), "--step-time", "0.1", timeout=300).stdout
    assert reference_hash(out) == ref
    starts = [e for e in read_events(run) if e["event"] == "attempt_start"]
    assert [s["resumed_step"] for s in starts] == [None, stopped], starts
    assert f"step={stopped} " not in out and f"step={stopped + 1} " in out     # no step done twice


def _trainer(strategy: object, plugins: list | None = None) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, plugins=plugins, logger=False,
                     enable_checkpointing=False, callbacks=[CociCallback()])


def test_strategy_brings_its_checkpoint_io_and_keeps_the_store_to_the_callback() -> None:
    assert isinstance(_trainer(CociModelParallelStrategy()).strategy.checkpoint_io, CociCheckpointIO)
    mine = CociCheckpointIO()
    assert _trainer(CociModelParallelStrategy(), [mine]).strategy.checkpoint_io is mine
    other = _trainer(CociModelParallelStrategy(), [TorchCheckpointIO()])
    with pytest.raises(UsageError, match="CociCallback needs CociCheckpointIO"):
        CociCallback._plugin_of(other)
    with pytest.raises(UsageError, match="coci's store is written by CociCallback"):
        CociModelParallelStrategy().save_checkpoint({}, "coci:///tmp/run#step=3")
    with pytest.raises(UsageError, match="was not read from the store by CociCallback"):
        CociModelParallelStrategy().load_checkpoint("coci:///tmp/run#step=3")

