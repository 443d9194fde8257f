"""A peer lost while a synchronous save is inside collective MPI-IO (issue 13): the survivor's
main thread is blocked in a call that cannot be polled, and the guard's timer (``Comm.guard``)
starts the survivors' save from its thread. Two real MPI ranks under a Session, no cluster:
rank 1 stalls just before the final save's MPI-IO (the test-only faulty writer of
tests/faults/faulty.py, COCI_FAULT_SAVE_PAUSE_AT=mpiio), which to rank 0 is the same as a peer killed there (its
collective never completes). Rank 0 must commit the survivors' checkpoint of the last step within
seconds, with rank 1's per-rank state from its partner copy."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from coci_hpc.checkpoint import catalog as cat
from coci_hpc.runtime.events import read_events
from tests.conftest import ROOT, clean_env

FAULTY = ("-m", "tests.faults.faulty")   # installs the faulty writer the environment asks for
# The data write is collective MPI-IO on Lustre only (off Lustre each rank pwrites its own bytes:
# issue 33), so these runs make coci take the directory for Lustre (test-only COCI_FORCE_FSTYPE).
ON_LUSTRE = {"COCI_FORCE_FSTYPE": "lustre"}

SCRIPT = r'''
import sys, torch
import coci_hpc
from coci_hpc.runtime.data import ResumableSampler
from coci_hpc.comm import Comm
comm = Comm.world()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
# The same data on every rank (no DDP here to average the gradients): the model and the optimizer
# are replicated state and must stay equal, or the store refuses to mix the ranks' copies.
torch.manual_seed(10)
sampler = ResumableSampler(64, seed=1, rank=comm.rank, world_size=comm.size)
s = coci_hpc.Session({"model": model, "optimizer": opt, "loader": sampler}, total_steps=12,
                     ckpt_dir=sys.argv[1], policy="fixed:1000", environ={}, comm=comm, peer_timeout_s=3.0)
for step in s.steps():
    sampler.next_batch(4)          # per-rank state that moves, as a real loader's does
    loss = model(torch.randn(4, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    s.observe(loss.detach())
print("finished", comm.rank, flush=True)
'''


def test_a_peer_lost_inside_mpiio_is_noticed_by_the_guard_and_the_survivor_saves(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    ckpt = tmp_path / "ckpt"
    env = clean_env(COCI_FAULT_SAVE_PAUSE_S="10", COCI_FAULT_SAVE_PAUSE_AT="mpiio", **ON_LUSTRE)
    t0 = time.monotonic()
    # The survivor leaves with os._exit (no MPI_Finalize with a lost peer): mpiexec reports it.
    p = subprocess.run(["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, *FAULTY,
                        str(script), str(ckpt)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    out = p.stdout + p.stderr
    lost = [e for e in read_events(ckpt) if e["event"] == "peer_lost"]
    assert lost, out
    rec = lost[0]
    assert rec["survivor"] == 0 and rec["committed"] and rec["step"] == 12, (rec, out)
    assert "is stuck" in rec["how"] and "did not return within" in rec["how"], rec
    assert rec["commit_wall"] - rec["failure_wall"] < 10.0, rec
    assert rec["lost_ranks"] == [1]
    assert cat.latest_step(ckpt) == 12                       # the survivors' checkpoint of the last step
    assert "finished 0" not in out                          # rank 0 never got past the stuck save
    # Open MPI's "failed to TCP connect" warning after a lost peer is explained beside coci's line
    assert re.search(r"rank 0: peer lost at step \d+: .*Open MPI may now warn .*expected after a lost peer", out), out
    print(rec, f"{time.monotonic() - t0:.1f}s")


def test_a_process_left_behind_by_a_newer_attempt_neither_saves_nor_records(tmp_path: Path) -> None:
    """A host that stopped past SlurmdTimeout and ran again: its ranks belong to an attempt Slurm
    has replaced (requeued, started elsewhere). Here attempt 2's ``attempt_start`` is written while
    attempt 1 runs, then attempt 1 loses its peer as above: rank 0 must leave without a survivors'
    checkpoint, a ``peer_lost`` record or a requeue, which would act on the live attempt."""
    from coci_hpc.runtime.events import FILENAME, EventLog

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    ckpt = tmp_path / "ckpt"
    env = clean_env(COCI_FAULT_SAVE_PAUSE_S="10", COCI_FAULT_SAVE_PAUSE_AT="mpiio", **ON_LUSTRE)
    p = subprocess.Popen(["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, *FAULTY,
                          str(script), str(ckpt)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not any(e["event"] == "attempt_start" for e in read_events(ckpt)):
            assert time.monotonic() < deadline and p.poll() is None, "attempt 1 never started"
            time.sleep(0.02)
        EventLog(ckpt / FILENAME, attempt=2, job_id=None).write("attempt_start", nodes=["elsewhere"], ranks=2)
        out = p.communicate(timeout=120)[0]
    finally:
        p.kill()
    events = read_events(ckpt)
    assert [e["event"] for e in events if e["event"] != "losses"] == ["attempt_start", "attempt_start"], (events, out)
    assert "attempt 2 of this run has started since this attempt (1) began" in out, out
    assert "finished 0" not in out and cat.latest_step(ckpt) is None, out    # nothing saved


FSDP_SCRIPT = r'''
import hashlib, json, sys, torch
import coci_hpc
from coci_hpc.checkpoint import CheckpointManager
from coci_hpc.comm import Comm
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
comm = Comm.world()
coci_hpc.init_distributed(comm=comm)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.ReLU(), torch.nn.Linear(7, 6))
mesh = init_device_mesh("cpu", (comm.size,))
for layer in (model[0], model[2], model):
    fully_shard(layer, mesh=mesh)      # 7 rows over 2 ranks: uneven DTensor boxes
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
state = {"model": model, "optimizer": opt}

def train_step(step):
    opt.zero_grad()
    model(torch.randn(4, 10, generator=torch.Generator().manual_seed(100 + step))).pow(2).mean().backward()
    opt.step()

def digests():
    out = {}
    for name, t in [*model.state_dict().items(), *[(f"{i}/{k}", v) for i, st in opt.state_dict()["state"].items()
                                                    for k, v in st.items()]]:
        t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous().reshape(-1)
        out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    return out

mode, ckpt = sys.argv[1], sys.argv[2]
if mode == "train":
    s = coci_hpc.Session(state, total_steps=12, ckpt_dir=ckpt, policy="fixed:1000", environ={"COCI_MEMTIER_K": "3"},
                         comm=comm, peer_timeout_s=3.0)
    for step in s.steps():
        train_step(step)
        s.observe(torch.tensor(0.0))
    print("finished", comm.rank, flush=True)
elif mode == "load":
    step = CheckpointManager(ckpt, comm=comm).load_latest(state).step
    d = digests()
    if comm.rank == 0:
        print("DIGESTS", json.dumps({"step": step, "digests": d}), flush=True)
else:                                  # "ref N": N uninterrupted steps (the Session yields 0, 1, ...)
    for step in range(int(sys.argv[3])):
        train_step(step)
    d = digests()
    if comm.rank == 0:
        print("DIGESTS", json.dumps({"step": int(sys.argv[3]), "digests": d}), flush=True)
'''


def _digests(script: Path, *args: str) -> dict:
    import json

    p = subprocess.run(["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, str(script),
                        *args], capture_output=True, text=True, timeout=120, env=clean_env(), cwd=ROOT)
    line = next((l for l in p.stdout.splitlines() if l.startswith("DIGESTS ")), None)
    assert line is not None, p.stdout + p.stderr
    return json.loads(line[len("DIGESTS "):])


def test_fsdp2_state_the_survivor_saves_the_memory_tiers_newest_whole_step(tmp_path: Path) -> None:
    """The Session's peer-loss path with the memory tier (runtime/memtier.py, k = 3) on FSDP2
    state: rank 1 stalls inside the final save's MPI-IO; rank 0 alone writes the newest step it
    holds every rank's copy of (rank 1's from its partner copy) through the save transaction, the
    record says the memory tier served, and the checkpoint loads bit-identical to an
    uninterrupted run of that many steps."""
    script = tmp_path / "job.py"
    script.write_text(FSDP_SCRIPT)
    ckpt = tmp_path / "ckpt"
    env = clean_env(COCI_FAULT_SAVE_PAUSE_S="10", COCI_FAULT_SAVE_PAUSE_AT="mpiio", **ON_LUSTRE)
    p = subprocess.run(["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, *FAULTY,
                        str(script), "train", str(ckpt)], capture_output=True, text=True, timeout=180, env=env,
                       cwd=ROOT)
    out = p.stdout + p.stderr
    starts = [e for e in read_events(ckpt) if e["event"] == "attempt_start"]
    assert starts and starts[0]["memory_tier_every"] == 3 and starts[0]["survivors_off"] is None, (starts, out)
    lost = [e for e in read_events(ckpt) if e["event"] == "peer_lost"]
    assert lost, out
    rec = lost[0]
    assert rec["committed"] and rec["tier"] == "memory" and rec["lost_ranks"] == [1], (rec, out)
    assert rec["step"] in (9, 12), rec                  # a memory-tier step: at most k steps lost
    assert cat.latest_step(ckpt) == rec["step"]
    m = cat.read_step(ckpt, rec["step"])
    assert m["memory_tier"] and m["survivors_save"] and m["backend"] == "hdf5-memtier"
    assert any(t["kind"] == "dtensor" and len(t["boxes"]) == 2 for t in m["tensors"])
    assert f"survivors' checkpoint of step {rec['step']} (memory tier) committed" in out, out
    assert not list(ckpt.glob(".memtier-*/step*")), "the posted copies go after the commit"
    got = _digests(script, "load", str(ckpt))
    assert got == _digests(script, "ref", str(tmp_path / "unused"), str(rec["step"]))
