"""PyTorch Lightning with coci_hpc: the Session's guarantees for a ``Trainer`` that owns the loop.

Two lines in the user's script::

    from coci_hpc.integrations.lightning import CociCallback, CociCheckpointIO

    trainer = L.Trainer(max_steps=N, ..., plugins=[CociCheckpointIO()], callbacks=[CociCallback()])
    trainer.fit(model, datamodule)          # no ckpt_path: resumes from coci's store by itself

What each part owns:

- :class:`CociCallback` runs a :class:`~coci_hpc.session.Session` from Lightning's hooks instead of
  a ``for`` loop (:class:`_HookSession`: the body of ``Session.steps()`` split at the hooks). At
  ``setup`` it starts the session (signals recorded from then on, the newest committed checkpoint
  read); at ``on_train_start`` it takes SIGTERM back from Lightning (whose handler runs a collective
  inside the handler) and learns the number of optimizer steps; after every optimizer step
  (``on_train_batch_end`` once ``global_step`` moved) every rank agrees, saves when the planner says
  (two-phase) and, on a recorded signal, saves synchronously, requeues and ends the process with
  status 0 (``SystemExit(0)``, as the Session does).
- :class:`CociCheckpointIO` is the bridge between Lightning's checkpoint dict and the store: the
  whole dict (model, optimizers, schedulers, loop progress, callbacks' state, the datamodule's and
  the train loader's state) goes into the store as one state entry, never pickled; Lightning
  restores it through its own path (``strategy.load_checkpoint``), fed from the store. Files that
  Lightning itself writes (the user's ``ModelCheckpoint``, ``trainer.save_checkpoint(path)``) still
  go to ordinary files through the wrapped ``TorchCheckpointIO``.

Why not ``trainer.should_stop`` at a stop: Lightning would then run the epoch's end (validation, the
user's ``ModelCheckpoint`` saving inside Slurm's grace time) and return from ``fit()`` into code
written for a finished run. Ending the process at the boundary after the save is what the Session
does.

- Under DDP the callback has Lightning inject :class:`ResumableDistributedSampler` into a
  ``StatefulDataLoader`` (:func:`resumable_sampler`): its state holds the epoch, which Lightning's
  own sampler lacks (Lightning builds a resumed loader's iterator before ``set_epoch``).

- Under FSDP2, Lightning's own ``ModelParallelStrategy`` keeps its checkpoint away from the
  CheckpointIO and is refused; its subclass ``CociModelParallelStrategy``
  (:mod:`coci_hpc.integrations.lightning_model_parallel`) hands the callback the sharded model and
  optimizers, which go into the session as entries of their own (the session then starts at
  ``on_fit_start``, once they exist).

Not covered (see docs/how-to/lightning.md): other strategies (FSDP1 and DeepSpeed: refused), the
survivors' save and the memory tier (off: a lost rank falls back to the last committed
checkpoint), gradient accumulation across a stop (boundaries are optimizer steps only, so nothing
accumulated is ever lost).
"""
from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import DistributedSampler

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
except ImportError as exc:          # an optional dependency: say how to get it
    raise ImportError(f"coci_hpc.integrations.lightning needs PyTorch Lightning ({exc}); "
                      f"install it with: pip install 'coci_hpc[lightning]'") from exc

from coci_hpc.checkpoint.leaves import PerRank
from coci_hpc.checkpoint.rng import capture_rng, restore_rng
from coci_hpc.checkpoint.state import collect
from coci_hpc.errors import CheckpointError, UsageError
from coci_hpc.runtime import errorexit, signals, teardown
from coci_hpc.runtime.data import LOADER_HINT, is_stateful_dataloader
from coci_hpc.session import Session

STATE_ENTRY = "lightning"           # the state entries: Lightning's checkpoint dict (and its per-rank part)
STORE_SCHEME = "coci://"            # the "path" Lightning is given for the store's checkpoint
TESTED = ("2.6",)                   # Lightning versions this module was tested with (private hooks below)
FIX_PAIR = ("Trainer(plugins=[CociCheckpointIO()], callbacks=[CociCallback()]): the callback saves and "
            "stops, the plugin restores; one without the other does neither")


def _say(msg: str) -> None:
    import sys
    print(f"coci: {msg}", file=sys.stderr, flush=True)


def store_path(ckpt_dir: Path, step: int) -> str:
    """The path Lightning is told it restores from (it is only ever logged and handed back to us)."""
    return f"{STORE_SCHEME}{ckpt_dir}#step={step}"


def is_store_path(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(STORE_SCHEME)


def is_sharded(strategy: Any) -> bool:
    """A strategy that hands the callback its sharded model and optimizers as state entries of their
    own (``coci_objects()``, ``coci_dump()``): :mod:`coci_hpc.integrations.lightning_model_parallel`."""
    return callable(getattr(strategy, "coci_objects", None)) and callable(getattr(strategy, "coci_dump", None))


def refuse_store_save(path: Any) -> None:
    if is_store_path(path):
        raise UsageError(f"trainer.save_checkpoint({str(path)!r}): coci's store is written by CociCallback "
                         f"at step boundaries all ranks agreed on", hint="save to a file path instead")


# ------------------------------------------------------------------- the train loader's sampler
class _ResumableMixin:
    """A ``DistributedSampler`` whose state is ``(epoch, yielded)``: the epoch comes back with it.

    Why: on a resume Lightning builds the train loader's iterator (``FitLoop.setup_data``) *before*
    it calls ``set_epoch`` (``FitLoop.on_advance_start``) and never builds it again for that epoch;
    a sampler whose state lacks the epoch resumes in epoch 0's order. The iteration is lazy (the
    order is computed at the first index, not at ``iter()``), so a ``set_epoch`` between the two
    is honoured as well. torchdata's ``BatchSampler`` saves this state through the
    ``StatefulDataLoader`` (at the batch the loop consumed, also with workers)."""

    epoch: int

    def _resumable_init(self) -> None:
        self.yielded = 0
        self._resume_at: tuple[int, int] | None = None    # (epoch, samples taken) of the saved state

    def __iter__(self) -> Any:
        resume, self._resume_at = self._resume_at, None
        return self._indices(resume)

    def _indices(self, resume: tuple[int, int] | None) -> Any:
        # Skip what the saved state had taken only in the epoch it was saved in: a stop after an
        # epoch's last batch saved (epoch e, all of it), and Lightning goes on with epoch e + 1
        # (set_epoch between iter() and here), which starts from its first sample. Skipping there
        # emptied epoch e + 1, and the run went on in epoch e + 2's order.
        skip = resume[1] if resume is not None and resume[0] == self.epoch else 0
        self.yielded = skip
        for i, index in enumerate(super().__iter__()):  # type: ignore[misc]
            if i >= skip:
                self.yielded += 1
                yield index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "yielded": int(self.yielded)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.set_epoch(int(state["epoch"]))  # type: ignore[attr-defined]
        self.yielded = int(state["yielded"])
        self._resume_at = (self.epoch, self.yielded)


class ResumableDistributedSampler(_ResumableMixin, DistributedSampler):
    """Lightning's ``DistributedSampler`` (order from ``seed`` and the epoch only) that resumes in
    the epoch it stopped in. Injected by :class:`CociCallback` under DDP in place of the one
    Lightning would inject for a ``StatefulDataLoader`` with ``shuffle=True`` or ``False``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resumable_init()


class ResumableDistributedSamplerWrapper(_ResumableMixin, DistributedSamplerWrapper):
    """Lightning's wrapper around a sampler of the user's, resumable in the same way: the user's
    sampler is told the epoch (``set_epoch``) before it is iterated; its order must follow from it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resumable_init()


def _is_torchdata_random(sampler: Any) -> bool:
    return any(c.__name__ == "RandomSampler" and c.__module__.startswith("torchdata.")
               for c in type(sampler).__mro__)


def resumable_sampler(original: Any, loader: Any) -> Any:
    """The resumable sampler for the one Lightning chose (``original``) for ``loader``.

    torchdata's ``RandomSampler`` (a ``StatefulDataLoader(shuffle=True)``) is not torch's, so
    Lightning would wrap it (``DistributedSamplerWrapper``): each epoch's order would then also
    come from that sampler's own generator, which is advanced by every ``iter()`` (three times while
    a resumed iterator is built) and saved nowhere. It is replaced by the ``DistributedSampler``
    Lightning gives torch's ``RandomSampler``: the order is the shuffle of ``(seed, epoch)``."""
    if type(original) is DistributedSampler:
        return ResumableDistributedSampler(original.dataset, num_replicas=original.num_replicas,
                                           rank=original.rank, shuffle=original.shuffle, seed=original.seed,
                                           drop_last=original.drop_last)
    if type(original) is DistributedSamplerWrapper:
        inner = original.dataset._sampler  # type: ignore[attr-defined]  # Lightning's _DatasetSamplerWrapper
        if _is_torchdata_random(inner):
            return ResumableDistributedSampler(loader.dataset, num_replicas=original.num_replicas,
                                               rank=original.rank, shuffle=True, seed=original.seed,
                                               drop_last=original.drop_last)
        return ResumableDistributedSamplerWrapper(inner, num_replicas=original.num_replicas, rank=original.rank,
                                                  shuffle=original.shuffle, seed=original.seed,
                                                  drop_last=original.drop_last)
    return original


# ------------------------------------------------------------------------------------ the plugin
class CociCheckpointIO(CheckpointIO):
    """Lightning's checkpoint I/O: the store's checkpoint for a resume, ordinary files for the rest.

    ``load_checkpoint`` of the store's path (``coci://...``, set by :class:`CociCallback`) returns the
    dict the callback read from the newest committed checkpoint; any other path (a
    ``ModelCheckpoint`` file) goes to ``files``. ``save_checkpoint`` and ``remove_checkpoint`` always
    go to ``files``: the store is written by the callback at agreed step boundaries, never from a
    Lightning hook on one rank.

    Args:
        files: Where Lightning's own files go (default ``TorchCheckpointIO``).
    """

    def __init__(self, files: CheckpointIO | None = None) -> None:
        self.files = files if files is not None else TorchCheckpointIO()
        self.callback: CociCallback | None = None
        self._loaded: dict[str, Any] | None = None

    def require_callback(self, what: str) -> None:
        if self.callback is None:
            raise UsageError(f"CociCheckpointIO was asked to {what} but no CociCallback is in the Trainer",
                             hint=FIX_PAIR)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        refuse_store_save(path)
        self.require_callback("save a checkpoint")
        self.files.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if not is_store_path(path):
            self.require_callback("load a checkpoint")
            return self.files.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if self._loaded is None:
            raise UsageError(f"{path} was not read from the store by CociCallback",
                             hint="let fit() resume by itself: do not pass ckpt_path")
        checkpoint, self._loaded = self._loaded, None
        return checkpoint

    def remove_checkpoint(self, path: _PATH) -> None:
        if is_store_path(path):
            raise UsageError(f"cannot remove {path}: the store keeps its own checkpoints (Session keep=)",
                             hint="remove files only")
        self.files.remove_checkpoint(path)

    def teardown(self) -> None:
        if self.callback is None:
            _say("warning: CociCheckpointIO ran without CociCallback: nothing was saved to coci's store; "
                 + FIX_PAIR)
        self.files.teardown()


# ------------------------------------------------------------------ Lightning's dict as coci state
class _LightningState:
    """The Session's state entries for Lightning's checkpoint dict (``dump_checkpoint``, taken once
    per save on every rank, at the boundary, so a collective one stays collective): :attr:`shared`,
    the replicated part (model, optimizers, schedulers, callbacks, datamodule), and :attr:`rank`, the
    per-rank part (``"loops"``: loop progress, each rank's train-loader position and logged
    metrics, which differ across ranks). Loading hands the merged dict to the plugin; Lightning
    restores it later through its own path. While the session loads (``loading``) the current trees
    are empty: the loaded tensors are fresh buffers, nothing is written into the live model behind
    Lightning's back."""

    PER_RANK = ("loops",)

    def __init__(self, trainer: pl.Trainer, plugin: CociCheckpointIO) -> None:
        self.trainer, self.plugin = trainer, plugin
        self.loading = False
        self._rank_part: dict[str, Any] | None = None
        self._loaded: dict[str, dict[str, Any]] = {}
        self.shared, self.rank = _Part(self, "shared"), _Part(self, "rank")

    def dump(self) -> dict[str, Any]:
        strategy = self.trainer.strategy
        # Under CociModelParallelStrategy the model and optimizers are state entries of their own
        # (sharded, loaded in place): Lightning's dict leaves them out.
        held = strategy.coci_dump() if is_sharded(strategy) else contextlib.nullcontext()  # type: ignore[attr-defined]
        with held:
            return self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)

    def tree(self, part: str) -> dict[str, Any]:
        if self.loading:
            return {}
        if part == "shared":          # first in the state's order: one dump serves both parts
            checkpoint = self.dump()
            self._rank_part = {k: checkpoint.pop(k) for k in self.PER_RANK if k in checkpoint}
            return checkpoint
        rank_part, self._rank_part = self._rank_part, None
        if rank_part is None:
            raise AssertionError("the per-rank part of Lightning's checkpoint was asked for before the shared one")
        return rank_part

    def loaded(self, part: str, tree: Mapping[str, Any]) -> None:
        self._loaded[part] = dict(tree)
        if len(self._loaded) == 2:
            self.plugin._loaded = {**self._loaded.pop("shared"), **self._loaded.pop("rank")}


class _Part:
    def __init__(self, owner: _LightningState, part: str) -> None:
        self.owner, self.part = owner, part

    def state_dict(self) -> dict[str, Any]:
        return self.owner.tree(self.part)

    def load_state_dict(self, tree: Mapping[str, Any]) -> None:
        self.owner.loaded(self.part, tree)


def check_encodable(checkpoint: Mapping[str, Any]) -> None:
    """Refuse, naming where, a checkpoint dict the store cannot hold without pickle."""
    try:
        collect({STATE_ENTRY: dict(checkpoint)}, rng=False, defer_device=True)
    except CheckpointError as exc:
        raise UsageError(f"Lightning's checkpoint cannot go into coci's store: {exc.message}",
                         hint="the store holds tensors, numpy arrays and JSON values (never pickle): keep "
                              "hyper-parameters (save_hyperparameters) and the state_dict() of callbacks, "
                              "the datamodule and loaders to those, e.g. vars(namespace), str(path)") from exc


# --------------------------------------------------------------------- the Session, from the hooks
class _HookSession(Session):
    """``Session.steps()`` split at Lightning's hooks: :meth:`begin` (the restore, before Lightning's
    own restore reads it), :meth:`boundary` after each optimizer step, :meth:`finish` at the end,
    :meth:`close` as the ``finally`` of the loop."""

    def begin(self) -> int:
        self._started = True
        return self._begin()

    def boundary(self, step: int, dt: float, total: int) -> None:
        self._after_step(step, dt, total)

    def finish(self, total: int) -> None:
        self._finish(total)

    def close(self, completed: bool) -> None:
        self._watch.close()
        self._op_timeout.restore()
        self.recorder.uninstall()
        self.survival.close()
        signals.after_session(completed)


# ------------------------------------------------------------------------------------ the callback
class CociCallback(Callback):
    """Preemption-safe Lightning training: planned checkpoints, stop on Slurm's signals, requeue, resume.

    Every rank, same arguments; pair it with :class:`CociCheckpointIO`. The arguments are the
    :class:`~coci_hpc.session.Session`'s (``None``: from coci-submit's ``COCI_*`` environment, else the
    defaults). The run's length is Lightning's (``max_steps``, or ``max_epochs`` with a sized train
    loader: ``trainer.estimated_stepping_batches``); a step is an optimizer step (``global_step``).

    Refused with a clear error: the callback without the plugin (or the reverse, at its first use),
    ``fit(ckpt_path=...)`` (coci resumes from its store), a strategy other than single-device, DDP or
    ``CociModelParallelStrategy``,
    a train loader without ``state_dict()`` (a mid-epoch resume would replay the epoch), a
    ``SLURMEnvironment(auto_requeue=True)`` passed explicitly (Lightning's own requeue; one that
    Lightning chose by itself is switched off with a note), a checkpoint dict the store cannot hold
    without pickle.
    """

    def __init__(self, ckpt_dir: str | Path | None = None, *, policy: str | None = None,
                 max_requeues: int | None = None, no_progress_limit: int | None = None,
                 signal_lead_s: float | None = None, keep: int = 2, async_save: bool = True,
                 horizon_s: float = 24 * 3600.0, resume_from_other_run: bool | None = None,
                 peer_timeout_s: float | None = None, **session_kwargs: Any) -> None:
        errorexit.install()    # a refusal ends the script with one line and its exit code
        self._kwargs: dict[str, Any] = dict(
            ckpt_dir=ckpt_dir, policy=policy, max_requeues=max_requeues, no_progress_limit=no_progress_limit,
            signal_lead_s=signal_lead_s, keep=keep, async_save=async_save, horizon_s=horizon_s,
            resume_from_other_run=resume_from_other_run, peer_timeout_s=peer_timeout_s, **session_kwargs)
        self.session: _HookSession | None = None
        self.plugin: CociCheckpointIO | None = None
        self.total: int | None = None
        self.resumed_step: int | None = None
        self._state: _LightningState | None = None
        self._last_global_step = 0
        self._t = 0.0
        self._rng: dict[str, Any] | None = None
        self._rng_epoch_done = False
        self._closed = False
        self._patched: list[tuple[Any, str]] = []
        self._originals: dict[Any, Any] | None = None     # Lightning's signal handlers to restore at its teardown

    # -- checks -----------------------------------------------------------------------------------
    @staticmethod
    def _plugin_of(trainer: pl.Trainer) -> CociCheckpointIO:
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, CociCheckpointIO):
            raise UsageError(f"CociCallback needs CociCheckpointIO as the Trainer's checkpoint I/O "
                             f"(it has {type(io).__name__})", hint=FIX_PAIR)
        return io

    @staticmethod
    def _check_strategy(trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        if type(strategy) in (DDPStrategy, SingleDeviceStrategy) or \
                (isinstance(strategy, ModelParallelStrategy) and is_sharded(strategy)):
            return
        fsdp2 = "; for FSDP2: strategy=CociModelParallelStrategy() (coci_hpc.integrations.lightning_model_parallel)"
        if isinstance(strategy, ModelParallelStrategy):
            # Lightning 2.6: ModelParallelStrategy.save_checkpoint/load_checkpoint write and read
            # torch.distributed.checkpoint files at a path themselves ("does not use the
            # CheckpointIO"), loading straight into the sharded model and optimizers.
            raise UsageError("CociCallback cannot resume Lightning's own ModelParallelStrategy (FSDP2): it saves "
                             "and loads its checkpoint itself (torch.distributed.checkpoint files), never through "
                             "the CheckpointIO, so coci's store has no way into its restore",
                             hint="use strategy=CociModelParallelStrategy(...) from "
                                  "coci_hpc.integrations.lightning_model_parallel (same arguments)")
        raise UsageError(f"CociCallback supports single-device, DDP and CociModelParallelStrategy training; this "
                         f"Trainer uses {type(strategy).__name__}", hint="use strategy='ddp' (or one device)" + fsdp2)

    @staticmethod
    def _check_auto_requeue(trainer: pl.Trainer, rank: int) -> None:
        connector = trainer._accelerator_connector
        env = connector.cluster_environment
        if not isinstance(env, SLURMEnvironment) or not env.auto_requeue:
            return
        fix = "Trainer(plugins=[SLURMEnvironment(auto_requeue=False), CociCheckpointIO()], ...)"
        if connector._cluster_environment_flag is env:     # the user passed it: their explicit choice
            raise UsageError("SLURMEnvironment(auto_requeue=True) makes Lightning save and requeue inside its "
                             "signal handler, beside coci's stop", hint=f"pass {fix}")
        env.auto_requeue = False   # Lightning chose it by itself: coci owns the stop and the requeue
        if rank == 0:
            _say(f"Lightning's SLURM auto-requeue switched off (coci saves and requeues); {fix} says so explicitly")

    # -- Lightning's hooks ------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.session is not None:
            return
        self.plugin = self._plugin_of(trainer)
        self.plugin.callback = self
        self._check_strategy(trainer)
        self._check_auto_requeue(trainer, trainer.global_rank)
        if is_sharded(trainer.strategy):
            return           # the model is sharded and its optimizers built after setup: on_fit_start
        self._begin(trainer, {})

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.session is None and self.plugin is not None and is_sharded(trainer.strategy):
            # After the strategy's setup, before Lightning's restore: the sharded model and the
            # optimizers go into the session as entries of their own, loaded in place
            self._begin(trainer, trainer.strategy.coci_objects())  # type: ignore[attr-defined]

    def _begin(self, trainer: pl.Trainer, objects: dict[str, Any]) -> None:
        """Start the session: its state is ``objects`` and Lightning's checkpoint dict; the newest
        committed checkpoint is read (Lightning's dict for its own restore, via the plugin)."""
        assert self.plugin is not None
        if trainer.world_size > 1:
            # Lightning's process group: no gloo release in flight when Python finalizes (an FSDP2
            # script's full_tensor() after fit() aborted rank 1 at exit without it: runtime/teardown.py)
            teardown.install()
        self._state = _LightningState(trainer, self.plugin)
        check_encodable(self._state.dump())
        state = {**objects, STATE_ENTRY: self._state.shared, f"{STATE_ENTRY}_rank": PerRank(self._state.rank)}
        self.session = _HookSession(state, survivors=False, **self._kwargs)
        self._state.loading = True
        try:
            step = self.session.begin()
        except BaseException:
            self._close(False)
            raise
        finally:
            self._state.loading = False
        if self.plugin._loaded is not None:
            self.resumed_step = step
            # The RNG the session restored: given back again where the uninterrupted run stood
            # (Lightning draws from it between here and the first batch: a loader's base seed).
            self._rng = capture_rng()
        self._patch_restore(trainer)
        self._patch_sampler(trainer)

    def _patch(self, obj: Any, name: str, replacement: Any) -> None:
        """Set ``obj.name`` on this trainer's object only; :meth:`_close` puts the original back."""
        if name in vars(obj):
            raise AssertionError(f"{type(obj).__name__}.{name} is patched already")
        self._patched.append((obj, name))
        setattr(obj, name, replacement)

    def _patch_sampler(self, trainer: pl.Trainer) -> None:
        """Under DDP Lightning injects a distributed sampler into the train loader; for a
        ``StatefulDataLoader`` it gets a resumable one instead (:func:`resumable_sampler`: the epoch
        is in its state, so a resume mid-epoch continues that epoch's order)."""
        from lightning.pytorch.trainer.states import RunningStage

        connector = trainer._data_connector
        original = connector._resolve_sampler

        def _resolve_sampler(dataloader: Any, shuffle: bool, mode: RunningStage | None = None) -> Any:
            sampler = original(dataloader, shuffle, mode=mode)
            if mode == RunningStage.TRAINING and is_stateful_dataloader(dataloader):
                return resumable_sampler(sampler, dataloader)
            return sampler

        self._patch(connector, "_resolve_sampler", _resolve_sampler)

    def _patch_restore(self, trainer: pl.Trainer) -> None:
        """Lightning restores from the path ``fit()`` was given; with none it would start fresh. The
        connector's ``resume_start`` is given the store's path when the store had a checkpoint, and
        refuses a ``ckpt_path`` of the user's (it would disagree with the store)."""
        connector = trainer._checkpoint_connector
        original = connector.resume_start
        session = self.session
        assert session is not None
        ckpt_dir, resumed = session.config.ckpt_dir, self.resumed_step

        def resume_start(checkpoint_path: _PATH | None = None, weights_only: bool | None = None) -> None:
            if checkpoint_path is not None and not is_store_path(checkpoint_path):
                where = f"the store's newest checkpoint is step {resumed}" if resumed is not None \
                    else "the store is empty: a fresh start"
                raise UsageError(f"fit(ckpt_path={str(checkpoint_path)!r}) disagrees with coci's store in "
                                 f"{ckpt_dir} ({where})",
                                 hint="drop ckpt_path: CociCallback resumes from its store by itself; to start "
                                      "from a Lightning checkpoint's weights, load them into the module before "
                                      "fit(), or use another --ckpt-dir")
            if checkpoint_path is None and resumed is not None:
                checkpoint_path = store_path(ckpt_dir, resumed)
            original(checkpoint_path, weights_only)

        self._patch(connector, "resume_start", resume_start)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        session = self.session
        if session is None:
            return
        try:
            self._take_signals(trainer)
            total = trainer.estimated_stepping_batches
            if not math.isfinite(total) or total <= 0:
                raise UsageError("CociCallback needs a finite run: Lightning cannot tell how many optimizer "
                                 "steps this fit makes", hint="set Trainer(max_steps=N), or max_epochs with a "
                                                              "train loader that has a len()")
            self.total = int(total)
            if trainer.global_step != session.step:
                raise CheckpointError(f"Lightning restored global_step {trainer.global_step}, coci's store "
                                      f"step {session.step}", hint="the checkpoint dict was changed by an "
                                      "on_load_checkpoint hook; report it")
            if session.step > self.total:
                session.mgr.close()
                session.book.refuse_total(session.step, self.total)
            self._check_loaders(trainer)
        except BaseException:
            self._close(False)
            raise
        self._last_global_step = trainer.global_step
        self._t = time.perf_counter()

    def _take_signals(self, trainer: pl.Trainer) -> None:
        """Lightning installed its SIGTERM handler after ours (it broadcasts inside the handler and
        raises at the next batch): ours goes back on top, and Lightning's teardown will restore what
        was there before coci (not our recorder)."""
        assert self.session is not None
        before = self.session.recorder.take_back()
        originals = trainer._signal_connector._original_handlers
        for s, prev in before.items():
            if s in originals:
                originals[s] = prev
        self._originals = originals

    @staticmethod
    def _check_loaders(trainer: pl.Trainer) -> None:
        from lightning.fabric.utilities.types import _Stateful

        combined = trainer.fit_loop._combined_loader
        loaders = list(combined.flattened) if combined is not None else []
        plain = [type(dl).__name__ for dl in loaders if not isinstance(dl, _Stateful)]
        if plain:
            raise UsageError(f"the train loader ({', '.join(plain)}) has no state_dict(): a stop mid-epoch would "
                             f"resume at the epoch's first batch", hint=LOADER_HINT)
        for sampler in (s for dl in loaders for s in (getattr(dl, "sampler", None),
                                                      getattr(getattr(dl, "batch_sampler", None), "sampler", None))):
            if isinstance(sampler, DistributedSampler) and not isinstance(sampler, _ResumableMixin) \
                    and "epoch" not in _state_of(sampler):
                raise UsageError(f"the train loader's {type(sampler).__name__} does not save its epoch: Lightning "
                                 f"builds a resumed loader's iterator before it calls set_epoch(), so a resume "
                                 f"after the first epoch would draw epoch 0's order",
                                 hint="leave the distributed sampler to Lightning (CociCallback then injects a "
                                      "resumable one), or give yours a state_dict() with its 'epoch' and a "
                                      "load_state_dict() that sets it")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng is not None and not self._rng_epoch_done:
            restore_rng(self._rng)       # a resume at an epoch's end: the next epoch starts from here
            self._rng_epoch_done = True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._rng is not None:
            if batch_idx > 0:            # a resume mid-epoch: the uninterrupted run was here
                restore_rng(self._rng)
            self._rng = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        session, total = self.session, self.total
        step = trainer.global_step
        if session is None or total is None or self._closed or step == self._last_global_step:
            return                       # accumulating gradients: not a step boundary
        self._last_global_step = step
        session.observe(_loss_of(outputs))
        now = time.perf_counter()
        dt, self._t = now - self._t, now
        completed = False
        try:
            session.boundary(step, dt, total)   # a stop saves, requeues and raises SystemExit(0)
            if step >= total:
                session.finish(total)
                completed = True
        except BaseException:
            self._close(False)
            raise
        if completed:
            self._close(True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        session = self.session
        if session is None or self._closed:
            return
        # Lightning ended before the planned steps (EarlyStopping, should_stop): the run is done here.
        try:
            session.finish(trainer.global_step)
        finally:
            self._close(True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        session = self.session
        if session is None or self._closed:
            return
        try:
            if not isinstance(exception, (SystemExit, KeyboardInterrupt)):
                session.peer_loss.after_exception(session.step, session.sync)   # a lost peer, or not
        finally:
            self._close(False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close(False)

    def _close(self, completed: bool) -> None:
        while self._patched:
            obj, name = self._patched.pop()
            delattr(obj, name)       # the class's method shows through again
        if self.session is not None and not self._closed:
            self._closed = True
            self.session.close(completed)
            # Lightning's teardown (after this, unless it ran already: then the dict is empty) sets
            # every signal back to its handler from before fit(): for coci's signals, that is what
            # the session's end left, e.g. a completed run's USR1/USR2 ignored (a late Slurm
            # warning must not kill a finished run: signals.after_session), not the default action.
            originals, self._originals = self._originals or {}, None
            for s in signals.SHIELDED:
                if s in originals:
                    originals[s] = signal.getsignal(s)


def _state_of(obj: Any) -> Mapping[str, Any]:
    state = obj.state_dict() if callable(getattr(obj, "state_dict", None)) else {}
    return state if isinstance(state, Mapping) else {}


def _loss_of(outputs: Any) -> float:
    """The step's loss from what ``training_step`` returned (a tensor or a dict with ``"loss"``)."""
    value = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    try:
        return float(value) if value is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


def cluster_layout(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """``num_nodes`` and ``devices`` for ``Trainer`` from how the ranks were launched (srun,
    coci-submit, mpiexec, plain python), so the script runs unchanged under each.

    Under an MPI launch inside Slurm (coci-submit's ``srun --mpi=pmix``) Lightning picks its
    ``SLURMEnvironment``, which would take the first node's name from ``SLURM_NODELIST`` as the
    rendezvous address; here rank 0's host name and a free port are sent over MPI instead (as
    :func:`coci_hpc.init_distributed` does) and set as ``MASTER_ADDR`` / ``MASTER_PORT`` unless
    they are set already. Collective under MPI."""
    import os
    import socket

    from coci_hpc.comm import Comm
    from coci_hpc.runtime.distributed import rendezvous
    from coci_hpc.slurm.env import JobEnvironment

    env = os.environ if environ is None else environ
    job = JobEnvironment.from_env(env)
    world = Comm.world()
    if world.is_mpi and world.size > 1:
        if job.in_slurm_job and environ is None:
            values, _ = rendezvous(world, job)
            for key in ("MASTER_ADDR", "MASTER_PORT"):
                os.environ.setdefault(key, values[key])
        hosts = world.allgather(socket.gethostname())
        nodes = job.step_num_nodes or job.num_nodes or len(set(hosts))
        return {"num_nodes": nodes, "devices": world.size // nodes}
    if job.in_slurm_job and job.ntasks:
        nodes = job.step_num_nodes or job.num_nodes or 1
        return {"num_nodes": nodes, "devices": job.ranks_per_node}
    return {"num_nodes": 1, "devices": 1}
