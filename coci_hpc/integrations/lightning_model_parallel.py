"""Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) with coci_hpc's store.

::

    from coci_hpc.integrations.lightning import CociCallback
    from coci_hpc.integrations.lightning_model_parallel import CociModelParallelStrategy

    trainer = L.Trainer(strategy=CociModelParallelStrategy(), callbacks=[CociCallback()], ...)

Lightning's own ``ModelParallelStrategy`` keeps its checkpoint to itself: ``save_checkpoint`` and
``load_checkpoint`` write and read torch.distributed.checkpoint files at a path ("does not use the
CheckpointIO"), and it shards the model and builds its optimizers only after the callbacks'
``setup``. This subclass opens it to coci's store:

- :meth:`coci_objects` hands :class:`~coci_hpc.integrations.lightning.CociCallback` the sharded
  model and the optimizers themselves. The callback starts its session at ``on_fit_start``, once
  they exist, with them as state entries of their own: the Session's FSDP2 path (each rank writes
  its DTensor shards; a load reads each rank's own box straight into the live shards, an
  optimizer's moments keyed by parameter name), the one ``examples/train_fsdp.py`` uses.
- :meth:`coci_dump` gives the rest of Lightning's checkpoint dict (loops, schedulers, callbacks,
  the loader's position) without the model and optimizer state, which are already in the store
  beside it (``"state_dict"`` and ``"optimizer_states"`` are empty there).
- :meth:`load_checkpoint` of the store's path hands Lightning that dict from
  :class:`~coci_hpc.integrations.lightning.CociCheckpointIO`; the model and optimizers are loaded
  by then (this strategy's ``load_model_state_dict`` and ``load_optimizer_state_dict`` do nothing,
  as Lightning's own). Any other path (a ``ModelCheckpoint`` directory) is Lightning's
  torch.distributed.checkpoint route, unchanged.

Its checkpoint I/O is a ``CociCheckpointIO`` unless another is passed in ``plugins``.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.optim import Optimizer

from coci_hpc.errors import UsageError
from coci_hpc.integrations.lightning import CociCheckpointIO, is_store_path, refuse_store_save

MODEL_ENTRY, OPTIMIZER_ENTRY = "model", "optimizer"   # the session's state entries (optimizer_1, ... after the first)


class CociModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose model and optimizers go into coci's store, sharded.

    Takes ``ModelParallelStrategy``'s arguments. For FSDP2 over all ranks (one data-parallel
    dimension, the usual case) pass ``data_parallel_size=<world size>, tensor_parallel_size=1``:
    Lightning's ``"auto"`` makes it (nodes, devices per node), so the mesh, and with it how each
    rank's batches are drawn, would depend on the launch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dumping_for_store = False

    @property
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = CociCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    # -- what CociCallback asks of it ----------------------------------------------------------------
    def coci_objects(self) -> dict[str, Any]:
        """The sharded model and the optimizers as the session's state entries (set up by then)."""
        if self.lightning_module is None or not self.optimizers:
            raise AssertionError("CociModelParallelStrategy.coci_objects() before the strategy's setup")
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        objects: dict[str, Any] = {MODEL_ENTRY: self.lightning_module}
        for i, opt in enumerate(optimizers):
            objects[OPTIMIZER_ENTRY if i == 0 else f"{OPTIMIZER_ENTRY}_{i}"] = opt
        return objects

    @contextmanager
    def coci_dump(self) -> Iterator[None]:
        """While inside, Lightning's dict leaves out the model's and optimizers' state (the store
        has them as entries of their own): no get_model_state_dict / get_optimizer_state_dict."""
        self._dumping_for_store = True
        try:
            yield
        finally:
            self._dumping_for_store = False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self._dumping_for_store else super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {} if self._dumping_for_store else super().optimizer_state(optimizer)

    # -- Lightning's checkpoint paths ----------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Any | None = None) -> None:
        refuse_store_save(filepath)
        io = self.checkpoint_io
        if isinstance(io, CociCheckpointIO):
            io.require_callback("save a checkpoint")
        super().save_checkpoint(checkpoint, filepath, storage_options)   # a ModelCheckpoint's DCP directory

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if not is_store_path(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        io = self.checkpoint_io
        if not isinstance(io, CociCheckpointIO):
            raise UsageError(f"{checkpoint_path} is coci's store, but this Trainer's checkpoint I/O is "
                             f"{type(io).__name__}", hint="leave CociModelParallelStrategy its CociCheckpointIO")
        return io.load_checkpoint(checkpoint_path)
