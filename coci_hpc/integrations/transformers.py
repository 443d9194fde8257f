"""The Hugging Face ``Trainer`` on coci_hpc's :class:`~coci_hpc.session.Session`: signals recorded
and acted on at a step boundary every rank agrees on, the state in coci's store (no pickle), a
mid-epoch resume that seeks the sampler, and the planner's checkpoint schedule.

Two lines in a script that uses the Trainer::

    from coci_hpc.integrations.transformers import CociTrainer
    trainer = CociTrainer(model=model, args=args, train_dataset=ds, coci={"ckpt_dir": "/scratch/run1"})

How it fits in the Trainer's loop (transformers 5.24; docs/how-to/hf-trainer.md says why this
route and not Accelerate's ``save_state``):

- A Session runs inside ``train()``: :class:`CociCallback` starts it at ``on_train_begin`` (the
  optimizer and scheduler exist by then) and restores the newest committed checkpoint into the
  model, optimizer, LR scheduler, AMP scaler, RNG, the loader's position and the ``TrainerState``.
- The step boundary is where the Trainer is about to fetch the next step's batches
  (``get_batch_samples``): after ``on_step_end``, logging, evaluation and the epoch's end, so the
  RNG a resumed run starts from is the one the uninterrupted run fetched its next batch with.
  There the Session does what it does in its own loop: one agreement per step, planned two-phase
  saves, and on a signal the stop, the save, the requeue and ``SystemExit(0)`` out of ``train()``.
- The training loader is coci's: a rank-sharded sampler (:class:`ResumableBatches`) whose state
  is the global position the loop consumed, so a resume seeks it; the first epoch after a resume
  is handed to the Trainer as the rest of that epoch (``_run_epoch``), never a skip through
  batches. ``resume_from_checkpoint`` is not needed, and one that disagrees with the store is refused.
- The Trainer's own checkpoints (``save_strategy``) are not written (``_save_checkpoint``): they
  hold pickle and would be a second resume point beside the store.

The overridden methods ``_run_epoch`` and ``_save_checkpoint`` and the used ``get_batch_samples``,
``_remove_unused_columns`` and ``_get_collator_with_removed_columns`` are the Trainer's private API:
:data:`PRIVATE_API` pins their signatures, :func:`check_private_api` refuses a transformers whose
signatures differ, and ``pyproject.toml`` pins the tested range (the ``hf`` extra).
"""
from __future__ import annotations

import inspect
import json
import math
import os
import sys
from collections.abc import Generator, Iterator, Mapping
from functools import partial
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

try:
    import transformers
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import seed_worker
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("coci_hpc.integrations.transformers needs transformers and accelerate: "
                      "pip install 'coci_hpc[hf]'") from exc

from coci_hpc.checkpoint import catalog
from coci_hpc.checkpoint.rng import capture_rng, restore_rng
from coci_hpc.errors import CheckpointError, UsageError
from coci_hpc.runtime import errorexit
from coci_hpc.runtime.data import ResumableSampler
from coci_hpc.runtime.distributed import DistInfo
from coci_hpc.runtime.distributed import init_distributed as _coci_init_distributed
from coci_hpc.session import Session

TESTED = ">=5.24,<5.25"          # transformers versions whose private API matches PRIVATE_API
# The Trainer methods this module overrides or calls that are not public API, with their
# parameters in transformers 5.24 (tests/integrations/test_hf_trainer.py fails on a drift).
PRIVATE_API: dict[str, tuple[str, ...]] = {
    "_run_epoch": ("self", "model", "epoch", "train_dataloader", "steps_in_epoch", "num_update_steps_per_epoch",
                   "trial", "ignore_keys_for_eval", "start_time", "resume_from_checkpoint", "epochs_trained",
                   "steps_trained_in_current_epoch"),
    "_save_checkpoint": ("self", "model", "trial"),
    "get_batch_samples": ("self", "epoch_iterator", "num_batches", "device"),
    "_remove_unused_columns": ("self", "dataset", "description"),
    "_get_collator_with_removed_columns": ("self", "data_collator", "description"),
    "train": ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "training_step": ("self", "model", "inputs", "num_items_in_batch"),
}
# TrainerState fields that describe the run so far (the rest describe this run's arguments).
_STATE_FIELDS = ("global_step", "epoch", "num_input_tokens_seen", "total_flos", "log_history", "best_metric",
                 "best_global_step", "best_model_checkpoint")
_SESSION_ARGS = frozenset(inspect.signature(Session.__init__).parameters) - {"self", "state", "total_steps"}


def _say(msg: str) -> None:
    print(f"coci: {msg}", file=sys.stderr, flush=True)


def check_private_api(trainer_cls: type = Trainer) -> None:
    """Refuse a Trainer whose private methods this module relies on have other parameters."""
    drift = []
    for name, want in PRIVATE_API.items():
        fn = getattr(trainer_cls, name, None)
        got = tuple(inspect.signature(fn).parameters) if callable(fn) else None
        if got != want:
            drift.append(f"{name}{'(' + ', '.join(got) + ')' if got is not None else ' is missing'}")
    if drift:
        raise UsageError(f"transformers {transformers.__version__}: the Trainer's private methods that coci_hpc "
                         f"overrides changed: {'; '.join(drift)}",
                         hint=f"install the tested version: pip install 'transformers{TESTED}' "
                              f"(or pip install 'coci_hpc[hf]')")


def init_distributed(**kwargs: Any) -> DistInfo:
    """:func:`coci_hpc.init_distributed`, then the variables Accelerate reads to find the same world.

    Accelerate (under ``TrainingArguments``) takes the world size and rank from the environment,
    not from an initialised process group: under ``mpiexec`` or ``srun --mpi=pmix`` without them it
    would train every rank alone. Call it before creating ``TrainingArguments``. Collective.
    """
    info = _coci_init_distributed(**kwargs)
    if info.world_size > 1:
        hosts: list[Any] = [None] * info.world_size
        torch.distributed.all_gather_object(hosts, os.uname().nodename)
        mine = os.uname().nodename
        os.environ.update({"RANK": str(info.rank), "WORLD_SIZE": str(info.world_size),
                           "LOCAL_RANK": str(hosts[:info.rank].count(mine)),
                           "LOCAL_WORLD_SIZE": str(hosts.count(mine))})
        os.environ.setdefault("MASTER_ADDR", str(hosts[0]))   # checked by Accelerate, not used: the group exists
    return info


# ---------------------------------------------------------------------------- the data
class ResumableBatches:
    """A batch sampler for one rank of ``world_size``, resumable at the batch the loop consumed.

    The order of epoch ``e`` is :class:`~coci_hpc.runtime.data.ResumableSampler`'s (a permutation
    drawn from ``(seed, e)`` only); rank ``r`` takes every ``world_size``-th index from the global
    position. Its state (epoch and the global position the loop *consumed*, counted by
    :class:`ResumableLoader`, not what workers fetched ahead) is the same on every rank. An epoch
    has ``(n // world_size) // batch_size`` batches (the rest is dropped, as with ``drop_last``).
    """

    def __init__(self, n: int, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True) -> None:
        self.sampler = ResumableSampler(n, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size)
        if batch_size <= 0 or batch_size * world_size > n:
            raise UsageError(f"batch size {batch_size} x {world_size} ranks does not fit {n} samples",
                             hint="use a smaller per_device_train_batch_size or more samples")
        self.batch_size = batch_size

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def per_epoch(self) -> int:
        """Batches per epoch on each rank."""
        return (self.sampler.n // self.sampler.world_size) // self.batch_size

    def roll(self) -> None:
        """An epoch with less than a batch per rank left is the next epoch's start."""
        if self.sampler.remaining() < self.batch_size:
            self.sampler.epoch += 1
            self.sampler.position = 0

    def consumed_in_epoch(self) -> int:
        """Batches of the current epoch the loop has consumed."""
        return self.sampler.position // (self.batch_size * self.sampler.world_size)

    def advance(self) -> None:
        """The loop consumed one more batch (on every rank)."""
        self.sampler.position += self.batch_size * self.sampler.world_size

    def __len__(self) -> int:
        left = self.sampler.remaining() // self.batch_size
        return left if left > 0 else self.per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        self.roll()
        s = self.sampler
        perm, pos, step = s.permutation(s.epoch), s.position, self.batch_size * s.world_size
        while (s.n - pos) // s.world_size >= self.batch_size:
            yield perm[pos + s.rank:pos + step:s.world_size].tolist()
            pos += step

    def state_dict(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "batch_size": self.batch_size, "world_size": self.sampler.world_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = (int(state["batch_size"]), int(state["world_size"]))
        if saved != (self.batch_size, self.sampler.world_size):
            raise CheckpointError(
                f"the checkpoint's loader took batches of {saved[0]} on {saved[1]} ranks, this run takes "
                f"{self.batch_size} on {self.sampler.world_size}: its position would mean other samples",
                hint="resume with the same per_device_train_batch_size and number of ranks")
        self.sampler.load_state_dict(state)


class ResumableLoader(DataLoader):
    """A DataLoader over :class:`ResumableBatches` that counts the batches it hands to the loop.

    Its own generator, re-seeded from ``(seed, epoch)`` at each epoch, seeds the workers: creating
    the iterator draws nothing from the global RNG (a plain DataLoader draws one number there, so
    a resumed run, which creates it mid-epoch, would drift from an uninterrupted one).
    """

    def __init__(self, dataset: Any, batches: ResumableBatches, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=batches, generator=torch.Generator(), **kwargs)
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        b = self.batches
        b.roll()
        assert self.generator is not None
        self.generator.manual_seed(int(np.random.SeedSequence([b.sampler.seed, b.epoch]).generate_state(1)[0]))
        for batch in super().__iter__():
            b.advance()
            yield batch


class _Delegate:
    """Only ``state_dict``/``load_state_dict`` of an object: the LR scheduler's ``optimizer`` is
    Accelerate's wrapper, which the store must not take for an optimizer it can hook."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class _TrainerStateEntry:
    """The ``TrainerState`` of the run so far, and the exportable callbacks' state (e.g.
    ``EarlyStoppingCallback``'s patience counter), as one JSON string in the store."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        st = self.trainer.state
        callbacks: dict[str, list[Any]] = {}
        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, ExportableState):
                callbacks.setdefault(type(cb).__name__, []).append(cb.state())
        tree = {"state": {k: getattr(st, k) for k in _STATE_FIELDS}, "callbacks": callbacks}
        return {"json": json.dumps(tree, default=lambda o: o.item() if hasattr(o, "item") else str(o))}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        data = json.loads(saved["json"])
        for k, v in data["state"].items():
            setattr(self.trainer.state, k, v)
        for name, states in data["callbacks"].items():
            mine = [cb for cb in self.trainer.callback_handler.callbacks if type(cb).__name__ == name]
            for cb, st in zip(mine, states):
                for attr, value in st.get("attributes", {}).items():
                    setattr(cb, attr, value)


# ---------------------------------------------------------------------------- the callback
class CociCallback(TrainerCallback):
    """Starts and ends the Session inside ``train()`` (added by :class:`CociTrainerMixin`).

    The Session's handlers record SIGUSR1/SIGUSR2/SIGTERM and nothing else; the stop happens at the
    next step boundary every rank agrees on. The callback alone cannot move the Trainer's loop to
    that boundary, seek its loader or keep its own checkpoints out: added to a Trainer that is
    not a :class:`CociTrainerMixin`, it refuses to start.
    """

    def __init__(self) -> None:
        errorexit.install()            # a refusal ends `python train.py` with one line, no traceback
        self.trainer: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            raise UsageError(
                "CociCallback was added to a Trainer that is not a CociTrainer: a callback cannot seek the "
                "Trainer's data loader, keep its own checkpoints out or stop it at a step boundary",
                hint="use coci_hpc.integrations.transformers.CociTrainer (or mix CociTrainerMixin into your "
                     "Trainer subclass: class MyTrainer(CociTrainerMixin, SFTTrainer)); it adds the callback itself")
        self.trainer._coci_begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is not None:
            self.trainer._coci_step_end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is not None:
            self.trainer._coci_end()


# ---------------------------------------------------------------------------- the trainer
class CociTrainerMixin:
    """Mix into a ``transformers.Trainer`` (first): ``class MyTrainer(CociTrainerMixin, Trainer)``.

    Args (keyword, besides the Trainer's own):
        coci: Keyword arguments for the :class:`~coci_hpc.session.Session` (``ckpt_dir``,
            ``policy``, ``max_requeues``, ``signal_lead_s``, ``keep``, ``async_save``, ``init_from``,
            ...); unset ones come from coci-submit's environment (``COCI_CKPT_DIR``, ``COCI_POLICY``).

    The training loader is coci's (:class:`ResumableLoader`): ``train_dataset`` must be a map-style
    dataset (``__len__`` and ``__getitem__``); ``per_device_train_batch_size``,
    ``dataloader_num_workers``, ``dataloader_pin_memory`` and the collator are used,
    ``data_seed`` (else ``seed``) seeds the order; ``group_by_length`` and the Trainer's own samplers
    are not. ``train(resume_from_checkpoint=...)`` is not needed: a run resumes from its store.
    """

    # The Trainer's attributes and methods this mixin uses (annotations only: the Trainer has them).
    args: Any
    state: Any
    control: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    callback_handler: Any
    data_collator: Any
    add_callback: Any
    _remove_unused_columns: Any
    _get_collator_with_removed_columns: Any

    def __init__(self, *args: Any, coci: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        errorexit.install()            # a refusal ends `python train.py` with one line, no traceback
        unknown = sorted(set(coci or {}) - _SESSION_ARGS)
        if unknown:
            raise UsageError(f"unknown coci= settings: {', '.join(unknown)}",
                             hint=f"use the Session's keyword arguments: {', '.join(sorted(_SESSION_ARGS))}")
        check_private_api()               # transformers' methods, whatever the user's subclass adds
        super().__init__(*args, **kwargs)
        self._coci_kwargs = dict(coci or {})
        self._coci_session: Session | None = None
        self._coci_gen: Generator[int, None, None] | None = None
        self._coci_step = 0                      # the last step whose boundary the Session passed
        self._coci_batches: ResumableBatches | None = None
        self._coci_rng: dict[str, Any] | None = None   # RNG right after the restore, for the first fetch
        self._coci_loss: torch.Tensor | None = None
        self._coci_warned_save = False
        cbs = [cb for cb in self.callback_handler.callbacks if isinstance(cb, CociCallback)]
        if not cbs:
            self.add_callback(CociCallback())
            cbs = [cb for cb in self.callback_handler.callbacks if isinstance(cb, CociCallback)]
        cbs[0].trainer = self
        self._check_args()

    def _check_args(self) -> None:
        args = self.args
        if args.auto_find_batch_size:
            raise UsageError("auto_find_batch_size=True restarts the loop with another batch size: the loader's "
                             "position in the store would mean other samples",
                             hint="set per_device_train_batch_size yourself and auto_find_batch_size=False")
        if args.load_best_model_at_end:
            raise UsageError("load_best_model_at_end=True needs the Trainer's own checkpoints, which CociTrainer "
                             "does not write (coci's store holds the training state)",
                             hint="set load_best_model_at_end=False; save the best model from a callback's "
                                  "on_evaluate with trainer.save_model(...)")
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if args.world_size != world:
            raise UsageError(f"TrainingArguments sees {args.world_size} process(es) but torch.distributed has {world}: "
                             f"each rank would train alone",
                             hint="call coci_hpc.integrations.transformers.init_distributed() before creating "
                                  "TrainingArguments, and on CPUs pass use_cpu=True")

    # -- the loader -------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        dataset = getattr(self, "train_dataset", None)
        if dataset is None:
            raise UsageError("CociTrainer needs a train_dataset", hint="pass train_dataset=... to the trainer")
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise UsageError("CociTrainer's loader resumes by seeking a position in the data set: an iterable "
                             "data set without random access cannot be resumed without reading through it",
                             hint="use a map-style dataset (__len__ and __getitem__), e.g. a datasets.Dataset")
        args = self.args
        collator = self.data_collator
        if type(dataset).__module__.startswith("datasets."):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        batch = int(getattr(self, "_train_batch_size", args.train_batch_size))
        self._coci_batches = ResumableBatches(len(dataset), batch, rank=args.process_index, world_size=args.world_size,
                                              seed=args.data_seed if args.data_seed is not None else args.seed)
        params: dict[str, Any] = {"collate_fn": collator, "num_workers": args.dataloader_num_workers,
                                  "pin_memory": args.dataloader_pin_memory}
        if args.dataloader_num_workers > 0:
            params.update(persistent_workers=args.dataloader_persistent_workers,
                          prefetch_factor=args.dataloader_prefetch_factor,
                          worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers,
                                                 rank=args.process_index))
        return ResumableLoader(dataset, self._coci_batches, **params)

    # -- the Session's start, boundaries and end --------------------------------------------------
    def _coci_state(self) -> dict[str, Any]:
        if self._coci_batches is None:
            raise UsageError("CociTrainer's train loader was replaced (get_train_dataloader overridden)",
                             hint="keep CociTrainer's get_train_dataloader: the loader's position is resume state")
        # Accelerate's optimizer wrapper delegates its state; the store hooks the inner optimizer's
        # step (a two-phase save's snapshot must end before the next step changes the parameters).
        opt = self.optimizer
        opt = getattr(opt, "optimizer", opt) if type(opt).__name__ == "AcceleratedOptimizer" else opt
        state: dict[str, Any] = {"model": self.model, "optimizer": opt,
                                 "scheduler": _Delegate(self.lr_scheduler),
                                 "loader": self._coci_batches, "trainer_state": _TrainerStateEntry(self)}
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def _coci_begin(self) -> None:
        st: Any = self.state
        session = Session(self._coci_state(), total_steps=int(st.max_steps), **self._coci_kwargs)
        self._coci_session, self._coci_gen = session, cast(Generator[int, None, None], session.steps())
        try:
            step = next(self._coci_gen)          # restores the newest committed checkpoint, if any
        except StopIteration:                    # the store holds the final step: nothing to train
            self._coci_gen, step = None, int(st.max_steps)
        st.global_step = step
        self._coci_step = step
        b = self._coci_batches
        assert b is not None
        b.roll()
        ga = self.args.gradient_accumulation_steps
        if b.consumed_in_epoch() % ga:
            raise UsageError(f"the checkpoint stopped {b.consumed_in_epoch()} batches into an epoch, not a multiple "
                             f"of gradient_accumulation_steps={ga}",
                             hint="resume with the gradient_accumulation_steps the run was started with")
        # What the Trainer counts from here (loss averages, tokens per second) starts at the restored step.
        for attr in ("_globalstep_last_logged", "_initial_global_step"):
            setattr(self, attr, step)
        self._coci_rng = capture_rng() if step else None
        self._coci_loss = None

    def _coci_boundary(self) -> None:
        """After a step: the Session's step boundary (agree, save, maybe stop: SystemExit)."""
        step = int(self.state.global_step)
        if self._coci_gen is None or step == self._coci_step:
            return
        if step != self._coci_step + 1:
            raise UsageError(f"the Trainer went from step {self._coci_step} to {step} without a step boundary",
                             hint="do not change trainer.state.global_step")
        session = self._coci_session
        assert session is not None
        if self._coci_loss is not None:
            session.observe(self._coci_loss)
            self._coci_loss = None
        self._coci_step = step
        try:
            next(self._coci_gen)
        except StopIteration:                    # the last step: the Session saved it and finished
            self._coci_gen = None

    def _coci_step_end(self) -> None:
        b = self._coci_batches
        if b is not None:   # the Trainer's epoch counter is relative to where this process started
            self.state.epoch = b.epoch + b.consumed_in_epoch() / max(1, b.per_epoch)

    def _coci_end(self) -> None:
        self._coci_boundary()
        if self._coci_gen is not None:           # the Trainer stopped before max_steps (a callback)
            gen, self._coci_gen = self._coci_gen, None
            if self.args.process_index == 0:
                _say(f"the Trainer stopped at step {self._coci_step} before max_steps: no final checkpoint; "
                     f"the last one committed is the resume point")
            gen.close()

    # -- the Trainer's methods ----------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        self._check_resume(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint=None, trial=trial,  # type: ignore[misc]
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        except BaseException:
            gen, self._coci_gen = self._coci_gen, None
            if gen is not None:     # an exception inside a step: the Session asks its peers (survivors)
                gen.close()
            raise

    def _check_resume(self, resume: str | bool | None) -> None:
        if resume is None or isinstance(resume, bool):
            return                  # True: "resume", which a CociTrainer always does from its store
        from coci_hpc.runtime.config import resolve
        from coci_hpc.slurm.env import JobEnvironment

        environ = self._coci_kwargs.get("environ")
        explicit = {"ckpt_dir": os.fspath(self._coci_kwargs["ckpt_dir"])} if self._coci_kwargs.get("ckpt_dir") else {}
        root = resolve(explicit, environ, JobEnvironment.from_env(environ))[0].ckpt_dir
        latest = catalog.latest_step(root) if root.is_dir() else None
        given = os.path.realpath(os.fspath(resume))
        ok = {os.path.realpath(root)} | ({os.path.realpath(catalog.step_dir(root, latest))} if latest is not None else set())
        if given not in ok:
            raise UsageError(
                f"resume_from_checkpoint={os.fspath(resume)!r} disagrees with coci's store {root} (newest committed "
                f"step: {latest if latest is not None else 'none'}): a CociTrainer resumes from that store by itself",
                hint="call trainer.train() without resume_from_checkpoint; to start from other weights pass "
                     "coci={'init_from': PATH} (a Hugging Face safetensors directory, a torch.save file or a "
                     "coci checkpoint)")

    def _coci_started(self) -> None:
        if self._coci_session is None:
            raise UsageError("CociTrainer's callback was removed: nothing restores, saves or stops the run",
                             hint="keep the CociCallback that CociTrainer adds")

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int, device: Any) -> Any:
        self._coci_started()
        self._coci_boundary()
        if self._coci_rng is not None:
            # The first fetch after a restore draws from the RNG the uninterrupted run fetched with
            # (eval_on_start or on_epoch_begin callbacks of this process have drawn from it since).
            restore_rng(self._coci_rng)
            self._coci_rng = None
        return super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        d = loss.detach()
        self._coci_loss = d.clone() if self._coci_loss is None else self._coci_loss + d
        return loss

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        if args or "epoch" not in kwargs:
            check_private_api(Trainer)
            raise UsageError("Trainer._run_epoch was called in a way CociTrainer does not know",
                             hint=f"install the tested transformers: pip install 'transformers{TESTED}'")
        self._coci_started()
        ctrl: Any = self.control
        if self._coci_gen is None:               # restored at max_steps: the run is already done
            ctrl.should_training_stop = True
            return None
        b = self._coci_batches
        assert b is not None
        b.roll()
        kwargs["epoch"] = b.epoch                # the loader's epoch: this process may have started mid-run
        done = b.consumed_in_epoch()
        if done:
            # The rest of a started epoch, as the Trainer's own resume sees it but without its
            # skip through the first `done` batches: the loader is already there.
            ga = self.args.gradient_accumulation_steps
            kwargs["steps_in_epoch"] = b.per_epoch - done
            kwargs["num_update_steps_per_epoch"] = math.ceil(b.per_epoch / ga) - done // ga
        return super()._run_epoch(**kwargs)  # type: ignore[misc]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if not self._coci_warned_save and self.args.process_index == 0:
            _say(f"save_strategy={self.args.save_strategy!s}: the Trainer's own checkpoints are not written; "
                 f"coci's store holds the training state (set save_strategy='no'; export the model with "
                 f"trainer.save_model() or coci-ckpt)")
        self._coci_warned_save = True


class CociTrainer(CociTrainerMixin, Trainer):
    """``transformers.Trainer`` with coci_hpc's Session inside (see :class:`CociTrainerMixin`)."""
