"""coci_hpc.integrations.lightning in one process: a stop on a recorded signal at a step boundary,
the restart resumes (mid-epoch) and ends bit-identical to an uninterrupted run; the user's
ModelCheckpoint keeps writing its files beside it; the bad inputs are refused with the fix named.
The 2-node acceptance through coci-submit is tests/integrations/test_lightning_cluster.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from coci_hpc.errors import UsageError  # noqa: E402
from coci_hpc.integrations.lightning import CociCallback, CociCheckpointIO  # noqa: E402
from coci_hpc.runtime.events import read_events  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
from toy_task import make_data, params_sha256  # noqa: E402

STEPS = 50                 # 24 batches per epoch: the stop (~step 17) is mid-epoch, the end in epoch 3


class Tiny(L.LightningModule):
    """A small regression model with dropout (the RNG must come back too); sends itself SIGUSR1
    inside the step ``signal_at`` (a handler that only records: the stop comes at a boundary)."""

    def __init__(self, signal_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 1))
        self.signal_at = signal_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.signal_at is not None and self.trainer.global_step == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader(stateful: bool = True) -> Any:
    x, y = make_data(384, 8)
    cls = StatefulDataLoader if stateful else DataLoader
    return cls(TensorDataset(x, y), batch_size=16, shuffle=True)


def _trainer(ckpt: Path | None, *, plugins: list | None = None, callbacks: list | None = None,
             **kw: Any) -> Any:
    plugins = [CociCheckpointIO()] if plugins is None else plugins
    callbacks = [CociCallback(ckpt_dir=ckpt, policy="fixed:10")] if callbacks is None else callbacks
    kw = {"enable_checkpointing": False, **kw}
    return L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, plugins=plugins, callbacks=callbacks,
                     **kw)


def _fit(trainer: Any, model: Any, loader: Any = None, **kw: Any) -> str:
    torch.manual_seed(1)                       # the global RNG: shuffle order and dropout
    trainer.fit(model, loader if loader is not None else _loader(), **kw)
    return params_sha256(model)


def test_stop_on_a_signal_then_resume_mid_epoch_is_bit_identical(tmp_path: Path) -> None:
    reference = _fit(_trainer(tmp_path / "ref"), Tiny())

    ckpt, files = tmp_path / "run", tmp_path / "mc"
    # whatever handler this worker process had (an earlier test's, under xdist) must come back
    before = signal.getsignal(signal.SIGUSR1)
    def user_checkpoint() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=files, every_n_train_steps=20, save_top_k=-1, filename="{step}")
    with pytest.raises(SystemExit) as stop:
        _fit(_trainer(ckpt, callbacks=[CociCallback(ckpt_dir=ckpt, policy="fixed:10"), user_checkpoint()],
                      enable_checkpointing=True), Tiny(signal_at=15))
    assert stop.value.code == 0
    events = read_events(ckpt)
    stops = [e for e in events if e["event"] == "stop"]
    assert len(stops) == 1 and stops[0]["saved"] and stops[0]["signal"] == "SIGUSR1", stops
    stopped = stops[0]["step"]
    assert 16 <= stopped <= 18 and stopped % 24 != 0       # at a boundary after the signal, mid-epoch
    assert signal.getsignal(signal.SIGUSR1) == before   # handed back

    trainer = _trainer(ckpt, callbacks=[CociCallback(ckpt_dir=ckpt, policy="fixed:10"), user_checkpoint()],
                       enable_checkpointing=True)
    resumed = _fit(trainer, Tiny())            # no ckpt_path: the store's newest checkpoint
    assert trainer.callbacks[0].resumed_step == stopped
    assert resumed == reference
    events = read_events(ckpt)
    assert [e["event"] for e in events if e["event"] in ("stop", "end")][-1] == "end"
    assert [e for e in events if e["event"] == "end"][-1]["status"] == "completed"
    planned = sorted(e["step"] for e in events if e["event"] == "checkpoint" and e["kind"] == "planned")
    assert planned and all(s % 10 == 0 for s in planned)
    # The user's ModelCheckpoint wrote its ordinary files, before and after the stop.
    assert sorted(p.name for p in files.iterdir()) == ["step=20.ckpt", "step=40.ckpt"]
    saved = torch.load(files / "step=40.ckpt", weights_only=False)
    assert saved["global_step"] == 40 and "optimizer_states" in saved


def test_a_finished_run_started_again_does_no_more_steps(tmp_path: Path) -> None:
    first = _fit(_trainer(tmp_path / "run"), Tiny())
    trainer = _trainer(tmp_path / "run")
    again = _fit(trainer, Tiny())
    assert trainer.global_step == STEPS and again == first


def test_a_late_warning_after_the_last_step_does_not_kill_the_finished_run(tmp_path: Path) -> None:
    """Slurm's warning (USR1/USR2) can come while a completed run is still exiting; the session
    ignores it from its end on (signals.after_session), and Lightning's teardown, which restores
    every signal's handler from before fit(), must not give it its default action (death) back:
    the 2-node DDP run's last attempt died of SIGUSR2 after its final hash that way (2026-11-29)."""
    late = (signal.SIGUSR1, signal.SIGUSR2)
    before = {s: signal.getsignal(s) for s in (*late, signal.SIGTERM)}
    try:
        for s in late:
            signal.signal(s, signal.SIG_DFL)
        _fit(_trainer(tmp_path / "run"), Tiny())
        assert [signal.getsignal(s) for s in late] == [signal.SIG_IGN, signal.SIG_IGN]
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_callback_without_plugin_and_plugin_without_callback_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="CociCallback needs CociCheckpointIO") as err:
        _fit(_trainer(tmp_path / "a", plugins=[]), Tiny())
    assert "plugins=[CociCheckpointIO()]" in (err.value.hint or "")
    files = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=5)
    with pytest.raises(UsageError, match="no CociCallback is in the Trainer"):
        _fit(_trainer(None, callbacks=[files], enable_checkpointing=True), Tiny())


def test_ckpt_path_that_disagrees_with_the_store_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "run"
    other = tmp_path / "other.ckpt"
    trainer = _trainer(ckpt)
    _fit(trainer, Tiny())
    trainer.save_checkpoint(other)
    with pytest.raises(UsageError, match=r"disagrees with coci's store .*newest checkpoint is step 50") as err:
        _fit(_trainer(ckpt), Tiny(), ckpt_path=str(other))
    assert "drop ckpt_path" in (err.value.hint or "")
    with pytest.raises(UsageError, match=r"store is empty"):
        _fit(_trainer(tmp_path / "fresh"), Tiny(), ckpt_path=str(other))


def test_plain_dataloader_and_unencodable_hyperparameters_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="has no state_dict") as err:
        _fit(_trainer(tmp_path / "a"), Tiny(), _loader(stateful=False))
    assert "StatefulDataLoader" in (err.value.hint or "")

    class WithHparams(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": 1e-3, "where": Path("/data")})
    with pytest.raises(UsageError, match=r"cannot go into coci's store.*PosixPath.*hyper_parameters") as err:
        _fit(_trainer(tmp_path / "b"), WithHparams())
    assert "never pickle" in (err.value.hint or "")


def test_auto_requeue_explicit_is_refused_and_lightnings_own_choice_is_switched_off(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(UsageError, match=r"auto_requeue=True") as err:
        _fit(_trainer(tmp_path / "a", plugins=[SLURMEnvironment(auto_requeue=True), CociCheckpointIO()]), Tiny())
    assert "SLURMEnvironment(auto_requeue=False)" in (err.value.hint or "")
    # Inside an srun step Lightning picks SLURMEnvironment(auto_requeue=True) by itself.
    for k, v in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "t", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                 "SLURM_NODEID": "0", "SLURM_JOB_ID": "77", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "1"}.items():
        monkeypatch.setenv(k, v)
    trainer = _trainer(tmp_path / "b")
    env = trainer._accelerator_connector.cluster_environment
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue
    CociCallback._check_auto_requeue(trainer, 0)
    assert not env.auto_requeue and "auto-requeue switched off" in capsys.readouterr().err


def test_import_coci_hpc_does_not_import_lightning() -> None:
    code = ("import sys, coci_hpc, coci_hpc.session, coci_hpc.integrations; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert out.strip() == "[]"


def _ddp_loader(rank: int, *, coci: bool = True) -> Any:
    """Rank ``rank`` of 2's train loader as Lightning builds it under DDP (``_prepare_dataloader``:
    its distributed sampler injected), with CociCallback's replacement or Lightning's own."""
    from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    from coci_hpc.integrations.lightning import resumable_sampler

    torch.manual_seed(3)           # the loader's own RandomSampler draws its generator's seed here
    dl = StatefulDataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True)
    sampler = _get_distributed_sampler(dl, shuffle=True, overfit_batches=0, num_replicas=2, rank=rank)
    if coci:
        sampler = resumable_sampler(sampler, dl)
    return _update_dataloader(dl, sampler, mode=RunningStage.TRAINING)


def _set_epoch(loader: Any, epoch: int) -> None:
    from lightning.fabric.utilities.data import _set_sampler_epoch
    _set_sampler_epoch(loader, epoch)              # what FitLoop.on_advance_start calls


def _batches(it: Any, n: int | None = None) -> list[list[int]]:
    return [b[0].tolist() for _, b in zip(range(n) if n is not None else iter(int, 1), it)]


@pytest.mark.parametrize("coci", [True, False])
def test_ddp_train_loader_resumes_in_the_epoch_it_stopped_in(coci: bool) -> None:
    """Lightning builds a resumed loader's iterator before it calls set_epoch (FitLoop.setup_data,
    then on_advance_start), and never again for that epoch. With the sampler CociCallback injects,
    the rest of epoch 1 and epoch 2 are the uninterrupted run's batches on each rank; with the one
    Lightning injects for a StatefulDataLoader(shuffle=True) they are not (the cause of the 2-rank
    divergence: its order also comes from the loader's own generator, advanced per iter() and saved
    nowhere, and the epoch is not in its state)."""
    for rank in (0, 1):
        run = _ddp_loader(rank, coci=coci)
        epochs, state = [], None
        for epoch in range(3):
            _set_epoch(run, epoch)
            it = iter(run)
            epochs.append(_batches(it, 2))
            if epoch == 1:
                state = run.state_dict()            # stopped after 2 batches of epoch 1
            epochs[-1] += _batches(it)
        assert len(epochs[1]) == 5 and epochs[1] != epochs[2]

        resumed = _ddp_loader(rank, coci=coci)
        resumed.load_state_dict(state)
        it = iter(resumed)                          # Lightning's order: iter() first ...
        _set_epoch(resumed, 1)             # ... then set_epoch
        rest = _batches(it)
        _set_epoch(resumed, 2)
        after = _batches(iter(resumed))
        same = rest == epochs[1][2:] and after == epochs[2]
        assert same is coci, (rank, rest, epochs[1][2:])


def test_ddp_train_loader_stopped_after_an_epochs_last_batch_resumes_with_the_next_epoch() -> None:
    """A stop right after the last batch of epoch 1 saved (epoch 1, all of it). Lightning resumes
    with epoch 2: it builds the iterator, then calls set_epoch(2); epoch 2 must start at its first
    batch. (Skipping the saved count there emptied epoch 2 and Lightning went on in epoch 3's
    order: the 2-node DDP run stopped at step 288, 9 epochs of 32 batches, ended with another hash,
    2026-11-29; a 2-rank stop at step 32 reproduced it.)"""
    for rank in (0, 1):
        run = _ddp_loader(rank)
        epochs, state = [], None
        for epoch in range(3):
            _set_epoch(run, epoch)
            it = iter(run)
            epochs.append(_batches(it, len(run)))   # every batch, the iterator not yet run out
            if epoch == 1:
                state = run.state_dict()            # stopped after the epoch's last batch
            assert _batches(it) == []
        resumed = _ddp_loader(rank)
        resumed.load_state_dict(state)
        it = iter(resumed)                          # Lightning's order: iter() first ...
        _set_epoch(resumed, 2)                      # ... then set_epoch, with the next epoch
        assert _batches(it) == epochs[2], rank


def test_a_distributed_sampler_of_the_users_without_its_epoch_in_its_state_is_refused() -> None:
    from types import SimpleNamespace

    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    data = TensorDataset(torch.arange(40))
    def trainer_with(sampler: Any) -> Any:       # only what _check_loaders reads of a Trainer
        loader = StatefulDataLoader(data, batch_size=4, sampler=sampler)
        return SimpleNamespace(fit_loop=SimpleNamespace(_combined_loader=SimpleNamespace(flattened=[loader])))
    theirs = StatefulDistributedSampler(data, num_replicas=2, rank=0)      # its state: {"yielded": n}
    with pytest.raises(UsageError, match=r"StatefulDistributedSampler does not save its epoch") as err:
        CociCallback._check_loaders(trainer_with(theirs))
    assert "leave the distributed sampler to Lightning" in (err.value.hint or "")
    CociCallback._check_loaders(trainer_with(_ddp_loader(0).batch_sampler.sampler))     # the injected one


def test_lightnings_model_parallel_strategy_is_refused_naming_why_and_the_fix() -> None:
    """Lightning's ModelParallelStrategy (FSDP2) runs on the CPU with gloo, but saves and loads its
    checkpoint itself, never through the CheckpointIO: the callback refuses it at setup and names
    CociModelParallelStrategy (tests/integrations/test_lightning_model_parallel.py), which it takes."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    from coci_hpc.integrations.lightning_model_parallel import CociModelParallelStrategy

    strategy = ModelParallelStrategy()
    with pytest.raises(TypeError, match="does not use the `CheckpointIO`"):     # Lightning's own refusal
        strategy.save_checkpoint({}, "unused", storage_options=object())
    with pytest.raises(UsageError, match=r"ModelParallelStrategy \(FSDP2\).*never through the CheckpointIO") as err:
        CociCallback._check_strategy(SimpleNamespace(strategy=strategy))
    assert "strategy=CociModelParallelStrategy(...) from coci_hpc.integrations.lightning_model_parallel" \
        in (err.value.hint or "")
    CociCallback._check_strategy(SimpleNamespace(strategy=CociModelParallelStrategy()))
