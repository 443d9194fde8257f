"""A state whose ``state_dict()`` is a collective (ZeRO's consolidation, a full FSDP state dict,
a planner that broadcasts rank 0's view) must never be asked for it on one rank only: the other
ranks would not join and the run would hang until the process group's timeout."""
from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import clean_env, run_ranks

SCRIPT = r'''
import json, sys
import torch
import torch.distributed as dist
import coci_hpc

class Counted:
    """Replicated state whose state_dict() all-reduces (every rank must call it at the same point)."""
    def __init__(self):
        self.local = torch.zeros(4)
        self.calls = 0
    def state_dict(self):
        self.calls += 1
        total = self.local.clone()
        dist.all_reduce(total)
        return {"total": total}
    def load_state_dict(self, d):
        self.local = d["total"] / dist.get_world_size()

info = coci_hpc.init_distributed()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
counted = Counted()
session = coci_hpc.Session({"model": model, "optimizer": opt, "counted": counted}, 4,
                           ckpt_dir=sys.argv[1], policy="fixed:2", environ={})
for step in session.steps():
    loss = ddp(torch.ones(2, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    counted.local += 1
calls = session.comm.allgather(counted.calls)
if info.rank == 0:
    print("RESULT " + json.dumps({"calls": calls}), flush=True)
'''


def test_a_collective_state_dict_is_never_called_on_one_rank_only(tmp_path: Path) -> None:
    script = tmp_path / "collective_state.py"
    script.write_text(SCRIPT)
    # gloo's own timeout is shortened: before the fix rank 0 waited in its all_reduce for rank 1,
    # which waited in the session's broadcast, until this timeout failed the run.
    p = run_ranks(2, "-m", "mpi4py", str(script), str(tmp_path / "ck"), timeout=180,
                  env=clean_env(COCI_DIST_TIMEOUT_S="30"))
    out = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert out["calls"][0] == out["calls"][1] > 0      # every call was made on both ranks
    assert "step_000000004" in {d.name for d in (tmp_path / "ck").iterdir()}
