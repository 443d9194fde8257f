"""A FAKE of how NCCL fails when a peer dies, on the CPU, for the NCCL watcher's tests only
(coci_hpc/runtime/ncclwatch.py). Real NCCL needs a GPU per rank; none is here.

What the watcher depends on is NCCL's failure behaviour, and that is all this fakes, over a real
gloo group that moves the data (so training through it computes what gloo would):

- a collective whose peer is gone never returns: gloo raises (a reset) or times out; the fake
  swallows that and keeps the caller waiting, as a NCCL kernel spins on the GPU;
- the caller's ``work.wait()`` stands for the host's wait on the CUDA stream (``loss.item()``, a
  ``.cpu()``); it ends only when the group is aborted (torch's ``_abort_process_group``, which
  calls ``abort()`` on every group, as on ``ProcessGroupNCCL``), and then raises, as a wait on an
  aborted NCCL communicator does with ``TORCH_NCCL_BLOCKING_WAIT`` (``ABORT_RETURNS=1`` in the
  environment: it returns instead, as ``.item()`` does once the aborted kernel has ended);
- the backend's name is ``fakenccl``: coci's ``backend_hangs()`` sees "nccl" in it.

Not faked, so not tested here: NCCL's watchdog, ``ncclCommAbort`` itself, CUDA streams and
device memory (what a GPU changes there is docs/explanation/gpu.md's, and needs 2+ GPUs).
Only ``allreduce`` and ``barrier`` exist: the test's training script averages its gradients itself.
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

NAME = "fakenccl"
ABORTED = "fake NCCL: the communicator was aborted (ncclCommAbort) while this collective waited"


class Pending:
    """The collectives in flight and how many failed, apart from the group: a gloo callback holds this,
    never the group, so the group (and the ProcessGroupGloo inside it) is never released on one of
    gloo's own threads (a ProcessGroupGloo destroyed there joins that thread: "Resource deadlock
    avoided", std::terminate; seen once in 6 loaded runs)."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.hung = 0                      # collectives whose peer failed them: the ones NCCL would hang in
        self.works: set[FakeNcclWork] = set()
        self.lock = threading.Lock()


class FakeNcclWork(dist.Work):
    def __init__(self, pending: Pending) -> None:
        super().__init__()
        self.aborted = pending.aborted
        self.released = threading.Event()     # the data arrived, or the group was aborted
        self.ok = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.released.wait()
        if self.ok or (self.aborted.is_set() and os.environ.get("ABORT_RETURNS") == "1"):
            return True
        raise RuntimeError(ABORTED)

    def is_completed(self) -> bool:
        return self.released.is_set()

    def is_success(self) -> bool:
        return self.ok


class FakeNcclGroup(dist.ProcessGroup):
    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.pending = Pending()
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("fake_nccl", store), rank, size, timeout)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    def _start(self, inner: Any) -> FakeNcclWork:
        pending = self.pending
        work = FakeNcclWork(pending)
        if pending.aborted.is_set():
            work.released.set()            # an aborted communicator: every later collective fails at once
            return work
        with pending.lock:
            pending.works.add(work)

        def done(fut: Any) -> None:        # on a gloo thread: refers to ``pending`` and ``work`` only
            try:
                fut.value()
            except Exception:  # noqa: BLE001 - the peer is gone: NCCL would hang, so the fake does
                pending.hung += 1
                return
            work.ok = True
            with pending.lock:
                pending.works.discard(work)
            work.released.set()
        inner.get_future().add_done_callback(done)
        return work

    def allreduce(self, tensors: Any, opts: Any = None) -> FakeNcclWork:
        return self._start(self._gloo.allreduce(tensors, opts) if opts is not None else self._gloo.allreduce(tensors))

    def barrier(self, opts: Any = None) -> FakeNcclWork:
        return self._start(self._gloo.barrier())

    def abort(self) -> None:
        self.pending.aborted.set()
        with self.pending.lock:
            pending, self.pending.works = self.pending.works, set()
        for work in pending:
            work.released.set()
        # For the end-to-end test: the abort reached this communicator while the hung collective waited.
        print(f"FAKE NCCL ABORT rank {self.rank()}: {len(pending)} waiting collective(s) released", flush=True)


def register() -> None:
    """Make ``init_process_group("fakenccl", ...)`` create a :class:`FakeNcclGroup` (once per process)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, lambda store, rank, size, timeout: FakeNcclGroup(store, rank, size, timeout),
                                      devices=["cpu"])
