"""On a machine with CUDA: the state matrix saved from and loaded into the GPU (no fake), the
FSDP2 checkpoint read by a plain CPU process. Skipped without CUDA (marker ``cuda``); the whole
device check is ``bash tests/gpu/run``."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.check import matrix

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run bash tests/gpu/run on a GPU)")]


def test_state_matrix_on_the_gpu(tmp_path: Path) -> None:
    got = matrix("cuda", tmp_path)
    assert got["ok"], got


def test_side_stream_copies_read_the_values_the_current_stream_made() -> None:
    """HostCopies on a real device: copies queued on the side stream right after kernels that
    change the source (not yet run when the copies are queued) read the changed values, into
    page-locked memory, and are whole after the one wait; a registered buffer is released and
    registered again (a new buffer at the same size) without a CUDA error."""
    import numpy as np

    from coci_hpc.checkpoint import devices

    dev = torch.device("cuda")
    src = [torch.full((1 << 22,), float(i), device=dev) for i in range(4)]   # 16 MiB each
    for t in src:
        for _ in range(20):
            t.mul_(1.0001).add_(1.0)          # queued on the current stream, still running below
    bufs = [devices.pinned_host(t.numel() * 4) for t in src]
    copies = devices.HostCopies()
    for b, t in zip(bufs, src):
        copies.copy(torch.from_numpy(b), t)
    copies.wait()
    for b, t in zip(bufs, src):
        assert np.array_equal(b.view(np.float32), t.cpu().numpy())
    for b in bufs:
        devices.release_host(b)
    again = devices.pinned_host(1 << 20)
    devices.release_host(again)
    torch.cuda.synchronize()


def test_first_async_save_after_prepare_does_not_stall(tmp_path: Path) -> None:
    """prepare_async page-locks the snapshot's buffers in the background: the first save_async
    then blocks no more than 3x a later one (issue 32's goal), and the saves load bit-exact."""
    import time

    from coci_hpc.checkpoint import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(8, 2048, device="cuda")).pow(2).mean().backward()
        opt.step()

    step()
    state = {"model": model, "optimizer": opt}
    mgr = CheckpointManager(tmp_path, keep=3)
    assert mgr.prepare_async(state) > 0
    mgr._async.buffers.settle()
    stalls = []
    for s in (1, 2, 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mgr.save_async(s, state)
        stalls.append(time.perf_counter() - t0)
        want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        step()
        mgr.wait()
    mgr.close()
    fresh = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    CheckpointManager(tmp_path, keep=3).load(3, {"model": fresh})
    assert all(torch.equal(want[k], v.cpu()) for k, v in fresh.state_dict().items())
    assert stalls[0] <= 3 * max(min(stalls[1:]), 0.01), stalls
